"""scripts/resource_usage.py on the CPU: its cuobjdump -res-usage parser on captured text, the
kernel names it reads from templates/, and the CTAs per SM it derives (no cuobjdump, no nvcc)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from support.paths import SCRIPTS

# Two functions of a super120b T = 8 module as cuobjdump 13 printed them (mangled names kept whole).
RES_USAGE = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

Resource usage:
 Common:
  GLOBAL:0
 Function _ZN9replayssm15per_item_kernelINS_6mamba211VerifyStateILi64ELi128ELi16ELi16ELi8ELi64ELi4E13__nv_bfloat16fLb0ELb1ELb1ELb0EEEEEvNT_6ParamsE:
  REG:116 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:904 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN9replayssm13commit_kernelILi16ELi8ELi256EEEvPiNS_8RingRowsES2_S2_PKiS4_S4_ii:
  REG:40 STACK:16 SHARED:1024 LOCAL:8 CONSTANT[0]:960 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
STATE = (
    "void replayssm::per_item_kernel<replayssm::mamba2::VerifyState<64, 128, 16, 16, 8, 64, 4, "
    "__nv_bfloat16, float, false, true, true, false> >(replayssm::mamba2::VerifyState<64, 128, 16, "
    "16, 8, 64, 4, __nv_bfloat16, float, false, true, true, false>::Params)"
)
COMMIT = (
    "void replayssm::commit_kernel<16, 8, 256>(int*, replayssm::RingRows, replayssm::RingRows, "
    "replayssm::RingRows, int const*, int const*, int const*, int, int)"
)


@pytest.fixture(scope="module")
def ru():
    spec = importlib.util.spec_from_file_location("resource_usage", SCRIPTS / "resource_usage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["resource_usage"] = module  # (dataclasses look their module up by name)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("resource_usage", None)


def test_parses_every_function_with_its_resources(ru):
    rows = ru.parse_res_usage(RES_USAGE)
    assert [r[1:] for r in rows] == [(116, 0, 1024, 0), (40, 16, 1024, 8)]
    assert rows[0][0].startswith("_ZN9replayssm15per_item_kernelINS_6mamba211VerifyState")
    assert rows[1][0].startswith("_ZN9replayssm13commit_kernel")


def test_names_kind_and_template_arguments_from_the_templates(ru):
    params = ru.template_params()
    assert params[("mamba2", "VerifyState")][:7] == ["P", "N", "HPG", "L", "T", "ROWS", "WARPS"]
    state = ru.Kernel("m", "x", 116, 0, 1024, 0)
    ru.describe(state, STATE, params)
    assert state.kind == "verify-split state"
    assert state.args == {"P": "64", "N": "128", "HPG": "16", "L": "16", "T": "8", "ROWS": "64",
                          "WARPS": "4"}  # fmt: skip
    assert state.struct.startswith("replayssm::mamba2::VerifyState<64, 128, 16, 16, 8, 64, 4,")
    commit = ru.Kernel("m", "y", 40, 16, 1024, 8)
    ru.describe(commit, COMMIT, params)
    assert (commit.kind, commit.threads, commit.args["T"]) == ("commit", 256, "8")


def test_resident_ctas_and_the_limiting_resource(ru):
    # 116 registers round up to 120 per thread: 15360 per 4-warp CTA, 4 per SM; 96 fit 5.
    state = ru.Kernel("m", "x", 116, 0, 1024, 0, threads=128, dynamic_shared=21008)
    assert ru.occupancy(state) == {"registers": 4, "threads": 16, "shared": 10, "CTA slots": 32}
    state.regs = 96
    assert ru.occupancy(state)["registers"] == 5
    state.regs = 97  # allocated as 104: 4 CTAs, not the 5 that 97 x 128 would fit
    assert ru.occupancy(state)["registers"] == 4
    # Shared memory limits a records CTA of 43456 bytes (+ the 1 KiB reserve) to 5 per SM.
    records = ru.Kernel("m", "r", 32, 0, 1024, 0, threads=256, dynamic_shared=43456)
    assert ru.occupancy(records) == {"registers": 8, "threads": 8, "shared": 5, "CTA slots": 32}
