"""The CUDA verify kernels on e4m3 / NVFP4 checkpoints and separate mode's read copies (marked
gpu): the schedules of test_verify_formats_cpu.py (chains with fused commits, trees
with explicit ones, random draft counts, a pad row, early flushes) run on the per-item and the
split verify kernel (KDA and GDN with a read copy: per item only) against the same float64
emulation and bounds: outputs to 5e-5 relative, flushed copies within one code, cursors exactly,
unnamed slots bit for bit."""

from __future__ import annotations

import pytest
from support.verify_formats import run_formats_schedule

from replayssm_jit import LaunchConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_launch_env")]

CASES = [("mamba2", "e4m3", None), ("mamba2", "nvfp4", None), ("mamba2", "f32", "e4m3"),
         ("mamba2", "f32", "bf16"), ("mamba2", "f32", "nvfp4"), ("gdn", "e4m3", None),
         ("gdn", "nvfp4", None), ("kda", "e4m3", None), ("kda", "nvfp4", None),
         ("gdn", "f32", "e4m3"), ("gdn", "f32", "bf16"), ("gdn", "f32", "nvfp4")]  # fmt: skip
# (KDA, and GDN with a read copy, verify per item only: the policy never splits them)
KERNELS = [(case, kernel) for case in CASES for kernel in ("per-item", "split")
           if kernel == "per-item" or case[0] == "mamba2" or (case[0] == "gdn" and case[2] is None)]  # fmt: skip


def _id(case):
    fam, state, read = case
    return f"{fam}-{state}" + (f"+{read}" if read else "")


@pytest.mark.parametrize("case, kernel", KERNELS, ids=lambda v: v if isinstance(v, str) else _id(v))
@pytest.mark.parametrize(
    "trees, fused", [(False, True), (True, False)], ids=["chain-fused", "tree"]
)
def test_cuda_verify_on_formats_matches_the_emulation(case, kernel, trees, fused):
    run_formats_schedule(case, trees=trees, fused=fused, device="cuda",
                         config=LaunchConfig(kernel=kernel))  # fmt: skip


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5], CASES[8]], ids=_id)
def test_cuda_verify_on_formats_under_stochastic_rounding(case):
    run_formats_schedule(case, trees=False, fused=True, sr=True, device="cuda",
                         config=LaunchConfig(kernel="per-item"))  # fmt: skip
