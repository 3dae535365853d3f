"""Launch choice on the CPU: kernel selection, tiles, flags and overrides."""

import re
from pathlib import Path

import pytest
import torch

from replayssm_jit.ops import gdn as gdn_ops
from replayssm_jit.ops import mamba2 as mamba2_ops
from replayssm_jit.ops import tiling
from replayssm_jit.spec import (
    MAX_CTA_SHARED_BYTES,
    gdn_spec,
    mamba2_spec,
    spec_tilings,
    split_records_shared_bytes,
    split_workspace_floats,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (
        tiling.REPLAY_KERNEL_ENV,
        tiling.SPECULATIVE_ENV,
        tiling.OVERLAP_PRIOR_KERNEL_ENV,
        mamba2_ops.ROWS_ENV,
        gdn_ops.ROWS_ENV,
    ):
        monkeypatch.delenv(var, raising=False)


def test_replay_kernel_heuristic():
    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    rows, flags = tiling.choose_launch(spec, 256, 128, CPU, replay=True)
    assert flags & tiling.FLAG_SPLIT and rows == 64
    # 2048 records CTAs on 132 SMs: only the held ring rows are read
    assert not flags & tiling.FLAG_SPECULATIVE_RECORDS
    assert tiling.choose_replay_kernel(spec, 256, 128, CPU) == "split"
    # batch 8: 1024 (row, head) pairs, still split, whole heads per state CTA; 64 records CTAs
    rows, flags = tiling.choose_launch(spec, 8, 128, CPU, replay=True)
    assert flags & tiling.FLAG_SPLIT and rows == 64
    assert flags & tiling.FLAG_SPECULATIVE_RECORDS
    # one sequence (128 pairs on 132 SMs), FP32 checkpoints: the per-item kernel flushing every
    # token, with nothing held to load speculatively
    rows, flags = tiling.choose_launch(spec, 1, 128, CPU, replay=True)
    assert flags == tiling.FLAG_FLUSH_EVERY_STEP | tiling.FLAG_OVERLAP_PRIOR_KERNEL
    assert tiling.choose_replay_kernel(spec, 1, 128, CPU) == "flush-every-step"
    # low-precision checkpoints keep their window: the per-item kernel, speculative
    bf16 = mamba2_spec(headdim=64, dstate=128, heads_per_group=16, state_dtype="bf16")
    rows, flags = tiling.choose_launch(bf16, 1, 128, CPU, replay=True)
    assert flags == tiling.FLAG_SPECULATIVE_RECORDS | tiling.FLAG_OVERLAP_PRIOR_KERNEL
    # the conventional step is never split; GDN splits too
    assert not tiling.choose_launch(spec, 256, 128, CPU, replay=False)[1] & tiling.FLAG_SPLIT
    qwen = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    assert tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & tiling.FLAG_SPLIT


def test_replay_kernel_override(monkeypatch):
    spec = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    monkeypatch.setenv(tiling.REPLAY_KERNEL_ENV, "per-item")
    rows, flags = tiling.choose_launch(spec, 256, 32, CPU, replay=True)
    assert not flags & tiling.FLAG_SPLIT
    assert rows in [r for r, _ in spec_tilings(spec)]
    monkeypatch.setenv(tiling.REPLAY_KERNEL_ENV, "flush-every-step")
    flags = tiling.choose_launch(spec, 256, 32, CPU, replay=True)[1]
    assert flags == tiling.FLAG_FLUSH_EVERY_STEP | tiling.FLAG_OVERLAP_PRIOR_KERNEL
    monkeypatch.setenv(tiling.REPLAY_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=r"REPLAYSSM_REPLAY_KERNEL: expected one of .*'fast'"):
        tiling.choose_launch(spec, 256, 32, CPU, replay=True)


def test_split_kernel_forced(monkeypatch):
    monkeypatch.setenv(tiling.REPLAY_KERNEL_ENV, "split")
    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    rows, flags = tiling.choose_launch(spec, 256, 128, CPU, replay=True)
    # the state kernel runs on the per-item tiles
    assert flags & tiling.FLAG_SPLIT and rows == 64
    assert tiling.choose_launch(spec, 1, 128, CPU, replay=True)[0] == 16
    # the conventional step is never split
    assert not tiling.choose_launch(spec, 256, 128, CPU, replay=False)[1] & tiling.FLAG_SPLIT
    qwen = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    rows, flags = tiling.choose_launch(qwen, 256, 32, CPU, replay=True)
    assert flags & tiling.FLAG_SPLIT and rows == 64


def test_split_needs_the_records_in_shared_memory(monkeypatch):
    # dstate 1024, L = 128: the group's 128 bf16 B records alone are 256 KiB
    wide = mamba2_spec(headdim=64, dstate=1024, heads_per_group=8, window=128)
    assert split_records_shared_bytes(wide) > MAX_CTA_SHARED_BYTES
    assert not tiling.choose_launch(wide, 256, 128, CPU, replay=True)[1] & tiling.FLAG_SPLIT
    monkeypatch.setenv(tiling.REPLAY_KERNEL_ENV, "split")
    with pytest.raises(ValueError, match=r"'split' needs .* got 8 heads and \d+ bytes"):
        tiling.choose_launch(wide, 256, 128, CPU, replay=True)
    # more heads per group than the records CTA has threads, however small the ring
    many = mamba2_spec(headdim=16, dstate=16, heads_per_group=512, window=1)
    assert split_records_shared_bytes(many) <= MAX_CTA_SHARED_BYTES
    with pytest.raises(ValueError, match="got 512 heads"):
        tiling.choose_launch(many, 4, 512, CPU, replay=True)
    monkeypatch.delenv(tiling.REPLAY_KERNEL_ENV)
    assert not tiling.choose_launch(many, 4, 512, CPU, replay=True)[1] & tiling.FLAG_SPLIT
    # the model shapes fit with room to spare
    super120b = mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=32)
    qwen122b = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4, window=32)
    assert split_records_shared_bytes(super120b) < 96 * 1024
    assert split_records_shared_bytes(qwen122b) < 96 * 1024


def test_split_workspace_size():
    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=8, window=16, drafts=2)
    # per batch row: extra [H, P], total [H], coef [H, CAP], info [4]
    assert split_workspace_floats(spec, 3, 128) == 3 * (128 * (64 + 1 + 18) + 4)
    qwen = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=16)
    # per batch row: pred and osum [HV, 2 V], 5 scalars [HV], coef [HV, CAP], info [4]
    assert split_workspace_floats(qwen, 2, 32) == 2 * (32 * (2 * 128 + 5 + 17) + 4)


def test_speculative_flag_threshold_and_override(monkeypatch):
    monkeypatch.setenv(tiling.OVERLAP_PRIOR_KERNEL_ENV, "0")  # (its bit checked on its own)
    limit = tiling.SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM * 132
    spec_split = tiling.FLAG_SPLIT | tiling.FLAG_SPECULATIVE_RECORDS
    assert tiling.launch_flags(kernel="split", records_ctas=limit - 1, sms=132) == spec_split
    assert tiling.launch_flags(kernel="split", records_ctas=limit, sms=132) == tiling.FLAG_SPLIT
    big = tiling.launch_flags(kernel="per-item", records_ctas=10 * limit, sms=132)
    assert big == tiling.FLAG_SPECULATIVE_RECORDS
    monkeypatch.setenv(tiling.SPECULATIVE_ENV, "1")
    assert tiling.launch_flags(kernel="split", records_ctas=limit, sms=132) == spec_split
    monkeypatch.setenv(tiling.SPECULATIVE_ENV, "0")
    assert tiling.launch_flags(kernel="split") == tiling.FLAG_SPLIT
    monkeypatch.setenv(tiling.SPECULATIVE_ENV, "yes")
    with pytest.raises(ValueError, match="REPLAYSSM_SPECULATIVE_RECORDS"):
        tiling.launch_flags()


def test_few_records_warps_for_gdn_at_large_batch(monkeypatch):
    qwen = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    m2 = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    few = tiling.FLAG_FEW_RECORDS_WARPS
    # qwen4b: 16 key heads per batch row; 8 CTAs per SM on 132 SMs from 1056 items (batch 66)
    assert tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & few
    assert not tiling.choose_launch(qwen, 65, 32, CPU, replay=True)[1] & few
    assert tiling.choose_launch(qwen, 66, 32, CPU, replay=True)[1] & few
    assert not tiling.choose_launch(qwen, 8, 32, CPU, replay=True)[1] & few
    assert not tiling.choose_launch(qwen, 256, 32, CPU, replay=False)[1] & few
    assert not tiling.choose_launch(m2, 256, 128, CPU, replay=True)[1] & few  # Mamba-2: never
    # qwen122b: four value heads per key head, 4 rows per thread of a 4-warp CTA: 8 warps
    qwen122b = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4)
    assert not tiling.choose_launch(qwen122b, 256, 64, CPU, replay=True)[1] & few
    monkeypatch.setenv(tiling.RECORDS_WARPS_ENV, "4")
    assert tiling.choose_launch(qwen122b, 256, 64, CPU, replay=True)[1] & few
    assert tiling.choose_launch(qwen, 8, 32, CPU, replay=True)[1] & few
    assert not tiling.choose_launch(m2, 256, 128, CPU, replay=True)[1] & few
    monkeypatch.setenv(tiling.RECORDS_WARPS_ENV, "8")
    assert not tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & few
    monkeypatch.setenv(tiling.RECORDS_WARPS_ENV, "16")
    with pytest.raises(
        ValueError, match="REPLAYSSM_GDN_RECORDS_WARPS: expected '4' or '8', got '16'"
    ):
        tiling.choose_launch(qwen, 256, 32, CPU, replay=True)
    with pytest.raises(ValueError, match="REPLAYSSM_GDN_RECORDS_WARPS"):  # whatever the kernel
        tiling.choose_launch(qwen, 1, 32, CPU, replay=True)


def test_capped_state_registers_for_gdn_at_large_batch(monkeypatch):
    qwen = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    m2 = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    capped = tiling.FLAG_CAPPED_STATE_REGISTERS
    # qwen4b: 32 value heads x 2 tiles of 64 rows per batch row; FP32 checkpoints: 64 CTAs per
    # SM on 132 SMs from 8448 CTAs (batch 132); BF16: 12 per SM from 1584 CTAs (batch 25)
    assert tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & capped
    assert tiling.choose_launch(qwen, 132, 32, CPU, replay=True)[1] & capped
    assert not tiling.choose_launch(qwen, 131, 32, CPU, replay=True)[1] & capped
    assert not tiling.choose_launch(qwen, 8, 32, CPU, replay=True)[1] & capped
    qwen_bf16 = gdn_spec(
        head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, state_dtype="bf16"
    )
    assert tiling.choose_launch(qwen_bf16, 25, 32, CPU, replay=True)[1] & capped
    assert not tiling.choose_launch(qwen_bf16, 24, 32, CPU, replay=True)[1] & capped
    assert not tiling.choose_launch(qwen, 256, 32, CPU, replay=False)[1] & capped
    assert not tiling.choose_launch(m2, 256, 128, CPU, replay=True)[1] & capped  # Mamba-2: never
    monkeypatch.setenv(tiling.CAPPED_STATE_REGISTERS_ENV, "1")
    assert tiling.choose_launch(qwen, 8, 32, CPU, replay=True)[1] & capped
    assert not tiling.choose_launch(qwen, 1, 32, CPU, replay=True)[1] & capped  # no split kernel
    assert not tiling.choose_launch(m2, 256, 128, CPU, replay=True)[1] & capped
    monkeypatch.setenv(tiling.CAPPED_STATE_REGISTERS_ENV, "0")
    assert not tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & capped
    monkeypatch.setenv(tiling.CAPPED_STATE_REGISTERS_ENV, "yes")
    with pytest.raises(
        ValueError, match="REPLAYSSM_GDN_CAPPED_STATE_REGISTERS: expected '0' or '1', got 'yes'"
    ):
        tiling.choose_launch(qwen, 1, 32, CPU, replay=True)  # checked whatever the kernel


def test_overlap_prior_kernel_by_default_and_override(monkeypatch):
    qwen = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    m2 = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    overlap = tiling.FLAG_OVERLAP_PRIOR_KERNEL
    for spec, heads in ((qwen, 32), (m2, 128)):
        for batch in (1, 8, 256):  # the conventional step: always
            assert tiling.choose_launch(spec, batch, heads, CPU, replay=False)[1] & overlap
        # ReplaySSM: the per-item kernel flushing every token at batch 1, the split one beyond
        assert tiling.choose_launch(spec, 1, heads, CPU, replay=True)[1] & overlap
        assert not tiling.choose_launch(spec, 8, heads, CPU, replay=True)[1] & overlap
    # the split step from 4 records CTAs per SM (528 on 132 SMs): qwen4b has 16 key heads,
    # super120b 8 groups per batch row
    assert tiling.choose_launch(qwen, 33, 32, CPU, replay=True)[1] & overlap
    assert not tiling.choose_launch(qwen, 32, 32, CPU, replay=True)[1] & overlap
    assert tiling.choose_launch(m2, 66, 128, CPU, replay=True)[1] & overlap
    assert not tiling.choose_launch(m2, 64, 128, CPU, replay=True)[1] & overlap
    assert tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & overlap
    monkeypatch.setenv(tiling.REPLAY_KERNEL_ENV, "per-item")
    assert tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & overlap
    monkeypatch.delenv(tiling.REPLAY_KERNEL_ENV)
    monkeypatch.setenv(tiling.OVERLAP_PRIOR_KERNEL_ENV, "1")
    assert tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & overlap
    monkeypatch.setenv(tiling.OVERLAP_PRIOR_KERNEL_ENV, "0")
    assert not tiling.choose_launch(qwen, 1, 32, CPU, replay=True)[1] & overlap
    assert not tiling.choose_launch(qwen, 256, 32, CPU, replay=True)[1] & overlap
    assert not tiling.choose_launch(m2, 1, 128, CPU, replay=False)[1] & overlap
    monkeypatch.setenv(tiling.OVERLAP_PRIOR_KERNEL_ENV, "on")
    with pytest.raises(ValueError, match="REPLAYSSM_OVERLAP_PRIOR_KERNEL: expected '0' or '1'"):
        tiling.choose_launch(m2, 1, 128, CPU, replay=False)


def test_launch_flag_bits_match_the_kernels():
    """ops/tiling.py's FLAG_* constants are the bindings' kFlag* bits (common/launch.cuh)."""
    header = (Path(__file__).resolve().parents[1] / "templates/common/launch.cuh").read_text()
    bits = {
        re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper(): int(value)
        for name, value in re.findall(r"constexpr int64_t kFlag(\w+) = (\d+);", header)
    }
    python = {
        name.removeprefix("FLAG_"): getattr(tiling, name)
        for name in dir(tiling)
        if name.startswith("FLAG_")
    }
    assert bits == python


def test_lane_values_and_the_bf16_gdn_tile():
    # fp32 [64, 128] head on 4 warps (128 lanes): 64 values per lane, whatever the lane layout
    assert tiling.lane_values(64, 4, 128) == 64
    # bf16 [128, 128] head on 4 warps: 128 values per lane, too many
    assert tiling.lane_values(128, 4, 128) == 128 > tiling.MAX_LANE_VALUES
    qwen_bf16 = gdn_spec(
        head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, state_dtype="bf16"
    )
    # the per-item tile, for the conventional step and for ReplaySSM alike
    assert tiling.choose_launch(qwen_bf16, 256, 32, CPU, replay=False)[0] == 64
    assert tiling.choose_launch(qwen_bf16, 256, 32, CPU, replay=True)[0] == 64


def test_bf16_checkpoints_split_too():
    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=16, state_dtype="bf16")
    rows, flags = tiling.choose_launch(spec, 256, 128, CPU, replay=True)
    assert flags & tiling.FLAG_SPLIT and rows == 64


def test_mamba2_conventional_step_takes_smaller_tiles_at_small_batch():
    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    # batch 8: 16-row tiles (4096 CTAs) rather than 64 (1024); batch 1, where no tile gives 16
    # CTAs per SM: the largest that gives 2 (16 rows, 512 CTAs on 132 SMs; 32 rows give 256)
    assert tiling.choose_launch(spec, 8, 128, CPU, replay=False)[0] == 16
    assert tiling.choose_launch(spec, 1, 128, CPU, replay=False)[0] == 16
    nano4b = mamba2_spec(headdim=80, dstate=128, heads_per_group=12)
    assert tiling.choose_launch(nano4b, 1, 96, CPU, replay=False)[0] == 20  # 384 CTAs
    # from batch 64 the grid fills the chip with the largest tile, as before
    assert tiling.choose_launch(spec, 64, 128, CPU, replay=False)[0] == 64
    # the ReplaySSM kernels keep TARGET_CTAS_PER_SM
    assert tiling.choose_launch(spec, 8, 128, CPU, replay=True)[0] == 64
    # GDN's conventional step keeps it too
    qwen = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    assert tiling.choose_launch(qwen, 8, 32, CPU, replay=False)[0] == 64


def test_flush_every_step_tiles():
    # GDN: the largest tile giving every SM one CTA (qwen122b batch 1: 32 rows, 256 CTAs on 132
    # SMs; qwen4b: 16 rows, 256 CTAs, as 32 would give 128)
    qwen122b = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4)
    rows, flags = tiling.choose_launch(qwen122b, 1, 64, CPU, replay=True)
    assert flags & tiling.FLAG_FLUSH_EVERY_STEP and rows == 32
    qwen4b = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    rows, flags = tiling.choose_launch(qwen4b, 1, 32, CPU, replay=True)
    assert flags & tiling.FLAG_FLUSH_EVERY_STEP and rows == 16
    # Mamba-2 keeps two CTAs per SM (super120b: 16 rows, 512 CTAs; nano4b: 20 rows, 384)
    super120b = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    rows, flags = tiling.choose_launch(super120b, 1, 128, CPU, replay=True)
    assert flags & tiling.FLAG_FLUSH_EVERY_STEP and rows == 16
    nano4b = mamba2_spec(headdim=80, dstate=128, heads_per_group=12)
    assert tiling.choose_launch(nano4b, 1, 96, CPU, replay=True)[0] == 20
    # BF16 checkpoints keep the window on the per-item kernel, with the ReplaySSM target
    qwen122b_bf16 = gdn_spec(
        head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4, state_dtype="bf16"
    )
    rows, flags = tiling.choose_launch(qwen122b_bf16, 1, 64, CPU, replay=True)
    assert not flags & (tiling.FLAG_FLUSH_EVERY_STEP | tiling.FLAG_SPLIT) and rows == 16
