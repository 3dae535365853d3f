"""Environment variables that steer building and loading; read at call time, never at import.

| variable                      | meaning                                                        |
|-------------------------------|----------------------------------------------------------------|
| REPLAYSSM_CACHE_DIR           | JIT cache root (default ~/.cache/replayssm_jit)                |
| REPLAYSSM_CUDA_ARCH_LIST      | e.g. "9.0a" or "8.0 9.0a" (default: the visible GPU; 9.0a without one) |
| REPLAYSSM_JIT_VERBOSE         | 1: log build commands and timings                              |
| REPLAYSSM_JIT_DEBUG           | 1: -lineinfo; 2: device debug (-G)                             |
| REPLAYSSM_DISABLE_JIT         | 1: never compile; a missing AOT module is an error             |
| REPLAYSSM_AOT_DIR             | os.pathsep-separated directories of AOT-built modules          |
| REPLAYSSM_MAX_JOBS            | parallel builds for AOT (default: CPU count)                   |
| REPLAYSSM_VLLM                | 1: the vLLM plugin routes Mamba-2 decode to ReplaySSM          |
| REPLAYSSM_VLLM_WINDOW         | the replay window L the vLLM plugin's layers use (default 16)  |
| REPLAYSSM_VLLM_PAGES          | 0: the plugin's rings apart from vLLM's pages (default 1: in)  |
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from replayssm_jit.core.version import __version__


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("REPLAYSSM_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "replayssm_jit"


def jit_disabled() -> bool:
    return _flag("REPLAYSSM_DISABLE_JIT")


def verbose() -> bool:
    return _flag("REPLAYSSM_JIT_VERBOSE")


def debug_level() -> int:
    raw = os.environ.get("REPLAYSSM_JIT_DEBUG", "0").strip()
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"REPLAYSSM_JIT_DEBUG must be 0, 1 or 2, got {raw!r}") from exc


# The installable wheel of prebuilt modules: `python -m replayssm_jit.aot wheel` builds it.
CACHE_PACKAGE = "replayssm_jit_cache"
CACHE_DISTRIBUTION = "replayssm-jit-cache"


def cache_package() -> tuple[list[Path], str | None]:
    """The module directories of the installed `replayssm_jit_cache` package and None; or no
    directories and why the package is refused (its public version is not this replayssm_jit's,
    whose templates its modules were built from; the local label after '+' names CUDA and the
    archs, which the manifests check); ([], None) where none is installed."""
    try:
        import replayssm_jit_cache  # type: ignore[import-not-found]
    except ImportError:
        return [], None

    where = ", ".join(replayssm_jit_cache.__path__)
    found = getattr(replayssm_jit_cache, "__version__", None)
    if not isinstance(found, str) or found.partition("+")[0] != __version__:
        what = "records no __version__" if found is None else f"is version {found!r}"
        return [], (
            f"the installed {CACHE_DISTRIBUTION} at {where} {what}, expected {__version__!r} "
            f"(with any local label), this replayssm_jit's; install "
            f"{CACHE_DISTRIBUTION}=={__version__} or uninstall it"
        )
    return [Path(p) / "modules" for p in replayssm_jit_cache.__path__], None


def aot_dirs() -> list[Path]:
    """AOT module directories, in priority order: REPLAYSSM_AOT_DIR, then the
    optional `replayssm_jit_cache` package (a wheel of prebuilt modules) if its version is ours."""
    dirs = [
        Path(p).expanduser() for p in os.environ.get("REPLAYSSM_AOT_DIR", "").split(os.pathsep) if p
    ]
    return dirs + cache_package()[0]


def max_jobs() -> int:
    raw = os.environ.get("REPLAYSSM_MAX_JOBS")
    return max(1, int(raw)) if raw else max(1, os.cpu_count() or 1)


def _visible_gpu_arch() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            # Hopper's wgmma/setmaxnreg live only in the arch-specific target.
            return f"{major}.{minor}a" if major >= 9 else f"{major}.{minor}"
    except Exception:
        return None
    return None


def cuda_arch_list(default: list[str] | None = None) -> list[str]:
    """Target archs as "M.m[a]" strings: REPLAYSSM_CUDA_ARCH_LIST, else `default`, else the
    visible GPU's, else 9.0a."""
    raw = os.environ.get("REPLAYSSM_CUDA_ARCH_LIST", "").replace(",", " ").split()
    archs = raw or default or [_visible_gpu_arch() or "9.0a"]
    for arch in archs:
        major, _, minor = arch.partition(".")
        if not (major.isdigit() and minor.rstrip("af").isdigit()):
            raise ValueError(
                f"REPLAYSSM_CUDA_ARCH_LIST entries must look like '9.0a' or '8.0', got {arch!r}"
            )
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        cc = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
    return flags


def cuda_home() -> str:
    """The toolkit root. /usr/local/bin/nvcc is often a wrapper, so look for cudart too."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        if (root / "include" / "cuda_runtime.h").exists():
            return str(root)
    raise RuntimeError(
        "cannot find the CUDA toolkit (no include/cuda_runtime.h next to nvcc or in "
        "/usr/local/cuda); set CUDA_HOME"
    )


def nvcc_available() -> bool:
    try:
        cuda_home()
    except RuntimeError:
        return False
    return shutil.which("nvcc") is not None or (Path(cuda_home()) / "bin" / "nvcc").exists()


def vllm_plugin_enabled() -> bool:
    return _flag("REPLAYSSM_VLLM")


def vllm_window() -> int:
    value = os.environ.get("REPLAYSSM_VLLM_WINDOW", "16").strip()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"REPLAYSSM_VLLM_WINDOW: expected a positive integer, got {value!r}")
    return int(value)


def vllm_pages() -> bool:
    """Whether the vLLM plugin declares its rings, scales and cursors in each layer's cache
    pages (the default) or allocates them apart at the layer's first decode (0)."""
    value = os.environ.get("REPLAYSSM_VLLM_PAGES", "1").strip().lower()
    if value not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"REPLAYSSM_VLLM_PAGES: expected 1 or 0, got {value!r}")
    return value in ("1", "true", "yes", "on")
