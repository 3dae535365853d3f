"""The step protocol is written once in CUDA (templates/common/step.cuh) and once in torch
(ops/torch_path/protocol.py): the two must take the same decision for every cursor. The CUDA
side is compiled by nvcc as host code (its decision functions are __host__ __device__); the torch
side is observed through run_step's groups, not re-derived."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import pytest
import torch

from replayssm_jit.core.cursor_words import CURSOR_HELD, CURSOR_WORDS
from replayssm_jit.ops.torch_path.protocol import Pool, Rows, StepScalars, run_step

pytestmark = pytest.mark.nvcc

WINDOWS = (1, 2, 4, 16)
DRAFTS = (1, 2, 4)


def _cases():
    for L, T in itertools.product(WINDOWS, DRAFTS):
        if L == 1 and T > 1:  # drafts need a replay window (layouts refuse L = 1 with T > 1)
            continue
        for every_step in (False, True):
            yield L, T, every_step


def _cuda_decisions(tmp_path, step_header: str) -> dict[tuple, tuple[int, int]]:
    """(L, T, every_step, held) -> (valid, flush) from step.cuh compiled for the host; flush is
    -1 where the cursor is invalid (a kernel decides nothing for such a row)."""
    lines = []
    for L, T, every_step in _cases():
        cap = L + T
        for held in range(-2, cap + 2):
            lines.append(
                f"  {{ const auto o = replayssm::OpenedStep<true, {L}, {cap}>{{{held}, 7}};"
                f' std::printf("%d %d\\n", int(o.valid()),'
                f" o.valid() ? int(o.decide([] {{ return {str(every_step).lower()}; }}).flush) : -1); }}"
            )
    program = (
        f'#include <cstdio>\n#include "{step_header}"\nint main() {{\n' + "\n".join(lines) + "\n}\n"
    )
    out = _run_host_program(tmp_path, program)
    keys = [(L, T, e, held) for L, T, e in _cases() for held in range(-2, L + T + 2)]
    values = [tuple(int(x) for x in line.split()) for line in out.strip().splitlines()]
    assert len(values) == len(keys)
    return dict(zip(keys, values))


def _run_host_program(tmp_path, body: str) -> str:
    import tvm_ffi.libinfo

    from replayssm_jit.jit.build import template_root

    source = tmp_path / "step.cu"
    source.write_text(body)
    exe = tmp_path / "step"
    subprocess.run(
        ["nvcc", "-std=c++17", f"-I{tmp_path}", f"-I{template_root()}",
         f"-I{tvm_ffi.libinfo.find_include_path()}", str(source), "-o", str(exe)],
        check=True, capture_output=True,
    )  # fmt: skip
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def _torch_decisions() -> dict[tuple, tuple[int, int]]:
    """The same table from the torch path: one slot per held count, one run_step; a row is
    valid where run_step computed it, and its group says whether it flushed."""
    table = {}
    for L, T, every_step in _cases():
        helds = list(range(-2, L + T + 2))
        cursors = torch.zeros(len(helds), CURSOR_WORDS, dtype=torch.int32)
        cursors[:, CURSOR_HELD] = torch.tensor(helds, dtype=torch.int32)
        out = torch.zeros(len(helds), 1)
        seen: dict[int, bool] = {}

        def compute(group, seen=seen, out=out):
            for row in group.rows.tolist():
                seen[row] = group.flush
                out[row] = 1.0

        setup = StepScalars(replay=True, flush_every_step=every_step, window=L,
                            flags=frozenset(), pad_slot_id=-1, seed=0, drafts=T)  # fmt: skip
        rows = Rows(slot_indices=torch.arange(len(helds), dtype=torch.int32), out=out)
        run_step(setup, Pool(None, None, {}, cursors), rows, compute)
        for row, held in enumerate(helds):
            valid = row in seen
            assert valid or bool(torch.isnan(out[row]).all()), (L, T, held)
            table[(L, T, every_step, held)] = (int(valid), int(seen[row]) if valid else -1)
    return table


@pytest.fixture(scope="module")
def nvcc_available():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")


def test_cuda_and_torch_take_the_same_step_decision(nvcc_available, tmp_path):
    """Validity and the flush decision agree for every held count in and around the valid range,
    with and without drafts, with and without flush-every-step."""
    cuda = _cuda_decisions(tmp_path, "common/step.cuh")
    torch_side = _torch_decisions()
    assert cuda == torch_side
    # The table covers both decisions and the invalid rows on both sides of the range.
    assert {v for v in cuda.values()} == {(0, -1), (1, 0), (1, 1)}


def test_a_broken_flush_decision_is_caught(nvcc_available, tmp_path):
    """The comparison fails for a step.cuh that flushes one record late."""
    from replayssm_jit.jit.build import template_root

    text = (template_root() / "common" / "step.cuh").read_text()
    broken, count = re.subn(r"records >= L \|\|", "records > L ||", text)
    assert count == 1
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "step.cuh").write_text(broken)
    cuda = _cuda_decisions(tmp_path, "broken/step.cuh")
    assert cuda != _torch_decisions()


# --- the flush mask (modules built with the "flush_mask" flag) --------------------------------

MASKS = (None, 0, 1)  # no mask given, a zero byte, a nonzero byte


def _mask_cases():
    for L, T, every_step in _cases():
        if L > 1:  # (a conventional step reads no mask)
            for mask in MASKS:
                yield L, T, every_step, mask


def _cuda_mask_decisions(tmp_path, flag: int) -> dict[tuple, tuple[int, int]]:
    """(L, T, every_step, mask, held) -> (valid, flush) from step.cuh compiled for the host with
    REPLAYSSM_FLUSH_MASK `flag`, each decision formed as the kernels form it."""
    lines = []
    for L, T, every_step, mask in _mask_cases():
        params = "none" if mask is None else "given"
        for held in range(-2, L + T + 2):
            lines.append(
                f"  {{ const auto o = replayssm::OpenedStep<true, {L}, {L + T}>{{{held}, 7}};"
                f' std::printf("%d %d\\n", int(o.valid()), o.valid() ? int(o.decide([&] {{'
                f" return {str(every_step).lower()} || (replayssm::kFlushMask &&"
                f" replayssm::flush_masked({params}, {mask or 0})); }}).flush) : -1); }}"
            )
    program = (
        f"#define REPLAYSSM_FLUSH_MASK {flag}\n#include <cstdint>\n#include <cstdio>\n"
        '#include "common/step.cuh"\nstruct Params { const uint8_t* flush_mask; };\n'
        "int main() {\n  const uint8_t bytes[2] = {0, 1};\n"
        "  const Params none{nullptr}, given{bytes};\n" + "\n".join(lines) + "\n}\n"
    )
    out = _run_host_program(tmp_path, program)
    keys = [(L, T, e, m, held) for L, T, e, m in _mask_cases() for held in range(-2, L + T + 2)]
    values = [tuple(int(x) for x in line.split()) for line in out.strip().splitlines()]
    assert len(values) == len(keys)
    return dict(zip(keys, values))


def _torch_mask_decisions() -> dict[tuple, tuple[int, int]]:
    """The same table from run_step with Rows(flush_mask=...) (None: no mask given)."""
    table = {}
    for L, T, every_step, mask in _mask_cases():
        helds = list(range(-2, L + T + 2))
        cursors = torch.zeros(len(helds), CURSOR_WORDS, dtype=torch.int32)
        cursors[:, CURSOR_HELD] = torch.tensor(helds, dtype=torch.int32)
        out = torch.zeros(len(helds), 1)
        seen: dict[int, bool] = {}

        def compute(group, seen=seen):
            for row in group.rows.tolist():
                seen[row] = group.flush

        flush_mask = None if mask is None else torch.full((len(helds),), mask, dtype=torch.uint8)
        setup = StepScalars(replay=True, flush_every_step=every_step, window=L,
                            flags=frozenset({"flush_mask"}), pad_slot_id=-1, seed=0,
                            drafts=T)  # fmt: skip
        rows = Rows(torch.arange(len(helds), dtype=torch.int32), out, flush_mask=flush_mask)
        run_step(setup, Pool(None, None, {}, cursors), rows, compute)
        for row, held in enumerate(helds):
            valid = row in seen
            table[(L, T, every_step, mask, held)] = (int(valid), int(seen[row]) if valid else -1)
    return table


def test_cuda_and_torch_agree_on_the_flush_mask(nvcc_available, tmp_path):
    """With the flag, a nonzero mask byte flushes every valid row and a zero byte or no mask
    leaves the record count's decision; the broken rule (the flag off: the mask ignored)
    disagrees with the torch path."""
    cuda = _cuda_mask_decisions(tmp_path, 1)
    torch_side = _torch_mask_decisions()
    assert cuda == torch_side
    masked = {v for k, v in cuda.items() if k[3] == 1}
    assert masked == {(0, -1), (1, 1)}  # every valid row flushes
    assert {v for k, v in cuda.items() if k[3] != 1} == {(0, -1), (1, 0), (1, 1)}
    (tmp_path / "off").mkdir()
    assert _cuda_mask_decisions(tmp_path / "off", 0) != torch_side
