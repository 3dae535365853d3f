"""Render -> build -> load, for one KernelSpec.

Lookup order in `load_module`: the in-process memo, AOT directories (REPLAYSSM_AOT_DIR,
then the `replayssm_jit_cache` package), the JIT cache, and finally a JIT build unless
REPLAYSSM_DISABLE_JIT is set. Builds hold a file lock, so concurrent processes are safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from functools import cache
from pathlib import Path

import jinja2
from filelock import FileLock

from replayssm_jit.families import get_family
from replayssm_jit.jit import env
from replayssm_jit.spec import KernelSpec

logger = logging.getLogger("replayssm_jit")

# Flags every module gets. Exact FP32 arithmetic: no fast-math, no FMA contraction games.
BASE_CUDA_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas=-warn-spills"]


class JITDisabledError(RuntimeError):
    """A module is needed, REPLAYSSM_DISABLE_JIT is set and no AOT build of it exists."""


def template_root() -> Path:
    """templates/ of a source checkout, or the copy shipped inside the wheel."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / "common").is_dir():
            return candidate
    raise RuntimeError(f"replayssm_jit templates not found next to {here}")


@cache
def _jinja_env(root: str) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(root),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _headers_digest(root: Path, folder: str) -> str:
    """Digest of the headers a module can include (common/ and its template's folder), so
    that editing one changes the rendered source and invalidates stale prebuilt modules."""
    h = hashlib.sha256()
    for path in sorted([*(root / "common").rglob("*.cuh"), *(root / folder).rglob("*.cuh")]):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def render(spec: KernelSpec) -> str:
    """The CUDA source of `spec` (deterministic; embeds a digest of the headers)."""
    root = template_root()
    template_name = get_family(spec.family).template
    body = _jinja_env(str(root)).get_template(template_name).render(**spec.template_context())
    folder = Path(template_name).parent.as_posix()
    return f"// {spec.uri}\n// headers {_headers_digest(root, folder)}\n{body}"


def source_digest(spec: KernelSpec, archs: list[str]) -> str:
    text = render(spec) + "|" + " ".join(cuda_flags(archs))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_if_different(path: Path, text: str) -> bool:
    """Write `text` unless the file already holds it (keeps mtimes, so ninja stays idle)."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def cuda_flags(archs: list[str]) -> list[str]:
    flags = [*BASE_CUDA_FLAGS, *env.gencode_flags(archs)]
    level = env.debug_level()
    if level >= 2:
        flags.append("-G")
    elif level == 1:
        flags.append("-lineinfo")
    return flags


def _tvm_ffi_build(name: str, source: Path, build_dir: Path, archs: list[str]) -> Path:
    import tvm_ffi.cpp

    cuda_home = env.cuda_home()
    # tvm_ffi reads these; set them from our own settings so users never meet its guesses.
    os.environ["CUDA_HOME"] = cuda_home
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = " ".join(archs)
    if env.verbose():
        os.environ["TVM_FFI_CPP_EXTENSION_LOG_BUILD"] = "1"
    out = tvm_ffi.cpp.build(
        name,
        cuda_files=[str(source)],
        extra_cuda_cflags=cuda_flags(archs),
        extra_ldflags=[f"-Wl,-rpath,{cuda_home}/lib64"],
        extra_include_paths=[str(template_root())],
        build_directory=str(build_dir),
        backend="cuda",
    )
    return Path(out)


def build(spec: KernelSpec, out_dir: Path | None = None, archs: list[str] | None = None) -> Path:
    """Render and compile `spec`; return the .so path. Safe across processes."""
    archs = archs or env.cuda_arch_list()
    build_dir = (out_dir or env.cache_dir() / "build") / spec.uri
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with FileLock(str(build_dir / ".lock")):
        source = build_dir / f"{spec.uri}.cu"
        write_if_different(source, render(spec))
        so_path = _tvm_ffi_build(spec.uri, source, build_dir, archs)
        write_if_different(
            build_dir / "manifest.json",
            json.dumps(
                {"uri": spec.uri, "digest": source_digest(spec, archs), "archs": archs},
                indent=1,
            ),
        )
    if env.verbose():
        logger.warning("built %s in %.1f s", spec.uri, time.perf_counter() - started)
    return so_path


def find_prebuilt(spec: KernelSpec) -> Path | None:
    """An AOT or cached build of `spec` whose manifest digest matches the current source."""
    archs = env.cuda_arch_list()
    digest = source_digest(spec, archs)
    for root in [*env.aot_dirs(), env.cache_dir() / "build"]:
        folder = root / spec.uri
        so_path, manifest = folder / f"{spec.uri}.so", folder / "manifest.json"
        if so_path.exists() and manifest.exists():
            if json.loads(manifest.read_text()).get("digest") == digest:
                return so_path
            logger.warning(
                "ignoring stale prebuilt %s (source changed since it was built)", so_path
            )
    return None


_LOADED: dict[str, object] = {}


def load_module(spec: KernelSpec):
    """The loaded tvm-ffi module of `spec`: AOT first, then the JIT cache, then a build."""
    if spec.uri in _LOADED:
        return _LOADED[spec.uri]
    import tvm_ffi

    so_path = find_prebuilt(spec)
    if so_path is None:
        if env.jit_disabled():
            searched = [str(p) for p in env.aot_dirs()] or ["(no AOT directory configured)"]
            raise JITDisabledError(
                f"REPLAYSSM_DISABLE_JIT is set and specialization {spec.uri!r} is not AOT-built; "
                f"searched {', '.join(searched)}. Build it with "
                f"`python -m replayssm_jit aot --out DIR` and point REPLAYSSM_AOT_DIR at DIR."
            )
        so_path = build(spec)
    module = tvm_ffi.load_module(str(so_path))
    _LOADED[spec.uri] = module
    return module
