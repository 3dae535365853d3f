"""The JIT cache under concurrency, on the CPU (issue 21 §5): processes that build one spec at
once give one build and working loads; a build killed mid-compile blocks nothing. The last test
does the same with nvcc.
"""

import contextlib
import fcntl
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support.jit_cache import (
    FORK,
    SMALL,
    FakeCompiler,
    build_folder,
    child_result,
    fork_child,
    sha,
)

from replayssm_jit.cli.aot import parse_spec
from replayssm_jit.jit import build


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def _load_and_report(spec, go, function: str):
    assert go.wait(120), "the parent never said go"
    module = build.load_module(spec)
    so = build_folder(spec) / f"{spec.uri}.so"
    value = (
        getattr(module, function)(1)
        if function == "answer"
        else callable(getattr(module, function))
    )
    return {"pid": os.getpid(), "sha": sha(so.read_bytes()), "value": value}


def _race(tmp_path: Path, spec, n: int, function: str, watch=None) -> list[dict]:
    """n forked processes call load_module(spec) at one signal; `watch()` runs in a thread of
    this process meanwhile, until all are done."""
    go = FORK.Event()
    children = [
        fork_child(tmp_path, f"child{i}", _load_and_report, spec, go, function) for i in range(n)
    ]
    stop = threading.Event()
    watcher = threading.Thread(target=lambda: watch(stop), daemon=True) if watch else None
    go.set()
    if watcher:
        watcher.start()
    try:
        return [child_result(proc, out, timeout=300) for proc, out in children]
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
    folder = build_folder(spec)
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
                seen["bad found"] += sha(found.read_bytes()) != sha(tiny_so)
            time.sleep(0.003)

    results = _race(tmp_path, spec, 8, "answer", watch)
    assert len(fake_compiler.builds()) == 1, fake_compiler.builds()
    assert len({r["pid"] for r in results}) == 8
    assert all(r["value"] == 42 and r["sha"] == sha(tiny_so) for r in results), results
    assert seen["partial in scratch"] > 0, f"no race happened: {seen}"
    assert seen["partial at the module path"] == 0 and seen["bad found"] == 0, seen
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".lock", build.MANIFEST, f"{spec.uri}.cu", f"{spec.uri}.so"]
    )
    manifest = json.loads((folder / build.MANIFEST).read_text())
    assert manifest["so_sha256"] == sha(tiny_so) and manifest["so_size"] == full


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
    folder, marker = build_folder(spec), tmp_path / "compiling"
    proc, _ = fork_child(tmp_path, "killed", _build_until_killed, spec, when, fake_compiler, marker)
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
    assert len(scratch) == 1 and loads == [(str(so), sha(tiny_so))]
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
    killed, _ = fork_child(tmp_path, "killed", _real_build_in_own_group, spec)
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
    folder = build_folder(spec)
    manifest = json.loads((folder / build.MANIFEST).read_text())
    assert all(r["value"] is True and r["sha"] == manifest["so_sha256"] for r in results), results
    assert (folder / f"{spec.uri}.so").stat().st_size == manifest["so_size"]
