"""Mamba-2's CUDA verify kernels on e4m3 / NVFP4 checkpoints and separate mode's read copies
(marked gpu): the schedules of test_verify_formats_cpu.py (chains with fused commits, trees
with explicit ones, random draft counts, a pad row, early flushes) run on the per-item and the
split verify kernel against the same float64 emulation and bounds: outputs to 5e-5 relative,
flushed copies within one code, cursors exactly, unnamed slots bit for bit. GDN's and KDA's
CUDA verify kernels refuse these formats (test_verify_formats_cpu.py)."""

from __future__ import annotations

import pytest
from support.verify_formats import run_formats_schedule

from replayssm_jit import LaunchConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_launch_env")]

CASES = [("mamba2", "e4m3", None), ("mamba2", "nvfp4", None), ("mamba2", "f32", "e4m3"),
         ("mamba2", "f32", "bf16"), ("mamba2", "f32", "nvfp4")]  # fmt: skip


def _id(case):
    _, state, read = case
    return state + (f"+{read}" if read else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("kernel", ["per-item", "split"])
@pytest.mark.parametrize(
    "trees, fused", [(False, True), (True, False)], ids=["chain-fused", "tree"]
)
def test_cuda_verify_on_formats_matches_the_emulation(case, kernel, trees, fused):
    run_formats_schedule(case, trees=trees, fused=fused, device="cuda",
                         config=LaunchConfig(kernel=kernel))  # fmt: skip


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=_id)
def test_cuda_verify_on_formats_under_stochastic_rounding(case):
    run_formats_schedule(case, trees=False, fused=True, sr=True, device="cuda",
                         config=LaunchConfig(kernel="per-item"))  # fmt: skip
