"""Ahead-of-time builds: many specializations compiled in parallel into one folder.

The folder gets one subfolder per specialization (<uri>/<uri>.so and manifest.json); point
REPLAYSSM_AOT_DIR at it and the loader uses these builds before any JIT. jit/wheel.py packages
such a folder as the replayssm-jit-cache wheel; the command line is replayssm_jit/cli/aot.py.
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from replayssm_jit.families.spec import KernelSpec, check_cuda_spec
from replayssm_jit.jit.build import build

__all__ = ["build_aot"]


def build_aot(
    specs: list[KernelSpec], out: Path, jobs: int, archs: list[str] | None = None
) -> list[Path]:
    """Build `specs` in parallel into `out`, keeping only each module and its manifest."""
    for spec in specs:  # (refused before any build starts: render() would, one by one)
        check_cuda_spec(spec)
    out.mkdir(parents=True, exist_ok=True)
    built = []
    with (
        tempfile.TemporaryDirectory(prefix="replayssm-aot-") as scratch,
        ThreadPoolExecutor(jobs) as pool,
    ):
        futures = {pool.submit(build, spec, Path(scratch), archs): spec for spec in specs}
        for future in tqdm(as_completed(futures), total=len(futures), desc="AOT", unit="module"):
            spec = futures[future]
            so_path = future.result()
            dest = out / spec.uri
            dest.mkdir(exist_ok=True)
            shutil.copy2(so_path, dest / so_path.name)
            shutil.copy2(so_path.parent / "manifest.json", dest / "manifest.json")
            built.append(dest / so_path.name)
    return built
