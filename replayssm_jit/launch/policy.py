"""The launch policy: which kernel, row tile and flags run a step of a spec at a batch size.

Every rule keeps a one-line reason here; the measurements behind each constant are in
docs/tuning.md or docs/tuning-kernels.md under the constant's name. A LaunchConfig field other
than "auto" overrides the rule it names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

# The modules' flag bits are defined once, in core (rendered into every module from there).
from replayssm_jit.core.launch_flags import (
    FLAG_CAPPED_STATE_REGISTERS,
    FLAG_FEW_RECORDS_WARPS,
    FLAG_FLUSH_EVERY_STEP,
    FLAG_OVERLAP_PRIOR_KERNEL,
    FLAG_SPECULATIVE_RECORDS,
    FLAG_SPLIT,
)
from replayssm_jit.core.tiles import (
    MAX_CTA_SHARED_BYTES,
    SPLIT_RECORDS_THREADS,
    lane_values,
)
from replayssm_jit.families import get_family
from replayssm_jit.families.spec import KernelSpec, spec_tilings
from replayssm_jit.launch.config import AUTO, LaunchConfig

# 4-warp tiles beat 8-warp tiles of twice the rows.
PREFERRED_WARPS = 4
# More state values per lane than this spill the per-item kernels' registers.
MAX_LANE_VALUES = 96
# From one (batch row, head) pair per SM the split step's cycle beats the per-item kernel.
SPLIT_MIN_PAIRS_PER_SM = 1
# Below it, one checkpoint copy of these dtypes flushes every token (the conventional step's
# reads, writes and rounding, plus a cursor read), which beats replaying a window there; e4m3
# and NVFP4 keep their window, as rounding them every token is what the window avoids.
EVERY_STEP_STATE_DTYPES = ("f32", "bf16", "f16")
# Past a couple of records CTAs per SM, loading unheld ring rows costs more bandwidth than the
# round trip it saves.
SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM = 2
# Under a few records CTAs per SM, overlapping the previous kernel's tail does not pay.
SPLIT_OVERLAP_PRIOR_MIN_RECORDS_CTAS_PER_SM = 4
# With the grid several times over the chip and little work per row, a 4-warp records CTA
# spends less on per-warp fixed work.
FEW_RECORDS_WARPS_MIN_CTAS_PER_SM = 8
FEW_RECORDS_WARPS_MAX_ROWS_PER_THREAD = 2
FEW_RECORDS_THREADS = 4 * 32  # one thread per value head for its scalars
# Capping the split state kernel's registers fits one more CTA per SM; it pays once the
# grid is many times over the chip (sooner for 16-bit checkpoints).
CAPPED_STATE_REGISTERS_MIN_CTAS_PER_SM = {"f32": 64, "bf16": 12, "f16": 12, "e4m3": 12, "nvfp4": 12}

# Under one (batch row, head) pair per SM, the per-item verify runs faster on 32-row tiles than
# on the smaller ones its CTAs-per-SM target picks: fewer row tiles repeat each head's records.
VERIFY_FEW_PAIRS_ROWS = 32
# The split verify's state CTAs each carry T drafts' work behind the records kernel: from
# VERIFY_SPLIT_STATE_MIN_DRAFTS drafts, where the step's tile gives fewer CTAs per SM than this,
# half that tile runs faster (GDN at batches 4-16; at T = 2 it does not pay).
VERIFY_SPLIT_STATE_MIN_CTAS_PER_SM = 8
VERIFY_SPLIT_STATE_MIN_DRAFTS = 4

# Where no GPU is visible (CPU tests of the policy), plan for an H200.
DEFAULT_SM_COUNT = 132


@dataclass(frozen=True)
class Launch:
    """What plan() chose: the kernel ("conventional", "split", "per-item" or
    "flush-every-step"), its row tile, and the flags word (flag_bits) the module's bindings take."""

    kernel: str
    rows_per_cta: int
    flag_bits: int


@cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of `device`, read once per device (an H200's 132 for a non-CUDA device)."""
    if device.type == "cuda":
        return _cuda_sm_count(
            device.index if device.index is not None else torch.cuda.current_device()
        )
    return DEFAULT_SM_COUNT


def can_split(spec: KernelSpec) -> bool:
    """Whether `spec`'s split step fits: at most SPLIT_RECORDS_THREADS heads per key head, and
    their records within one CTA's shared memory."""
    fam = get_family(spec.family)
    heads = spec.heads_per_key
    return heads <= SPLIT_RECORDS_THREADS and fam.records_shared_bytes(spec) <= MAX_CTA_SHARED_BYTES


def flushes_every_step_when_small(spec: KernelSpec) -> bool:
    """Whether `spec`'s replay step flushes every token below SPLIT_MIN_PAIRS_PER_SM: one
    checkpoint copy (no read copy) of an EVERY_STEP_STATE_DTYPES dtype."""
    return spec.state_dtype in EVERY_STEP_STATE_DTYPES and spec.read_dtype is None


def choose_replay_kernel(
    spec: KernelSpec, batch: int, heads: int, sms: int, config: LaunchConfig
) -> str:
    """Split from SPLIT_MIN_PAIRS_PER_SM pairs per SM where the spec can split; below it (or
    where it cannot) the per-item kernel, flushing every token for one checkpoint copy of an
    EVERY_STEP_STATE_DTYPES dtype (with nothing held, the step is the conventional one plus a
    cursor read). e4m3 and NVFP4 checkpoints keep the window so that they are rounded once per
    L tokens, and so does a read copy, which only non-flush steps read."""
    if config.kernel == "split" and not can_split(spec):
        fam = get_family(spec.family)
        raise ValueError(
            f"config.kernel: 'split' needs at most {SPLIT_RECORDS_THREADS} heads per key head and "
            f"{MAX_CTA_SHARED_BYTES} bytes of shared memory for their records; got "
            f"{spec.heads_per_key} heads and {fam.records_shared_bytes(spec)} "
            f"bytes ({spec.uri})"
        )
    if config.kernel != AUTO:
        return config.kernel
    if batch * heads >= SPLIT_MIN_PAIRS_PER_SM * sms and can_split(spec):
        return "split"
    return "flush-every-step" if flushes_every_step_when_small(spec) else "per-item"


def can_split_verify(spec: KernelSpec) -> bool:
    """Whether `spec`'s family has a split verify step for its checkpoint (Family.
    verify_read_copy "per-item": none with a read copy) and its records kernel fits one CTA."""
    fam = get_family(spec.family)
    if spec.read_dtype is not None and fam.verify_read_copy == "per-item":
        return False
    needed = fam.verify_records_shared_bytes(spec)
    return needed is not None and needed <= MAX_CTA_SHARED_BYTES


def choose_verify_kernel(
    spec: KernelSpec, batch: int, heads: int, sms: int, config: LaunchConfig
) -> str:
    """The verify step's kernel: "split" (a records kernel per group, then the state kernel)
    where the spec can, from the family's verify_split_min_pairs_per_sm (batch row, head)
    pairs per SM, or wherever config.verify_kernel (else config.kernel) asks for "split"; else
    "per-item". A config.verify_kernel of "split" where the spec has none is refused."""
    if not can_split_verify(spec):
        if config.verify_kernel == "split":
            raise ValueError(
                f"config.verify_kernel: expected 'per-item' or 'auto' ({spec.uri} has no split "
                f"verify), got 'split'"
            )
        return "per-item"
    if config.verify_kernel != AUTO:
        return config.verify_kernel
    if config.kernel != AUTO:
        return "split" if config.kernel == "split" else "per-item"
    threshold = get_family(spec.family).launch.verify_split_min_pairs_per_sm * sms
    return "split" if batch * heads >= threshold else "per-item"


def _largest_filling_tile(options: list[int], rows: int, batch: int, heads: int, sms: int,
                          targets: Sequence[int]) -> int:  # fmt: skip
    """The largest tile (options largest first) whose CTAs cover every SM as many times as the
    first of `targets` some tile reaches, else the smallest."""
    for target in targets:
        for r in options:
            if batch * heads * (rows // r) >= target * sms:
                return r
    return options[-1]


def choose_rows_per_cta(spec: KernelSpec, step: str, batch: int, heads: int, sms: int,
                        config: LaunchConfig, field: str = "rows_per_cta") -> int:  # fmt: skip
    """config.`field` where set (one of the compiled tiles), else the largest row tile of
    PREFERRED_WARPS warps, at most MAX_LANE_VALUES state values per lane, that reaches the
    step's CTAs-per-SM target (the family's tile_targets; with a read copy its "<step> read
    copy" entry where it has one)."""
    tilings = spec_tilings(spec)
    options = [r for r, _ in tilings]
    asked = getattr(config, field)
    if asked != AUTO:
        if asked not in options:
            raise ValueError(
                f"config.{field}: expected one of {options} (compiled into {spec.uri}), got {asked}"
            )
        return asked
    rows, cols = spec.state_rows_cols
    preferred = [(r, w) for r, w in tilings if w == PREFERRED_WARPS] or list(tilings)
    light = [(r, w) for r, w in preferred if lane_values(r, w, cols) <= MAX_LANE_VALUES]
    preferred = light or preferred
    targets = get_family(spec.family).launch.tile_targets
    targets = targets.get(f"{step} read copy", targets[step]) if spec.read_dtype else targets[step]
    return _largest_filling_tile([r for r, _ in preferred], rows, batch, heads, sms, targets)


def split_records_ctas(spec: KernelSpec, batch: int, heads: int) -> int:
    """CTAs of a split records kernel: one per (batch row, group or key head)."""
    return batch * (heads // spec.heads_per_key)


def few_pairs_verify_rows(spec: KernelSpec, batch: int, heads: int, sms: int) -> int:
    """VERIFY_FEW_PAIRS_ROWS for the per-item verify under one (batch row, head) pair per SM,
    where that tile is compiled within MAX_LANE_VALUES state values per lane; else 0."""
    if batch * heads >= sms:
        return 0
    cols = spec.state_rows_cols[1]
    fits = [r for r, w in spec_tilings(spec)
            if r == VERIFY_FEW_PAIRS_ROWS and lane_values(r, w, cols) <= MAX_LANE_VALUES]  # fmt: skip
    return fits[0] if fits else 0


def split_verify_state_rows(spec: KernelSpec, rows_per_cta: int, batch: int, heads: int,
                            sms: int) -> int:  # fmt: skip
    """The split verify's state tile: `rows_per_cta` (the split step's), or half of it from
    VERIFY_SPLIT_STATE_MIN_DRAFTS drafts where that gives under VERIFY_SPLIT_STATE_MIN_CTAS_PER_SM
    CTAs per SM and the half is compiled."""
    rows = spec.state_rows_cols[0]
    ctas = batch * heads * (rows // rows_per_cta)
    if (
        spec.drafts < VERIFY_SPLIT_STATE_MIN_DRAFTS
        or ctas >= VERIFY_SPLIT_STATE_MIN_CTAS_PER_SM * sms
    ):
        return rows_per_cta
    half = [r for r, w in spec_tilings(spec) if r == rows_per_cta // 2 and w == PREFERRED_WARPS]
    return half[0] if half else rows_per_cta


def choose_verify_rows(spec: KernelSpec, verify: str, batch: int, heads: int, sms: int,
                       config: LaunchConfig, *, replay: bool) -> int:  # fmt: skip
    """The verify's row tile: config.verify_rows_per_cta, else config.rows_per_cta, else the
    step's tile (the split verify's state kernel takes the split step's tiles; a conventional
    plan's snapshot the conventional step's), adjusted for the verify where left "auto":
    few_pairs_verify_rows per item, split_verify_state_rows split."""
    field = "rows_per_cta" if config.verify_rows_per_cta == AUTO else "verify_rows_per_cta"
    step = verify if replay else "conventional"
    rows = choose_rows_per_cta(spec, step, batch, heads, sms, config, field)
    if not replay or getattr(config, field) != AUTO:
        return rows
    if verify == "per-item":
        return few_pairs_verify_rows(spec, batch, heads, sms) or rows
    return split_verify_state_rows(spec, rows, batch, heads, sms)


def launch_flags(kernel: str, records_ctas: int, sms: int, config: LaunchConfig) -> int:
    """Speculative ring loads: always per item (nothing held under flush-every-step, so never
    there), and for the split step under SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM records CTAs
    per SM. Programmatic launch after the previous kernel: per item always, split from
    SPLIT_OVERLAP_PRIOR_MIN_RECORDS_CTAS_PER_SM."""
    if config.speculative_records != AUTO:
        speculative = config.speculative_records
    elif kernel == "flush-every-step":
        speculative = False
    else:
        speculative = (
            kernel != "split" or records_ctas < SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM * sms
        )
    if config.overlap_prior_kernel != AUTO:
        overlap = config.overlap_prior_kernel
    else:
        overlap = (
            kernel != "split" or records_ctas >= SPLIT_OVERLAP_PRIOR_MIN_RECORDS_CTAS_PER_SM * sms
        )
    flags = (FLAG_SPECULATIVE_RECORDS if speculative else 0) | (
        FLAG_OVERLAP_PRIOR_KERNEL if overlap else 0
    )
    if kernel == "split":
        flags |= FLAG_SPLIT
    elif kernel == "flush-every-step":
        flags |= FLAG_FLUSH_EVERY_STEP
    return flags


def verify_launch_flags(kernel: str, records_ctas: int, sms: int, config: LaunchConfig) -> int:
    """The verify step's flags word for `kernel` ("split" or "per-item"): launch_flags' rules,
    except that the per-item verify (which runs at every batch where a family cannot split) loads
    every ring row before the cursor read only under SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM
    records CTAs per SM, as the split step does."""
    flags = launch_flags(kernel, records_ctas, sms, config)
    many = records_ctas >= SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM * sms
    if config.speculative_records == AUTO and many:
        flags &= ~FLAG_SPECULATIVE_RECORDS
    return flags


def few_records_warps(spec: KernelSpec, records_ctas: int, sms: int, config: LaunchConfig) -> bool:
    """Whether the split records kernel runs 4-warp CTAs: where the family compiles them, its
    key head's value heads fit 4 warps' threads, from FEW_RECORDS_WARPS_MIN_CTAS_PER_SM records
    CTAs per SM with at most FEW_RECORDS_WARPS_MAX_ROWS_PER_THREAD value rows per thread."""
    fam = get_family(spec.family)
    heads = spec.heads_per_key
    possible = 4 in fam.launch.records_warps and heads <= FEW_RECORDS_THREADS
    if config.records_warps != AUTO:
        allowed = [w for w in fam.launch.records_warps if w != 4 or possible]
        if config.records_warps not in allowed:
            raise ValueError(
                f"config.records_warps: expected one of {allowed} for {spec.uri}, "
                f"got {config.records_warps}"
            )
        return config.records_warps == 4
    if not possible:
        return False
    rows_per_thread = heads * spec.state_rows_cols[0] / FEW_RECORDS_THREADS
    return (
        records_ctas >= FEW_RECORDS_WARPS_MIN_CTAS_PER_SM * sms
        and rows_per_thread <= FEW_RECORDS_WARPS_MAX_ROWS_PER_THREAD
    )


def capped_state_registers(
    spec: KernelSpec, state_ctas: int, sms: int, config: LaunchConfig
) -> bool:
    """Whether the split state kernel caps its registers: where the family compiles the variant,
    from CAPPED_STATE_REGISTERS_MIN_CTAS_PER_SM state CTAs per SM."""
    fam = get_family(spec.family)
    if config.capped_state_registers != AUTO:
        if config.capped_state_registers and not fam.launch.capped_state_registers:
            raise ValueError(
                f"config.capped_state_registers: expected False or 'auto' for {spec.family} "
                "(no capped-registers state kernel), got True"
            )
        return config.capped_state_registers
    if not fam.launch.capped_state_registers:
        return False
    return state_ctas >= CAPPED_STATE_REGISTERS_MIN_CTAS_PER_SM[spec.state_dtype] * sms


def choose_launch(spec: KernelSpec, batch: int, heads: int, sms: int, *, replay: bool,
                  config: LaunchConfig | None = None) -> Launch:  # fmt: skip
    """The launch of a step of `spec` at `batch` rows over a pool of `heads` value heads on
    `sms` SMs; every override in `config` is checked whether or not the step uses it."""
    config = config or LaunchConfig()
    kernel = choose_replay_kernel(spec, batch, heads, sms, config) if replay else "conventional"
    step = kernel
    rows = spec.state_rows_cols[0]
    tile = choose_rows_per_cta(spec, step, batch, heads, sms, config)
    records = split_records_ctas(spec, batch, heads)
    # The conventional step launches the per-item kernel with its flags.
    flags = launch_flags(kernel if replay else "per-item", records, sms, config)
    few = few_records_warps(spec, records, sms, config)
    capped = capped_state_registers(spec, batch * heads * (rows // tile), sms, config)
    if flags & FLAG_SPLIT and few:
        flags |= FLAG_FEW_RECORDS_WARPS
    if flags & FLAG_SPLIT and capped:
        flags |= FLAG_CAPPED_STATE_REGISTERS
    return Launch(kernel, tile, flags)


@dataclass(frozen=True)
class PlannedLaunch:
    """Every launch choice of a plan: the step's kernel, row tile and flags word, and the
    verify step's kernel ("split" or "per-item"), row tile and flags word ("", 0 and 0 where
    the spec has no drafts). On the CPU the tiles and flags are 0: the torch path takes only
    the kernel."""

    kernel: str
    rows_per_cta: int
    flag_bits: int
    verify_kernel: str = ""
    verify_rows_per_cta: int = 0
    verify_flag_bits: int = 0


def cpu_kernel(replay: bool, config: LaunchConfig) -> str:
    """The torch path's kernel: one step serves every kernel's semantics, so only an asked-for
    flush-every-step differs (the policy's small-batch choice of it is a GPU latency rule)."""
    if not replay:
        return "conventional"
    return "flush-every-step" if config.kernel == "flush-every-step" else "per-item"


def plan_launch(spec: KernelSpec, batch: int, heads: int, device: torch.device, *, replay: bool,
                config: LaunchConfig) -> PlannedLaunch:  # fmt: skip
    """The launch choices of a plan of `spec` at `batch` rows over `heads` value heads on
    `device`; `config`'s overrides are checked on every device (a CPU plan as an H200's)."""
    sms = sm_count(device)
    launch = choose_launch(spec, batch, heads, sms, replay=replay, config=config)
    verify, verify_rows = "", 0
    if spec.has_verify:  # (checked on the CPU too, where the torch path ignores them)
        verify = choose_verify_kernel(spec, batch, heads, sms, config) if replay else "per-item"
        verify_rows = choose_verify_rows(spec, verify, batch, heads, sms, config, replay=replay)
    if device.type != "cuda":
        return PlannedLaunch(cpu_kernel(replay, config), 0, 0)
    if not spec.has_verify:
        return PlannedLaunch(launch.kernel, launch.rows_per_cta, launch.flag_bits)
    records = split_records_ctas(spec, batch, heads)
    verify_flags = verify_launch_flags(verify, records, sms, config) if replay else 0
    return PlannedLaunch(launch.kernel, launch.rows_per_cta, launch.flag_bits, verify, verify_rows,
                         verify_flags)  # fmt: skip
