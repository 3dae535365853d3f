"""Shared scaffolding of the JIT cache tests (test_jit_cache_*.py, issue 21 §5): the specs, the
stand-in compiler, forked children and a spec's build folder; their fixtures `fake_compiler` and
`loads` are in tests/jit/conftest.py.

Most tests use a stand-in compiler that writes a real, g++-built tvm-ffi module (answer(x) =
x + 41) in slow chunks, so partial files exist while other processes look, and loads are real
dlopens. Child processes are forked: no re-import per child.
"""

import hashlib
import json
import multiprocessing
import os
import time
import traceback
from pathlib import Path

from replayssm_jit.jit import build

# A small spec (Mamba-2 P = 24, N = 64, L = 1, FP32, no flags): a quick real nvcc build.
SMALL = (
    "mamba2:headdim=24,dstate=64,heads_per_group=2,window=1,act_dtype=f32,state_dtype=f32,flags="
)
OTHER = (
    "mamba2:headdim=24,dstate=64,heads_per_group=2,window=4,act_dtype=f32,state_dtype=f32,flags="
)
FORK = multiprocessing.get_context("fork")


def sha(data: bytes) -> str:
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


def _child_main(out: str, fn, args) -> None:
    try:
        result = {"ok": fn(*args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))


def fork_child(tmp_path: Path, name: str, fn, *args):
    """A forked child running fn(*args); its result (or traceback) lands in a JSON file."""
    out = tmp_path / f"{name}.json"
    proc = FORK.Process(target=_child_main, args=(str(out), fn, args), daemon=True)
    proc.start()
    return proc, out


def child_result(proc, out: Path, timeout: float = 120):
    proc.join(timeout)
    assert proc.exitcode == 0, f"child {proc.pid}: exit code {proc.exitcode}"
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result["ok"]


def build_folder(spec) -> Path:
    return build.env.cache_dir() / "build" / spec.uri
