"""Launch-tiling choice shared by the kernel families."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from replayssm_jit.spec import (
    MAX_CTA_SHARED_BYTES,
    SPLIT_RECORDS_THREADS,
    STATE_DIMS,
    KernelSpec,
    spec_tilings,
    split_records_heads,
    split_records_shared_bytes,
)

# Enough CTAs to cover every SM twice before splitting a head's rows further (H200 sweeps,
# benchmarks/results: larger row tiles win whenever the grid already fills the chip).
TARGET_CTAS_PER_SM = 2
# Row-tile targets by step and family: CTAs per SM tried in order, the tile being the largest
# whose CTAs cover every SM that many times (else the smallest).
# - Mamba-2's conventional step wants more, smaller tiles. H200, FP32, L = 16
#   (benchmarks/results/2026-11-29-h200-flush-every-step/experiments/callG1-*): super120b batch 8
#   ran 23.1 us on 64-row tiles (1024 CTAs), 21.5 on 16 (4096) and 21.2 on 8; nano4b batch 8 ran
#   21.2 on 80 rows, 20.0 on 20 (3072 CTAs). GDN's did not follow (qwen4b batch 8: 12.5 us on 64
#   rows, 13.4 on 16). Where no tile gives 16 (batch 1), launched after the previous kernel's tail
#   (FLAG_OVERLAP_PRIOR_KERNEL), super120b ran 5.10 us on 16 rows (512 CTAs, 2 per SM) against 5.57
#   on 8 and 5.33 on 32; nano4b 4.96 on 20 rows (session 9, call C2).
# - GDN's flush-every-step step runs best on the largest tile that gives every SM one CTA. H200,
#   FP32, L = 16, batch 1 (call F, benchmarks/results/2026-11-30-h200-session10, two rounds):
#   qwen122b 5.08 us on 32 rows (256 CTAs) against 5.25 on 16 (512) and 5.33 on 64 (128); qwen4b
#   4.01 on 16 rows (256 CTAs) and 4.01 on 32 (128). Mamba-2's keeps TARGET_CTAS_PER_SM:
#   super120b 4.82 us on 16 rows (512 CTAs) against 5.42 on 32 (256); nano4b 5.12 on 20 (384)
#   against 5.14 on 40 (192).
TILE_TARGETS_CTAS_PER_SM = {
    "conventional": {"mamba2": (16, TARGET_CTAS_PER_SM), "gdn": (TARGET_CTAS_PER_SM,)},
    "split": {"mamba2": (TARGET_CTAS_PER_SM,), "gdn": (TARGET_CTAS_PER_SM,)},
    "per-item": {"mamba2": (TARGET_CTAS_PER_SM,), "gdn": (TARGET_CTAS_PER_SM,)},
    "flush-every-step": {"mamba2": (TARGET_CTAS_PER_SM,), "gdn": (1,)},
}
# 4-warp tiles beat 8-warp tiles of twice the rows in the H200 sweeps (nano4b, batch 256).
PREFERRED_WARPS = 4


def sm_count(device: torch.device) -> int:
    """SMs of `device` (an H200's 132 where there is no GPU, e.g. CPU tests of the heuristics)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _forced(env_var: str, allowed: Sequence[str], expected: str | None = None) -> str | None:
    """The override in `env_var`, one of `allowed` (else a ValueError naming them, or
    `expected`), or None where it is unset or empty."""
    value = os.environ.get(env_var)
    if not value:
        return None
    if value not in allowed:
        expected = expected or " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{env_var}: expected {expected}, got {value!r}")
    return value


def _largest_filling_tile(
    options: list[int], rows: int, batch: int, num_heads: int, device: torch.device,
    targets: Sequence[int],
) -> int:  # fmt: skip
    """The largest tile (options largest first) whose items cover every SM as many times as the
    first of `targets` that some tile reaches, else the smallest."""
    for target in targets:
        for r in options:
            if batch * num_heads * (rows // r) >= target * sm_count(device):
                return r
    return options[-1]


# State values a lane may hold in a per-item tile: 128 (a 128 x 128 bf16 head on 4 warps) ran
# the GDN conventional step at 199 us against 148 us for 64 (H200, qwen4b, batch 256).
MAX_LANE_VALUES = 96


def lane_values(rows_per_cta: int, warps: int, cols: int) -> int:
    """State values each lane holds for a (rows_per_cta, warps) tile of a [*, cols] state (its
    share of the tile, whatever the lane layout)."""
    return rows_per_cta * cols // (warps * 32)


def choose_rows_per_cta(
    tilings: list[tuple[int, int]],
    rows: int,
    batch: int,
    num_heads: int,
    device: torch.device,
    env_var: str,
    *,
    cols: int | None = None,
    targets: Sequence[int] = (TARGET_CTAS_PER_SM,),
) -> int:
    """Largest row tile (of the preferred warp count, at most MAX_LANE_VALUES state values per
    lane when `cols` is given) that still gives the CTAs per SM of the first reachable of
    `targets`; `env_var` overrides with any compiled tile."""
    options = [r for r, _ in tilings]
    forced = _forced(env_var, [str(r) for r in options], f"one of {options}")
    if forced:
        return int(forced)
    preferred = [(r, w) for r, w in tilings if w == PREFERRED_WARPS] or list(tilings)
    if cols is not None:
        light = [(r, w) for r, w in preferred if lane_values(r, w, cols) <= MAX_LANE_VALUES]
        preferred = light or preferred
    return _largest_filling_tile([r for r, _ in preferred], rows, batch, num_heads, device, targets)


# Bits of the modules' `flags` argument (templates/common/launch.cuh).
FLAG_SPECULATIVE_RECORDS = 1
FLAG_SPLIT = 4
FLAG_FLUSH_EVERY_STEP = 8
FLAG_FEW_RECORDS_WARPS = 16
FLAG_CAPPED_STATE_REGISTERS = 32
FLAG_OVERLAP_PRIOR_KERNEL = 64
SPECULATIVE_ENV = "REPLAYSSM_SPECULATIVE_RECORDS"
REPLAY_KERNEL_ENV = "REPLAYSSM_REPLAY_KERNEL"
# A step's first kernel is launched as a programmatic dependent of the stream's previous kernel
# (sm_90+; griddepcontrol): its CTAs are scheduled while that kernel's last ones finish, and wait
# for it before reading anything. Always for the per-item kernels (conventional steps, per-item and
# flush-every-step ReplaySSM steps); for the split step's records kernel from
# SPLIT_OVERLAP_PRIOR_MIN_RECORDS_CTAS_PER_SM records CTAs per SM. H200, FP32, L = 16, on against
# off (call C1, benchmarks/results/2026-11-29-h200-session9, records CTAs per SM in brackets):
#   conventional batch 1: qwen4b 3.9 against 4.6 us, nano4b 4.9 against 5.6, super120b 5.6
#     against 5.4 (5.1 on the tile chosen since); batch 8: super120b 21.2 against 21.7, qwen4b
#     12.0 against 12.5; batch 64 and 256: up to 1.3 us faster;
#   flush-every-step batch 1: super120b 5.1 against 5.6, qwen4b 4.1 against 4.8;
#   split batch 8 (under 1): qwen4b 12.7 against 9.9, super120b 18.5 against 17.7; batch 64:
#     qwen4b (7.8) 45.1 against 45.8, qwen122b (7.8) 83.4 against 84.1, super120b (3.9) 81.2
#     against 80.7, nano4b (3.9) 78.7 against 78.8; batch 256 (15.5-31): 0.5-0.8 us faster.
#   Split, amortized, around the threshold (call B, benchmarks/results/2026-11-30-h200-session10,
#   two rounds agreeing within 0.1 us): qwen4b batch 32 (3.9) 26.7 against 26.3, 48 (5.8) 35.8
#   against 36.0, 96 (11.6) 65.5 against 66.1; qwen122b 32 (3.9) 46.0 against 46.0, 48 64.3
#   against 64.7; super120b 32 (1.9) 46.6 against 45.2, 48 (2.9) 63.6 against 63.0, 96 (5.8)
#   115.6 against 115.8; nano4b 48 (2.9) 62.2 against 61.9, 96 (5.8) 112.0 against 112.3.
# REPLAYSSM_OVERLAP_PRIOR_KERNEL=0 or 1 forces it off or on for every kernel.
SPLIT_OVERLAP_PRIOR_MIN_RECORDS_CTAS_PER_SM = 4
OVERLAP_PRIOR_KERNEL_ENV = "REPLAYSSM_OVERLAP_PRIOR_KERNEL"
REPLAY_KERNELS = ("split", "per-item", "flush-every-step")


# Records CTAs per SM from which the split kernel reads only the held ring rows (after the
# cursor) instead of every ring row speculatively: once its grid covers the chip a few times, the
# unneeded rows cost DRAM bandwidth rather than saving a round trip. H200: speculative loads won
# at batch 8 (under 1 CTA per SM) and lost 1.5-1.8% at batch 256 (15-31 per SM;
# benchmarks/results/2026-11-29-h200-records); the threshold between is not measured.
SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM = 2


def launch_flags(*, kernel: str = "per-item", records_ctas: int = 0, sms: int = 132) -> int:
    """Kernel launch flags. `kernel`: which ReplaySSM kernel runs the step (one of
    REPLAY_KERNELS). Speculative ring loads issue every ring row's loads before the cursor is
    read (one dependent round trip less for more ring bytes): always for the per-item kernel
    (faster at every batch on the H200), and for the split kernel below
    SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM records CTAs (`records_ctas`) per SM (`sms`).
    REPLAYSSM_SPECULATIVE_RECORDS=0 or 1 forces them off or on. FLAG_OVERLAP_PRIOR_KERNEL: for
    the per-item kernels, and for the split kernel from
    SPLIT_OVERLAP_PRIOR_MIN_RECORDS_CTAS_PER_SM records CTAs per SM (see OVERLAP_PRIOR_KERNEL_ENV)."""
    forced = _forced(SPECULATIVE_ENV, ("0", "1"))
    if forced:
        speculative = forced == "1"
    elif kernel == "flush-every-step":
        speculative = False  # nothing is held: every ring row loaded would be wasted
    else:
        speculative = (
            kernel != "split" or records_ctas < SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM * sms
        )
    flags = FLAG_SPECULATIVE_RECORDS if speculative else 0
    forced = _forced(OVERLAP_PRIOR_KERNEL_ENV, ("0", "1"))
    if forced:
        overlap = forced == "1"
    else:
        overlap = (
            kernel != "split" or records_ctas >= SPLIT_OVERLAP_PRIOR_MIN_RECORDS_CTAS_PER_SM * sms
        )
    if overlap:
        flags |= FLAG_OVERLAP_PRIOR_KERNEL
    if kernel == "split":
        flags |= FLAG_SPLIT
    elif kernel == "flush-every-step":
        flags |= FLAG_FLUSH_EVERY_STEP
    return flags


# GDN's records kernel runs CTAs of 4 warps instead of 8 from FEW_RECORDS_WARPS_MIN_CTAS_PER_SM
# (key head, batch row) items per SM, where a key head's value rows (VPH x V) give a 4-warp CTA
# at most FEW_RECORDS_WARPS_MAX_ROWS_PER_THREAD rows per thread to sum: with the grid several
# times over the chip and little per-row work, a warp's fixed work (index math, copy set-up,
# barriers) weighs less (ncu, qwen4b batch 256: 19.0 M warp instructions with 8 warps, 13.0 M
# with 4; calls U and U2). H200, FP32, side by side (call W,
# benchmarks/results/2026-11-29-h200-session7): qwen4b (VPH 2) batch 256 L = 16 168.3 to 164.6
# us, L = 32 178.4 to 176.2, batch 128 level, batch 64 46.6 to 47.8 and batch 8 9.9 to 11.6;
# qwen122b (VPH 4) batch 256 L = 16 317.0 to 318.6 and L = 32 338.4 to 388.7.
FEW_RECORDS_WARPS_MIN_CTAS_PER_SM = 8
FEW_RECORDS_WARPS_MAX_ROWS_PER_THREAD = 2
RECORDS_WARPS_ENV = "REPLAYSSM_GDN_RECORDS_WARPS"
FEW_RECORDS_THREADS = 4 * 32  # Records<..., 4>::kThreads: one thread per value head for its scalars


def few_records_warps(spec: KernelSpec, records_ctas: int, sms: int) -> bool:
    """Whether GDN's split records kernel runs 4-warp CTAs for `records_ctas` (key head, batch
    row) items on `sms` SMs (see FEW_RECORDS_WARPS_MIN_CTAS_PER_SM);
    REPLAYSSM_GDN_RECORDS_WARPS=4 or 8 forces the count. Mamba-2 always runs 8."""
    forced = _forced(RECORDS_WARPS_ENV, ("4", "8"))
    if spec.family != "gdn" or split_records_heads(spec) > FEW_RECORDS_THREADS:
        return False
    if forced:
        return forced == "4"
    rows_per_thread = spec.dim("vph") * spec.dim("v") / FEW_RECORDS_THREADS
    return (
        records_ctas >= FEW_RECORDS_WARPS_MIN_CTAS_PER_SM * sms
        and rows_per_thread <= FEW_RECORDS_WARPS_MAX_ROWS_PER_THREAD
    )


# GDN's split state kernel caps its registers (gdn::State's CAPPED_REGISTERS: at most 96 per thread,
# so 5 CTAs of the 64-row, 4-warp tile per SM instead of 4) from this many state CTAs per SM, by
# checkpoint dtype. H200, L = 16, side by side (calls M and F1, benchmarks/results/2026-11-29-h200-session8),
# amortized us uncapped to capped, (state CTAs per SM):
#   FP32: qwen4b batch 64 (31) 45.9 to 46.8, 128 (62) 85.6 to 85.6, 256 (124) 162.4 to 161.9;
#         qwen122b batch 32 (31) 46.0 to 46.1, 64 (62) 84.0 to 83.9, 128 (124) 160.2 to 159.5.
#   BF16: qwen4b batch 16 (7.8) 13.2 to 13.9, 32 (15.5) 20.8 to 19.9, 256 118.5 to 112.6;
#         qwen122b batch 8 (7.8) 14.1 to 14.4, 16 (15.5) 22.4 to 21.4, 256 228.2 to 209.0.
#   FP16 (call G): qwen4b batch 16 (7.8) 12.7 to 13.7, 32 (15.5) 19.8 to 19.4, 256 117.4 to
#         111.2; qwen122b batch 8 (7.8) 13.6 to 14.1, 16 (15.5) 21.7 to 21.1, 256 225.7 to 206.9.
CAPPED_STATE_REGISTERS_MIN_CTAS_PER_SM = {"f32": 64, "bf16": 12, "f16": 12}
CAPPED_STATE_REGISTERS_ENV = "REPLAYSSM_GDN_CAPPED_STATE_REGISTERS"


def capped_state_registers(spec: KernelSpec, state_ctas: int, sms: int) -> bool:
    """Whether GDN's split state kernel runs with capped registers for `state_ctas` CTAs on `sms`
    SMs (see CAPPED_STATE_REGISTERS_MIN_CTAS_PER_SM); REPLAYSSM_GDN_CAPPED_STATE_REGISTERS=0 or 1
    forces it. Mamba-2 has no such variant."""
    forced = _forced(CAPPED_STATE_REGISTERS_ENV, ("0", "1"))
    if spec.family != "gdn":
        return False
    if forced:
        return forced == "1"
    return state_ctas >= CAPPED_STATE_REGISTERS_MIN_CTAS_PER_SM[spec.state_dtype] * sms


def rows_env(family: str) -> str:
    """The variable that forces a family's per-item tile, e.g. REPLAYSSM_MAMBA2_ROWS_PER_CTA."""
    return f"REPLAYSSM_{family.upper()}_ROWS_PER_CTA"


# (batch row, head) pairs per SM from which the split kernel runs the ReplaySSM step; below
# it (batch 1 at the model shapes) the per-item kernel does. H200, L = 16
# (benchmarks/results/2026-11-29-h200-split): the split kernel's cycle beats the per-item kernel
# (and the streaming kernel since removed) from batch 8 up (super120b FP32 batch 256: 327.4
# against 466.9 and 436.2 us; qwen4b: 200.8 against 237.1; qwen4b batch 8: 11.5 against 12.5)
# and loses at batch 1 (super120b, 128 pairs on 132 SMs: 8.1-8.9 against 6.2; qwen4b 6.4
# against 6.2), for both families and every checkpoint dtype measured. With narrow rows
# (2026-11-29-h200-records) the gap at batch 256 stays: super120b 328.6 against 393.0 us.
SPLIT_MIN_PAIRS_PER_SM = 1

# Below SPLIT_MIN_PAIRS_PER_SM, a step with FP32 checkpoints flushes every token on the per-item
# kernel ("flush-every-step"): with nothing held, the step is the conventional one plus a cursor
# read, at the latency of a launch that moves a few MiB. Low-precision checkpoints keep the
# window, so that they are rounded once per L tokens rather than every token.
SMALL_BATCH_FLUSH_EVERY_STEP = True


def choose_replay_kernel(spec: KernelSpec, batch: int, num_heads: int, device: torch.device) -> str:
    """Which kernel runs `spec`'s ReplaySSM step at this batch (one of REPLAY_KERNELS): split
    from SPLIT_MIN_PAIRS_PER_SM where the shape allows it (at most SPLIT_RECORDS_THREADS heads
    per group or key head, and their records fit a CTA's shared memory), else per item, flushing
    every token for FP32 checkpoints (SMALL_BATCH_FLUSH_EVERY_STEP); REPLAYSSM_REPLAY_KERNEL
    overrides."""
    forced = _forced(REPLAY_KERNEL_ENV, REPLAY_KERNELS, f"one of {REPLAY_KERNELS}")
    records_bytes, heads = split_records_shared_bytes(spec), split_records_heads(spec)
    can_split = records_bytes <= MAX_CTA_SHARED_BYTES and heads <= SPLIT_RECORDS_THREADS
    if forced == "split" and not can_split:
        raise ValueError(
            f"{REPLAY_KERNEL_ENV}: 'split' needs at most {SPLIT_RECORDS_THREADS} heads per group "
            f"or key head and {MAX_CTA_SHARED_BYTES} bytes of shared memory for their records; "
            f"got {heads} heads and {records_bytes} bytes ({spec.uri})"
        )
    if forced:
        return forced
    if can_split and batch * num_heads >= SPLIT_MIN_PAIRS_PER_SM * sm_count(device):
        return "split"
    if SMALL_BATCH_FLUSH_EVERY_STEP and spec.state_dtype == "f32":
        return "flush-every-step"
    return "per-item"


def choose_launch(
    spec: KernelSpec, batch: int, num_heads: int, device: torch.device, *, replay: bool
) -> tuple[int, int]:
    """(rows, flags) for a step of `spec`'s module at this batch: the ReplaySSM kernel from
    choose_replay_kernel and its row tile (the per-item tiles, which the split kernel's state
    kernel shares). num_heads: heads of the state pool (H for Mamba-2, HV for GDN)."""
    row_dim, col_dim = STATE_DIMS[spec.family]
    rows = spec.dim(row_dim)
    kernel = choose_replay_kernel(spec, batch, num_heads, device) if replay else "per-item"
    targets = TILE_TARGETS_CTAS_PER_SM[kernel if replay else "conventional"][spec.family]
    tile = choose_rows_per_cta(
        spec_tilings(spec), rows, batch, num_heads, device, rows_env(spec.family),
        cols=spec.dim(col_dim), targets=targets,
    )  # fmt: skip
    records_ctas, sms = batch * (num_heads // split_records_heads(spec)), sm_count(device)
    flags = launch_flags(kernel=kernel, records_ctas=records_ctas, sms=sms)
    few = few_records_warps(spec, records_ctas, sms)  # (checks the override whatever the kernel)
    capped = capped_state_registers(spec, batch * num_heads * (rows // tile), sms)  # (likewise)
    if flags & FLAG_SPLIT and few:
        flags |= FLAG_FEW_RECORDS_WARPS
    if flags & FLAG_SPLIT and capped:
        flags |= FLAG_CAPPED_STATE_REGISTERS
    return tile, flags
