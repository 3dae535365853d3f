"""The JIT cache under concurrency and damage, on the CPU (issue 21 §5): processes that build one
spec at once give one build and working loads; a truncated, corrupt or stale module is rebuilt or
refused, never loaded; an unwritable (read-only or full) cache raises an error naming it; a build
killed mid-compile blocks nothing.

Most tests use a stand-in compiler that writes a real, g++-built tvm-ffi module (answer(x) =
x + 41) in slow chunks, so partial files exist while other processes look, and loads are real
dlopens. One test does the same with nvcc. Child processes are forked: no re-import per child.
"""

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path

import pytest

from replayssm_jit.cli.aot import parse_spec
from replayssm_jit.jit import build
from replayssm_jit.jit.aot import build_aot

# A small spec (Mamba-2 P = 24, N = 64, L = 1, FP32, no flags): a quick real nvcc build.
SMALL = (
    "mamba2:headdim=24,dstate=64,heads_per_group=2,window=1,act_dtype=f32,state_dtype=f32,flags="
)
OTHER = (
    "mamba2:headdim=24,dstate=64,heads_per_group=2,window=4,act_dtype=f32,state_dtype=f32,flags="
)
_FORK = multiprocessing.get_context("fork")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeCompiler:
    """Stands in for `_tvm_ffi_build`: logs the call (a file, so counts add up across processes),
    leaves a half-written object, then writes the tiny module in `chunk`-byte pieces `delay`
    seconds apart. With `hang_at`, touches `marker` and sleeps once that many bytes are out."""

    def __init__(self, data: bytes, log: Path):
        self.data, self.log = data, log
        self.chunk, self.delay = len(data), 0.0
        self.hang_at: int | None = None
        self.marker: Path | None = None
        self.fail: BaseException | None = None

    def __call__(self, name, source, scratch, archs):
        folder = Path(scratch).parent
        with open(self.log, "a") as log:  # O_APPEND: whole lines from concurrent writers
            seen = sorted(p.name for p in folder.iterdir())
            log.write(json.dumps({"pid": os.getpid(), "seen": seen}) + "\n")
        if self.fail is not None:
            raise self.fail
        (Path(scratch) / "cuda_0.o").write_bytes(b"\x7fELF half an object")
        out = Path(scratch) / f"{name}.so"
        with open(out, "wb") as f:
            for start in range(0, len(self.data), self.chunk):
                if self.hang_at is not None and start >= self.hang_at:
                    f.flush()
                    self.marker.touch()
                    time.sleep(600)
                f.write(self.data[start : start + self.chunk])
                f.flush()
                time.sleep(self.delay)
        return out

    def builds(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def fake_compiler(tiny_so, tmp_path, monkeypatch):
    fake = FakeCompiler(tiny_so, tmp_path / "builds.log")
    monkeypatch.setattr(build, "_tvm_ffi_build", fake)
    return fake


@pytest.fixture
def loads(monkeypatch):
    """(path, sha256) of every file handed to tvm_ffi.load_module."""
    import tvm_ffi

    real, seen = tvm_ffi.load_module, []

    def recording_load(path, *args, **kwargs):
        seen.append((str(path), _sha(Path(path).read_bytes())))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(tvm_ffi, "load_module", recording_load)
    return seen


def _child_main(out: str, fn, args) -> None:
    try:
        result = {"ok": fn(*args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))


def _fork(tmp_path: Path, name: str, fn, *args):
    """A forked child running fn(*args); its result (or traceback) lands in a JSON file."""
    out = tmp_path / f"{name}.json"
    proc = _FORK.Process(target=_child_main, args=(str(out), fn, args), daemon=True)
    proc.start()
    return proc, out


def _result(proc, out: Path, timeout: float = 120):
    proc.join(timeout)
    assert proc.exitcode == 0, f"child {proc.pid}: exit code {proc.exitcode}"
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result["ok"]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def _folder(spec) -> Path:
    return build.env.cache_dir() / "build" / spec.uri


def _load_and_report(spec, go, function: str):
    assert go.wait(120), "the parent never said go"
    module = build.load_module(spec)
    so = _folder(spec) / f"{spec.uri}.so"
    value = (
        getattr(module, function)(1)
        if function == "answer"
        else callable(getattr(module, function))
    )
    return {"pid": os.getpid(), "sha": _sha(so.read_bytes()), "value": value}


def _race(tmp_path: Path, spec, n: int, function: str, watch=None) -> list[dict]:
    """n forked processes call load_module(spec) at one signal; `watch()` runs in a thread of
    this process meanwhile, until all are done."""
    go = _FORK.Event()
    children = [
        _fork(tmp_path, f"child{i}", _load_and_report, spec, go, function) for i in range(n)
    ]
    stop = threading.Event()
    watcher = threading.Thread(target=lambda: watch(stop), daemon=True) if watch else None
    go.set()
    if watcher:
        watcher.start()
    try:
        return [_result(proc, out, timeout=300) for proc, out in children]
    finally:
        stop.set()
        if watcher:
            watcher.join(10)
        for proc, _ in children:
            if proc.is_alive():
                proc.kill()


# --- 1. many processes, one build -----------------------------------------------------------


def test_eight_processes_build_once_and_none_sees_a_partial_module(
    jit_cache, fake_compiler, tiny_so, tmp_path
):
    """8 processes load one spec at once while the (stand-in) compiler takes ~1 s writing the
    module in pieces: one build, eight loads of the complete module; meanwhile this process
    sees partial files in the builder's scratch folder, never at <uri>.so, and find_prebuilt
    never returns anything but the complete module."""
    spec = parse_spec(SMALL)
    fake_compiler.chunk, fake_compiler.delay = 2048, 1.0 / (len(tiny_so) / 2048)
    folder = _folder(spec)
    so, full = folder / f"{spec.uri}.so", len(tiny_so)
    seen = {"partial in scratch": 0, "partial at the module path": 0, "found": 0, "bad found": 0}

    def watch(stop):
        while not stop.is_set():
            if so.exists() and so.stat().st_size != full:
                seen["partial at the module path"] += 1
            for part in folder.glob(f"{build._SCRATCH_PREFIX}*/*.so"):
                with contextlib.suppress(FileNotFoundError):  # renamed or removed meanwhile
                    if part.stat().st_size < full:
                        seen["partial in scratch"] += 1
            found = build.find_prebuilt(spec)
            if found is not None:
                seen["found"] += 1
                seen["bad found"] += _sha(found.read_bytes()) != _sha(tiny_so)
            time.sleep(0.003)

    results = _race(tmp_path, spec, 8, "answer", watch)
    assert len(fake_compiler.builds()) == 1, fake_compiler.builds()
    assert len({r["pid"] for r in results}) == 8
    assert all(r["value"] == 42 and r["sha"] == _sha(tiny_so) for r in results), results
    assert seen["partial in scratch"] > 0, f"no race happened: {seen}"
    assert seen["partial at the module path"] == 0 and seen["bad found"] == 0, seen
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".lock", build.MANIFEST, f"{spec.uri}.cu", f"{spec.uri}.so"]
    )
    manifest = json.loads((folder / build.MANIFEST).read_text())
    assert manifest["so_sha256"] == _sha(tiny_so) and manifest["so_size"] == full


def test_threads_of_one_process_take_the_build_lock_in_turn(jit_cache):
    """AOT builds run in threads: a second thread asking for a folder's lock waits for the first
    to let go, and neither holds it after."""
    folder, order = jit_cache / "build" / "some-uri", []
    held, second_started = threading.Event(), threading.Event()

    def first():
        with build._locked(folder):
            held.set()
            assert second_started.wait(10)
            time.sleep(0.3)  # the second thread is waiting on the lock meanwhile
            order.append("first out")

    def second():
        assert held.wait(10)
        second_started.set()
        with build._locked(folder):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert order == ["first out", "second in"]
    fd = os.open(folder / build._LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a thread still held it
    finally:
        os.close(fd)


# --- 2. damaged or stale modules ------------------------------------------------------------

DAMAGES = ["truncated", "empty", "flipped-byte", "stale", "other-spec", "no-manifest",
           "torn-manifest", "old-manifest", "missing-module"]  # fmt: skip


def _damage(folder: Path, spec, how: str, tiny: bytes) -> str:
    """Damage the build in `folder`; return what the refusal must say."""
    so, manifest_path = folder / f"{spec.uri}.so", folder / build.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    if how == "truncated":
        so.write_bytes(tiny[: len(tiny) // 2])
        return f"{so} is truncated or damaged: {len(tiny) // 2} bytes, its manifest records {len(tiny)}"
    if how == "empty":
        so.write_bytes(b"")
        return f"{so} is truncated or damaged: 0 bytes, its manifest records {len(tiny)}"
    if how == "flipped-byte":  # same size; likely still loadable, so only the hash stops it
        data = bytearray(tiny)
        data[len(data) // 2] ^= 0xFF
        so.write_bytes(bytes(data))
        return f"{so} is corrupt: sha256 {_sha(bytes(data))[:16]}..., its manifest records {_sha(tiny)[:16]}..."
    if how == "stale":
        # a whole, self-consistent build of other source or flags: loadable, but not this one
        stale, old = tiny + b"\0" * 64, "0123456789abcdef"  # another source's
        so.write_bytes(stale)
        manifest.update(digest=old, so_size=len(stale), so_sha256=_sha(stale))
        manifest_path.write_text(json.dumps(manifest))
        return f"{so} is stale: built from source digest {old!r}"
    if how == "other-spec":  # another spec's module and manifest copied here
        other = parse_spec(OTHER)
        manifest.update(uri=other.uri, digest=build.source_digest(other))
        manifest_path.write_text(json.dumps(manifest))
        return f"{manifest_path} describes {other.uri!r}, expected {spec.uri!r}"
    if how == "no-manifest":
        manifest_path.unlink()
        return f"{so} has no {build.MANIFEST} beside it"
    if how == "torn-manifest":
        manifest_path.write_text(manifest_path.read_text()[:20])
        return f"{manifest_path} is damaged: expected a JSON object"
    if how == "old-manifest":  # written before the manifest recorded the module's hash
        del manifest["so_size"], manifest["so_sha256"]
        manifest_path.write_text(json.dumps(manifest))
        return f"{manifest_path} records no size and sha256 of {so.name}"
    if how == "missing-module":
        so.unlink()
        return f"{so} is missing (its {build.MANIFEST} is there)"
    raise AssertionError(how)


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_cache_module_is_rebuilt_not_loaded(
    jit_cache, fake_compiler, loads, tiny_so, caplog, damage
):
    spec = parse_spec(SMALL)
    so = build.build(spec)
    assert build.find_prebuilt(spec) == so and len(fake_compiler.builds()) == 1
    why = _damage(so.parent, spec, damage, tiny_so)
    with caplog.at_level(logging.WARNING, logger="replayssm_jit"):
        assert build.find_prebuilt(spec) is None
    assert why in caplog.text
    module = build.load_module(spec)
    assert len(fake_compiler.builds()) == 2, "the damaged module must be rebuilt"
    assert loads == [(str(so), _sha(tiny_so))], "only the rebuilt module may be loaded"
    assert module.answer(1) == 42 and build.find_prebuilt(spec) == so


@pytest.mark.parametrize("jit", ["disabled", "enabled"])
@pytest.mark.parametrize("damage", ["none", *DAMAGES])
def test_damaged_aot_module_is_refused(
    jit_cache, fake_compiler, loads, tiny_so, tmp_path, monkeypatch, caplog, damage, jit
):
    """A damaged AOT module is never loaded: with JIT disabled the JITDisabledError names it
    and what is wrong; otherwise a warning does and the JIT cache builds the module."""
    spec = parse_spec(SMALL)
    aot = tmp_path / "aot"
    (aot_so,) = build_aot([spec], aot, jobs=1, archs=["9.0a"])
    why = _damage(aot_so.parent, spec, damage, tiny_so) if damage != "none" else None
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    jit_so = _folder(spec) / f"{spec.uri}.so"
    if jit == "disabled":
        monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    if damage == "none":
        assert build.load_module(spec).answer(1) == 42
        assert loads == [(str(aot_so), _sha(tiny_so))] and not jit_cache.exists()
    elif jit == "disabled":
        with pytest.raises(build.JITDisabledError) as info:
            build.load_module(spec)
        assert spec.uri in str(info.value) and why in str(info.value), str(info.value)
        assert loads == [] and not jit_cache.exists()
    else:
        with caplog.at_level(logging.WARNING, logger="replayssm_jit"):
            assert build.load_module(spec).answer(1) == 42
        assert f"skipping AOT module: {why}" in caplog.text
        assert loads == [(str(jit_so), _sha(tiny_so))] and len(fake_compiler.builds()) == 2


@pytest.mark.parametrize(
    "requested, usable",
    [("9.0a", True), ("10.0a", True), ("10.0a 9.0a", True), ("8.0", False), ("9.0a 12.0a", False)],
)
def test_multi_arch_aot_module_serves_any_subset_of_its_archs(
    jit_cache, fake_compiler, loads, tiny_so, tmp_path, monkeypatch, requested, usable
):
    """An AOT module built for 9.0a and 10.0a loads with JIT disabled for a request of either or
    both (a device's own arch is such a request); one asking for an arch it lacks is refused,
    naming the archs on both sides."""
    spec = parse_spec(SMALL)
    aot = tmp_path / "aot"
    (aot_so,) = build_aot([spec], aot, jobs=1, archs=["9.0a", "10.0a"])
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", requested)
    if usable:
        assert build.find_prebuilt(spec) == aot_so
        assert build.load_module(spec).answer(1) == 42
        assert loads == [(str(aot_so), _sha(tiny_so))]
        return
    assert build.find_prebuilt(spec) is None
    with pytest.raises(build.JITDisabledError) as info:
        build.load_module(spec)
    assert (
        f"{aot_so} is built for ['9.0a', '10.0a'], which lacks {requested.split()[-1]!r} of "
        f"the archs asked for, {requested.split()!r} (REPLAYSSM_CUDA_ARCH_LIST, else the GPU's)"
    ) in str(info.value), str(info.value)
    assert loads == []


def test_cache_module_lacking_a_requested_arch_is_rebuilt_for_it(
    jit_cache, fake_compiler, monkeypatch
):
    """The JIT cache's module for 9.0a serves 9.0a; a request for 9.0a and 10.0a rebuilds it for
    both, after which a 10.0a request is served without a build."""
    spec = parse_spec(SMALL)
    build.build(spec)
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", "9.0a 10.0a")
    assert build.find_prebuilt(spec) is None
    build.build(spec)
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", "10.0a")
    assert build.find_prebuilt(spec) is not None
    build.build(spec)
    assert len(fake_compiler.builds()) == 2, fake_compiler.builds()
    manifest = json.loads((_folder(spec) / build.MANIFEST).read_text())
    assert manifest["archs"] == ["9.0a", "10.0a"]


def test_a_module_replaced_while_loading_is_an_error(jit_cache, fake_compiler, monkeypatch):
    """The bytes hashed are the bytes loaded: a module swapped for another file between the hash
    and dlopen raises instead of returning whatever was loaded."""
    spec = parse_spec(SMALL)
    so = build.build(spec)
    real = build._dlopen

    def swap_then_load(path):
        other = path.with_name("other.so")
        shutil.copy(path, other)
        os.replace(other, path)  # same bytes, another file
        return real(path)

    monkeypatch.setattr(build, "_dlopen", swap_then_load)
    with pytest.raises(build.JITCacheError, match=f"{so} was replaced while it was being loaded"):
        build.load_module(spec)
    assert spec.uri not in build._LOADED


# --- 3. read-only or full cache -------------------------------------------------------------


def _oserror(code: int, path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


@pytest.mark.parametrize(
    "stage, code",
    [
        ("mkdir", errno.EROFS),
        ("mkdir", errno.EACCES),
        ("lock", errno.EACCES),
        ("source", errno.ENOSPC),
        ("compiler-oserror", errno.ENOSPC),
        ("compiler-output", errno.ENOSPC),
        ("compiler-output", errno.EDQUOT),
        ("manifest", errno.ENOSPC),
    ],
)
def test_unwritable_cache_error_names_the_directory(
    jit_cache, fake_compiler, monkeypatch, stage, code
):
    """Each write to the cache failing (simulated) raises JITCacheError naming the folder and the
    OS error, leaves no manifest, and the next build, once writes work, succeeds."""
    spec = parse_spec(SMALL)
    folder = _folder(spec)
    with monkeypatch.context() as patch:
        if stage == "mkdir":
            real_mkdir = Path.mkdir

            def mkdir(self, *args, **kwargs):
                if str(self).startswith(str(jit_cache)):
                    raise _oserror(code, self)
                return real_mkdir(self, *args, **kwargs)

            patch.setattr(Path, "mkdir", mkdir)
        elif stage == "lock":
            real_open = os.open

            def os_open(path, *args, **kwargs):
                if str(path).endswith(build._LOCK):
                    raise _oserror(code, path)
                return real_open(path, *args, **kwargs)

            patch.setattr(os, "open", os_open)
        elif stage in ("source", "manifest"):
            real_write = Path.write_text
            name = f"{spec.uri}.cu" if stage == "source" else build.MANIFEST

            def write_text(self, *args, **kwargs):
                if self.name.startswith(name):
                    raise _oserror(code, self)
                return real_write(self, *args, **kwargs)

            patch.setattr(Path, "write_text", write_text)
        elif stage == "compiler-oserror":
            fake_compiler.fail = _oserror(code, folder / "scratch" / "cuda_0.o")
        else:  # what ninja reports when nvcc or ld runs out of space
            fake_compiler.fail = RuntimeError(
                f"ninja exited with status 1\nstderr:\nld: final link failed: {os.strerror(code)}"
            )
        with pytest.raises(build.JITCacheError) as info:
            build.load_module(spec)
        message = str(info.value)
        assert f"JIT cache directory {folder}: cannot" in message and os.strerror(code) in message
        assert not (folder / build.MANIFEST).exists() and spec.uri not in build._LOADED
    fake_compiler.fail = None
    assert build.load_module(spec).answer(1) == 42


def _drop_file_permission_override() -> None:
    """Drop CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from this (single-threaded)
    process, so that root too meets file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~((1 << 1) | (1 << 2) | (1 << 3))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _read_only_cases(spec, cache: Path, unlocked_cache: Path, stale_cache: Path):
    """In a child that meets file permissions: the read-only caches' behaviour."""
    if os.geteuid() == 0:
        _drop_file_permission_override()
    out = {}
    try:
        (cache / "probe").write_text("")
        out["probe"] = "writable"
    except PermissionError:
        out["probe"] = "denied"
    build._tvm_ffi_build = None  # nothing may compile here
    os.environ["REPLAYSSM_CACHE_DIR"] = str(cache)
    out["verified"] = build.load_module(spec).answer(1)
    build._LOADED.clear()
    os.environ["REPLAYSSM_CACHE_DIR"] = str(unlocked_cache)  # no .lock file, none can be made
    out["verified without a lock file"] = build.load_module(spec).answer(1)
    build._LOADED.clear()
    os.environ["REPLAYSSM_CACHE_DIR"] = str(stale_cache)
    try:
        build.load_module(spec)
        out["stale"] = "loaded"
    except build.JITCacheError as exc:
        out["stale"] = str(exc)
    os.environ["REPLAYSSM_CACHE_DIR"] = str(cache.parent / "empty")
    try:
        build.load_module(parse_spec(OTHER))
        out["empty"] = "loaded"
    except build.JITCacheError as exc:
        out["empty"] = str(exc)
    return out


def test_read_only_cache_for_real(jit_cache, fake_compiler, tmp_path):
    """Real permissions (as root, in a child without the permission-override capabilities): a
    read-only cache holding a verified module loads it without writing (with or without a lock
    file); one holding a stale module or none raises JITCacheError naming the folder and
    'Permission denied'."""
    spec = parse_spec(SMALL)
    build.build(spec)
    unlocked_cache, stale_cache = tmp_path / "unlocked-cache", tmp_path / "stale-cache"
    shutil.copytree(jit_cache, unlocked_cache)
    (unlocked_cache / "build" / spec.uri / build._LOCK).unlink()
    shutil.copytree(jit_cache, stale_cache)
    manifest = stale_cache / "build" / spec.uri / build.MANIFEST
    manifest.write_text(manifest.read_text().replace('"digest": "', '"digest": "0'))
    (tmp_path / "empty").mkdir()
    read_only = [jit_cache, unlocked_cache, stale_cache, tmp_path / "empty"]
    for root in read_only:
        for path in [root, *root.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        proc, out = _fork(
            tmp_path, "read-only", _read_only_cases, spec, jit_cache, unlocked_cache, stale_cache
        )
        result = _result(proc, out)
    finally:
        for root in read_only:
            for path in [root, *root.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
    assert result["probe"] == "denied", "the child could still write: the test would prove nothing"
    assert result["verified"] == 42 and result["verified without a lock file"] == 42
    stale_folder = stale_cache / "build" / spec.uri
    assert f"JIT cache directory {stale_folder}: cannot" in result["stale"]
    assert "Permission denied" in result["stale"]
    empty_folder = tmp_path / "empty" / "build" / parse_spec(OTHER).uri
    assert f"JIT cache directory {empty_folder}: cannot create it" in result["empty"]
    assert f"Permission denied: '{tmp_path / 'empty' / 'build'}'" in result["empty"]


@pytest.mark.parametrize("size, stage", [("4k", "write the source"), ("16k", "compile into it")])
def test_full_cache_for_real(jit_cache, fake_compiler, size, stage):
    """A cache on a tiny tmpfs (root only): the source, or the compiler's output, does not fit.
    The error names the folder and 'No space left on device'; once there is room, a build works."""
    if os.geteuid() != 0:
        pytest.skip(
            "mounting a tmpfs needs root; test_unwritable_cache_error_names_the_directory covers this"
        )
    jit_cache.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(jit_cache)],
        capture_output=True, text=True,
    )  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    spec = parse_spec(SMALL)
    folder = _folder(spec)
    try:
        with pytest.raises(build.JITCacheError) as info:
            build.load_module(spec)
        message = str(info.value)
        assert f"JIT cache directory {folder}: cannot " in message and stage in message, message
        assert os.strerror(errno.ENOSPC) in message and not (folder / build.MANIFEST).exists()
    finally:
        subprocess.run(["umount", "-l", str(jit_cache)], check=True)
    assert build.load_module(spec).answer(1) == 42


# --- 4. killed builds -----------------------------------------------------------------------


def _build_until_killed(spec, when: str, fake: FakeCompiler, marker: Path):
    if when == "mid-compile":
        fake.chunk, fake.hang_at, fake.marker = 4096, len(fake.data) // 2, marker
    else:  # after the module is in place, before its manifest
        real_write = build.write_if_different

        def hang_on_manifest(path, text):
            if path.name == build.MANIFEST:
                marker.touch()
                time.sleep(600)
            return real_write(path, text)

        build.write_if_different = hang_on_manifest
    build.build(spec)


@pytest.mark.parametrize("when", ["mid-compile", "before-manifest"])
def test_killed_build_blocks_nothing(jit_cache, fake_compiler, loads, tiny_so, tmp_path, when):
    """SIGKILL a building process, holding the lock with half-written files around: the lock is
    free at once, the next build starts clean (none of the killed build's files in the folder)
    and loads; the killed build's files are never loaded."""
    spec = parse_spec(SMALL)
    folder, marker = _folder(spec), tmp_path / "compiling"
    proc, _ = _fork(tmp_path, "killed", _build_until_killed, spec, when, fake_compiler, marker)
    _wait_for(marker.exists, 60, "the build to get going")
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    so = folder / f"{spec.uri}.so"
    if when == "mid-compile":
        assert list(folder.glob(f"{build._SCRATCH_PREFIX}*/cuda_0.o")) and not so.exists()
    else:
        assert so.exists() and not (folder / build.MANIFEST).exists()
    assert build.find_prebuilt(spec) is None
    fd = os.open(folder / build._LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the dead process still held it
    finally:
        os.close(fd)
    assert build.load_module(spec).answer(1) == 42
    builds = fake_compiler.builds()
    assert len(builds) == 2, builds  # the killed one and the next
    scratch = [name for name in builds[-1]["seen"] if name.startswith(build._SCRATCH_PREFIX)]
    assert sorted(builds[-1]["seen"]) == sorted([".lock", f"{spec.uri}.cu", *scratch])
    assert len(scratch) == 1 and loads == [(str(so), _sha(tiny_so))]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".lock", build.MANIFEST, f"{spec.uri}.cu", f"{spec.uri}.so"]
    )


# --- the same with nvcc ---------------------------------------------------------------------


def _real_build_in_own_group(spec):
    os.setpgid(0, 0)  # its ninja and nvcc too, so the test can end them
    build.build(spec)


@pytest.mark.nvcc
def test_eight_processes_one_nvcc_build_after_a_killed_one(jit_cache, tmp_path, monkeypatch):
    """With nvcc: a build SIGKILLed mid-compile (its orphaned ninja / nvcc still running into the
    next build), then 8 processes loading the spec at once: one more build, eight loads of the
    verified module."""
    spec = parse_spec(SMALL)
    log, real = tmp_path / "builds.log", build._tvm_ffi_build

    def counted(name, source, scratch, archs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {scratch}\n")
        return real(name, source, scratch, archs)

    monkeypatch.setattr(build, "_tvm_ffi_build", counted)
    killed, _ = _fork(tmp_path, "killed", _real_build_in_own_group, spec)
    try:
        _wait_for(log.exists, 60, "the first build to start")
        scratch = Path(log.read_text().split()[1])
        _wait_for(lambda: list(scratch.glob("*.ninja")), 60, "ninja to start")
        time.sleep(2)  # nvcc is compiling
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(10)
        orphans = []

        def end_orphans(stop):
            # Let them run into the next build's start, then stop them eating the cores.
            while len(log.read_text().splitlines()) < 2 and not stop.wait(0.05):
                pass
            time.sleep(1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(killed.pid, 0)
                orphans.append("alive")
                os.killpg(killed.pid, signal.SIGKILL)

        results = _race(tmp_path, spec, 8, "replay_step", end_orphans)
        assert orphans == ["alive"], "the killed build's ninja / nvcc were gone too soon"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(killed.pid, signal.SIGKILL)
    builds = log.read_text().splitlines()
    assert len(builds) == 2, builds  # the killed one and one more
    folder = _folder(spec)
    manifest = json.loads((folder / build.MANIFEST).read_text())
    assert all(r["value"] is True and r["sha"] == manifest["so_sha256"] for r in results), results
    assert (folder / f"{spec.uri}.so").stat().st_size == manifest["so_size"]
