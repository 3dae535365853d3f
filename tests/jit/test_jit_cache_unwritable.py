"""The JIT cache unwritable, on the CPU (issue 21 §5): a read-only or full cache raises an error
naming its folder, and loads verified modules without writing.
"""

import ctypes
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.jit_cache import OTHER, SMALL, build_folder, child_result, fork_child

from replayssm_jit.cli.aot import parse_spec
from replayssm_jit.jit import build

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
    folder = build_folder(spec)
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
        proc, out = fork_child(
            tmp_path, "read-only", _read_only_cases, spec, jit_cache, unlocked_cache, stale_cache
        )
        result = child_result(proc, out)
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
    folder = build_folder(spec)
    try:
        with pytest.raises(build.JITCacheError) as info:
            build.load_module(spec)
        message = str(info.value)
        assert f"JIT cache directory {folder}: cannot " in message and stage in message, message
        assert os.strerror(errno.ENOSPC) in message and not (folder / build.MANIFEST).exists()
    finally:
        subprocess.run(["umount", "-l", str(jit_cache)], check=True)
    assert build.load_module(spec).answer(1) == 42
