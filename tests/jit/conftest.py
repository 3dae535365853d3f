"""Fixtures of the JIT cache tests (test_jit_cache_*.py): the stand-in compiler, the loads."""

from pathlib import Path

import pytest
from support.jit_cache import FakeCompiler, sha

from replayssm_jit.jit import build


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
        seen.append((str(path), sha(Path(path).read_bytes())))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(tvm_ffi, "load_module", recording_load)
    return seen
