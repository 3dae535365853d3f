"""Render -> build -> load, for one KernelSpec.

Lookup order in `load_module`: the in-process memo, AOT directories (REPLAYSSM_AOT_DIR, then the
`replayssm_jit_cache` package if its version is this package's), the JIT cache, and finally a JIT
build unless REPLAYSSM_DISABLE_JIT is set. A spec's folder, <root>/<uri>/, holds <uri>.so,
manifest.json (URI, source digest, the .so's size and sha256), <uri>.cu and, in a build folder,
.lock.

Guarantees:

- A module is loaded only if its manifest names the spec's URI and the current source digest, its
  arch list holds every arch asked for (REPLAYSSM_CUDA_ARCH_LIST, else the visible GPU's: a
  module built for 9.0a and 10.0a serves either), and the .so's size and sha256 equal the
  manifest's. The file hashed is the file loaded: JIT-cache
  loads hold the build lock, and a .so renamed over or deleted between hashing and dlopen raises
  JITCacheError instead of returning what was loaded. A truncated, corrupt or stale module in the
  JIT cache is rebuilt; one in an AOT directory is skipped with a warning, and named in the
  JITDisabledError when JIT is disabled.
- Builds of one folder are serialized by a `filelock.FileLock` on its .lock (flock(2) on Linux,
  which the OS drops when the holder dies): a killed build never blocks the next one, and the
  lock file stays in place, so every waiter locks the same file.
- A build first deletes whatever an earlier failed, killed or stale build left, compiles in a
  private scratch folder, renames the finished .so into place and then writes the manifest
  (atomically). <uri>.so is never a partial file, and a manifest is written only for a complete one.
- Processes that load one spec at once: one compiles, the others wait on the lock and load its .so.
- A folder that cannot be written (read-only, no permission, disk full) raises JITCacheError naming
  it and the OS error; a verified module in a read-only JIT cache still loads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import BinaryIO

import jinja2
import jinja2.meta
from filelock import FileLock

from replayssm_jit.families import get_family
from replayssm_jit.families.spec import KernelSpec, check_cuda_spec
from replayssm_jit.jit import env

logger = logging.getLogger("replayssm_jit")

# Flags every module gets. Exact FP32 arithmetic: no fast-math, no FMA contraction games.
BASE_CUDA_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas=-warn-spills"]


MANIFEST = "manifest.json"
_LOCK = ".lock"
_SCRATCH_PREFIX = ".building-"
# Errors a compiler reports only as text when the build folder's disk is full.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class JITDisabledError(RuntimeError):
    """A module is needed, REPLAYSSM_DISABLE_JIT is set and no usable AOT build of it exists."""


class JITCacheError(RuntimeError):
    """A JIT cache or build folder cannot be used: it cannot be written (read-only, no permission,
    disk full), or a module in it was replaced while it was being loaded."""


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


@cache
def _template_folders(root: str, name: str) -> frozenset[str]:
    """The folders of template `name` and of every template it includes or imports, so that a
    family whose template includes another's (KDA's GDN's) digests that family's headers too."""
    env = _jinja_env(root)
    folders, todo, seen = set(), [name], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        folders.add(Path(current).parent.as_posix())
        source = env.loader.get_source(env, current)[0]
        todo += [n for n in jinja2.meta.find_referenced_templates(env.parse(source)) if n]
    return frozenset(folders)


def _headers_digest(root: Path, folders: frozenset[str]) -> str:
    """Digest of the headers a module can include (common/ and its templates' folders), so
    that editing one changes the rendered source and invalidates stale prebuilt modules."""
    h = hashlib.sha256()
    paths = {p for folder in {"common", *folders} for p in (root / folder).rglob("*.cuh")}
    for path in sorted(paths):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def render(spec: KernelSpec) -> str:
    """The CUDA source of `spec` (deterministic; embeds a digest of the headers). Every CUDA
    route (JIT build, AOT build, load, prebuilt lookup) renders first, so a spec the templates
    do not build yet is refused here (check_cuda_spec) before anything is written."""
    check_cuda_spec(spec)
    root = template_root()
    template_name = get_family(spec.family).template
    body = _jinja_env(str(root)).get_template(template_name).render(**spec.template_context())
    digest = _headers_digest(root, _template_folders(str(root), template_name))
    return f"// {spec.uri}\n// headers {digest}\n{body}"


def source_digest(spec: KernelSpec) -> str:
    """Digest of the rendered source and the flags other than the targets: the manifest lists
    the archs apart, so that a module built for more archs than asked for still matches."""
    text = render(spec) + "|" + " ".join(cuda_flags([]))
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


# Runs tvm_ffi.cpp.build in a child process: the request comes as JSON on stdin, the .so path
# goes back on stdout, and an OSError comes back as its errno (exit status 3).
_BUILD_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)  # tvm_ffi logs the ninja output under its LOG_BUILD
request = json.load(sys.stdin)
try:
    import tvm_ffi.cpp
    path = tvm_ffi.cpp.build(**request)
except OSError as exc:
    print(json.dumps({"errno": exc.errno, "strerror": exc.strerror, "filename": exc.filename}))
    sys.exit(3)
print(json.dumps({"path": path}))
"""


def _tvm_ffi_build(name: str, source: Path, build_dir: Path, archs: list[str]) -> Path:
    """Compile `source` with tvm_ffi's ninja build in a child process, whose environment carries
    the settings tvm_ffi reads (CUDA_HOME, TVM_FFI_CUDA_ARCH_LIST) from our own: this process's
    environment is never written, and concurrent builds for other archs do not race."""
    cuda_home = env.cuda_home()
    child_env = {**os.environ, "CUDA_HOME": cuda_home, "TVM_FFI_CUDA_ARCH_LIST": " ".join(archs)}
    if env.verbose():
        child_env["TVM_FFI_CPP_EXTENSION_LOG_BUILD"] = "1"
    request = {
        "name": name,
        "cuda_files": [str(source)],
        "extra_cuda_cflags": cuda_flags(archs),
        "extra_ldflags": [f"-Wl,-rpath,{cuda_home}/lib64"],
        "extra_include_paths": [str(template_root())],
        "build_directory": str(build_dir),
        "backend": "cuda",
    }
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_CHILD], input=json.dumps(request), env=child_env,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode == 3:
        error = json.loads(done.stdout.strip().splitlines()[-1])
        raise OSError(error["errno"], error["strerror"], error["filename"])
    if done.returncode != 0:
        raise RuntimeError(
            f"building {name} failed (exit status {done.returncode}):\n{done.stderr}"
        )
    if env.verbose() and done.stderr.strip():
        logger.warning("build of %s:\n%s", name, done.stderr)
    return Path(json.loads(done.stdout.strip().splitlines()[-1])["path"])


def _cache_error(folder: Path, action: str, error: object) -> JITCacheError:
    return JITCacheError(
        f"JIT cache directory {folder}: cannot {action}: {error}. Make it writable (with free "
        "space), set REPLAYSSM_CACHE_DIR to another directory, or use AOT builds "
        "(REPLAYSSM_AOT_DIR)."
    )


@contextlib.contextmanager
def _writing(folder: Path, action: str) -> Iterator[None]:
    """OSErrors inside become a JITCacheError naming `folder`."""
    try:
        yield
    except OSError as exc:
        raise _cache_error(folder, action, exc) from exc


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold `folder`'s build lock (creating the folder and lock file if needed); a folder whose
    lock file cannot be opened for writing raises JITCacheError, as any unwritable folder does."""
    with _writing(folder, "create it and its lock file"):
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(folder / _LOCK)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _sha256(f: BinaryIO) -> str:
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _read_manifest(
    folder: Path, uri: str, digest: str, archs: list[str]
) -> tuple[dict | None, str | None]:
    """(manifest, None) if `folder`'s manifest describes this URI and digest and is built for
    every arch in `archs`; (None, why not) if something unusable is there; (None, None) if there
    is no build at all."""
    so_path, manifest_path = folder / f"{uri}.so", folder / MANIFEST
    try:
        text = manifest_path.read_text()
    except FileNotFoundError:
        if so_path.exists():
            return None, f"{so_path} has no {MANIFEST} beside it (an unfinished or foreign build)"
        return None, None
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{manifest_path} cannot be read: {exc}"
    try:
        manifest = json.loads(text)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        return None, f"{manifest_path} is damaged: expected a JSON object, found {text[:60]!r}"
    if manifest.get("uri") != uri:
        return None, f"{manifest_path} describes {manifest.get('uri')!r}, expected {uri!r}"
    if manifest.get("digest") != digest:
        return None, (
            f"{so_path} is stale: built from source digest {manifest.get('digest')!r}, the "
            f"current templates and flags give {digest!r}"
        )
    built = manifest.get("archs")
    if not isinstance(built, list) or not all(isinstance(arch, str) for arch in built):
        return None, f"{manifest_path} records no list of archs (found {built!r}); rebuild it"
    missing = [arch for arch in archs if arch not in built]
    if missing:
        return None, (
            f"{so_path} is built for {built!r}, which lacks {', '.join(map(repr, missing))} of "
            f"the archs asked for, {archs!r} (REPLAYSSM_CUDA_ARCH_LIST, else the GPU's)"
        )
    if not isinstance(manifest.get("so_size"), int) or not isinstance(
        manifest.get("so_sha256"), str
    ):
        return None, (
            f"{manifest_path} records no size and sha256 of {so_path.name} (written by an older "
            "replayssm_jit); rebuild it"
        )
    return manifest, None


def _content_problem(f: BinaryIO, so_path: Path, manifest: dict) -> str | None:
    size, want_size = os.fstat(f.fileno()).st_size, manifest["so_size"]
    if size != want_size:
        return f"{so_path} is truncated or damaged: {size} bytes, its manifest records {want_size}"
    sha, want_sha = _sha256(f), manifest["so_sha256"]
    if sha != want_sha:
        return (
            f"{so_path} is corrupt: sha256 {sha[:16]}..., its manifest records {want_sha[:16]}..."
        )
    return None


def _dlopen(so_path: Path):
    import tvm_ffi

    return tvm_ffi.load_module(str(so_path))


def _verified(folder: Path, uri: str, digest: str, archs: list[str], load: bool = False):
    """(the .so path, or its loaded module if `load`, None) for a verified build in `folder` for
    (at least) `archs`; (None, why not) for an unusable one; (None, None) where there is none."""
    manifest, problem = _read_manifest(folder, uri, digest, archs)
    if manifest is None:
        return None, problem
    so_path = folder / f"{uri}.so"
    try:
        f = open(so_path, "rb")  # noqa: SIM115 (held open across dlopen)
    except FileNotFoundError:
        return None, f"{so_path} is missing (its {MANIFEST} is there)"
    except OSError as exc:
        return None, f"{so_path} cannot be read: {exc}"
    with f:
        problem = _content_problem(f, so_path, manifest)
        if problem or not load:
            return (None, problem) if problem else (so_path, None)
        hashed = os.fstat(f.fileno())
        module = _dlopen(so_path)
    try:
        unchanged = os.path.samestat(hashed, os.stat(so_path))
    except FileNotFoundError:
        unchanged = False
    if not unchanged:
        raise JITCacheError(
            f"{so_path} was replaced while it was being loaded (a concurrent build with other "
            "settings?), so what was loaded is unverified; load it again in a new process"
        )
    return module, None


def _clear(folder: Path) -> None:
    """Delete everything in `folder` but its lock: outputs of earlier failed or killed builds."""
    for entry in folder.iterdir():
        if entry.name == _LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            # An orphaned compiler of a killed build may still write here; it is never read.
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _compile(uri: str, source: Path, scratch: Path, archs: list[str], folder: Path) -> Path:
    try:
        return _tvm_ffi_build(uri, source, scratch, archs)
    except OSError as exc:
        if exc.errno in (*_DISK_FULL, errno.EACCES, errno.EPERM, errno.EROFS):
            raise _cache_error(folder, "compile into it", exc) from exc
        raise
    except RuntimeError as exc:
        for code in _DISK_FULL:
            if os.strerror(code) in str(exc):
                raise _cache_error(
                    folder, "compile into it", f"{os.strerror(code)}; compiler output:\n{exc}"
                ) from exc
        raise


def _library_size_sha(path: Path) -> tuple[int, str]:
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise RuntimeError(f"the build reported {path}, which does not exist") from None
    with f:
        head = f.read(4)
        if head != b"\x7fELF":
            raise RuntimeError(
                f"the build's output {path} is not a shared library: expected an ELF file, "
                f"found {os.fstat(f.fileno()).st_size} bytes starting {head!r}"
            )
        f.seek(0)
        return os.fstat(f.fileno()).st_size, _sha256(f)


def _build_locked(spec: KernelSpec, folder: Path, archs: list[str], digest: str) -> Path:
    """The verified .so in `folder`, compiled first unless there is one. Hold the lock."""
    found, problem = _verified(folder, spec.uri, digest, archs)
    if found is not None:
        for entry in folder.glob(f"{_SCRATCH_PREFIX}*"):  # a build killed after publishing
            shutil.rmtree(entry, ignore_errors=True)
        return found
    if problem:
        logger.warning("rebuilding %s: %s", spec.uri, problem)
    started = time.perf_counter()
    source, so_path = folder / f"{spec.uri}.cu", folder / f"{spec.uri}.so"
    with _writing(folder, "clear the previous build and write the source"):
        _clear(folder)
        write_if_different(source, render(spec))
        scratch = Path(tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=folder))
    try:
        built = _compile(spec.uri, source, scratch, archs, folder)
        size, sha = _library_size_sha(built)
        manifest = {"uri": spec.uri, "digest": digest, "archs": archs, "so_size": size,
                    "so_sha256": sha}  # fmt: skip
        with _writing(folder, "publish the built module"):
            os.replace(built, so_path)  # atomic: so_path is never a partial file
            write_if_different(folder / MANIFEST, json.dumps(manifest, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if env.verbose():
        logger.warning("built %s in %.1f s", spec.uri, time.perf_counter() - started)
    return so_path


def build(spec: KernelSpec, out_dir: Path | None = None, archs: list[str] | None = None) -> Path:
    """The .so of `spec` in `out_dir` (default: the JIT cache), compiled unless a verified build
    of the current source is there. Safe across processes and threads."""
    archs = archs or env.cuda_arch_list()
    folder = (out_dir or env.cache_dir() / "build") / spec.uri
    with _locked(folder):
        return _build_locked(spec, folder, archs, source_digest(spec))


_WARNED_PACKAGES: set[str] = set()


def _refused_cache_package() -> list[str]:
    """[why the installed replayssm_jit_cache is refused] (logged once per process), or []."""
    _, problem = env.cache_package()
    if problem is None:
        return []
    if problem not in _WARNED_PACKAGES:
        _WARNED_PACKAGES.add(problem)
        logger.warning("skipping AOT modules: %s", problem)
    return [problem]


def find_prebuilt(spec: KernelSpec) -> Path | None:
    """A verified AOT or JIT-cache build of `spec` (current source digest, and .so bytes that
    match its manifest); unusable ones are logged and skipped."""
    _refused_cache_package()
    digest, archs = source_digest(spec), env.cuda_arch_list()
    for root in [*env.aot_dirs(), env.cache_dir() / "build"]:
        found, problem = _verified(root / spec.uri, spec.uri, digest, archs)
        if found is not None:
            return found
        if problem:
            logger.warning("ignoring prebuilt module: %s", problem)
    return None


_LOADED: dict[str, object] = {}


def _load_jit(spec: KernelSpec, archs: list[str], digest: str, refused: list[str]):
    folder = env.cache_dir() / "build" / spec.uri
    if env.jit_disabled():
        module, problem = _verified(folder, spec.uri, digest, archs, load=True)
        if module is None:
            searched = [str(p) for p in env.aot_dirs()] or ["(no AOT directory configured)"]
            refused = [*refused, *([problem] if problem else [])]
            raise JITDisabledError(
                f"REPLAYSSM_DISABLE_JIT is set and specialization {spec.uri!r} has no usable AOT "
                f"build; searched {', '.join(searched)}."
                + "".join(f" Refused: {why}." for why in refused)
                + " Build it with `python -m replayssm_jit aot --out DIR` and point "
                "REPLAYSSM_AOT_DIR at DIR."
            )
        return module
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_locked(folder))
        except JITCacheError:
            # A cache that cannot be written can still serve a verified build.
            module, _ = _verified(folder, spec.uri, digest, archs, load=True)
            if module is None:
                raise
            return module
        _build_locked(spec, folder, archs, digest)
        module, problem = _verified(folder, spec.uri, digest, archs, load=True)
    if module is None:
        raise RuntimeError(f"the module just built is unusable: {problem}")
    return module


def load_module(spec: KernelSpec):
    """The loaded tvm-ffi module of `spec`: AOT first, then the JIT cache, then a build."""
    if spec.uri in _LOADED:
        return _LOADED[spec.uri]
    archs = env.cuda_arch_list()
    digest = source_digest(spec)
    refused = _refused_cache_package()
    for root in env.aot_dirs():
        module, problem = _verified(root / spec.uri, spec.uri, digest, archs, load=True)
        if module is not None:
            break
        if problem:
            logger.warning("skipping AOT module: %s", problem)
            refused.append(problem)
    else:
        module = _load_jit(spec, archs, digest, refused)
    _LOADED[spec.uri] = module
    return module
