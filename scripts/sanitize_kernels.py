"""Every kernel choice of every family, in small shapes, for NVIDIA compute-sanitizer.

Each config is one family x mode/kernel (conventional; ReplaySSM per-item, flush-every-step and
split, the split step in each records-CTA width and state-kernel register form the family
compiles) x speculative ring loads on/off x compiled row tile x checkpoint dtype, and runs a
short schedule: 6 rows (3 live slots of a 6-slot pool, one faulted row of each kind, the rest pad
rows), rows permuted every step, the slots joining at steps 0, 1 and 3 so that one launch mixes
flush and non-flush rows holding different record counts, 2L + 4 steps (L = 4) so that every slot
flushes and its ring rows are written again after the flush, fresh random inputs every step. The
faulted rows: one names a slot id outside the pool (a new one each step: past the end, negative,
the int32 extremes), and in ReplaySSM configs one names slot 5, whose cursor is corrupted before
every step to a held count no step leaves (L, the capacity, -1, the int32 extremes); the kernels'
guards must give both rows NaN outputs and touch nothing (slot ids are not checked on the host:
the plan skips that read, as in a CUDA graph). Every input is made on the
host and copied in (no PyTorch kernel runs on the device: the only kernels are ours, and
initcheck sees every input initialised by a copy). Outputs are uninitialised device memory
(--outputs empty, for initcheck: copying them back reads every element, so an element the kernel
left unwritten is reported) or NaN-poisoned (--outputs nan: a NaN left is a failed config).
After each config: live rows' outputs finite, pad rows exactly zero, faulted rows all NaN, the
live slots' checkpoints finite and cursors as counted, every other slot's checkpoint, rings and
cursors bit-identical (the corrupted cursor as last written).

The speculative configs (family x verify/snapshot x T = 2 and 4 drafts x verify row tile x
checkpoint dtype, on L = 4 replay plans) run the same rows with per-row draft counts cycling
through 0..T: verify alternates chains (committed by the next verify's fused commit, or by
commit_drafts) and trees (committed by commit_drafts with an accepted path that compacts), and
the schedule must reach early flushes, launches mixing flush and non-flush rows, and ring rows
rewritten after a flush; slot 5's cursor is corrupted in every word pair no launch leaves. The
snapshot baseline writes each live slot's T snapshot slots (one out-of-range snapshot slot on
CUDA, its write skipped) and must leave the rows' own slots, rings and cursors bit-identical.
commit_snapshots is not run: it is PyTorch ops, not a kernel of ours.

    python scripts/sanitize_kernels.py --list            # the configs and their spec URIs (CPU)
    python scripts/sanitize_kernels.py --check-preset    # every URI is in the AOT preset (CPU)
    python scripts/sanitize_kernels.py --ops verify snapshot ...  # the speculative configs only
    compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py [--quick] ...

scripts/sanitize.sh runs it under each tool on the H200; the modules come from the AOT preset
"sanitizer" (tests/support/aot_presets.py), which lists exactly the specs this script loads.
--device cpu runs the same schedules through the PyTorch path (a check of this script's own
bookkeeping; the launch choices do not apply there, and the CPU path checks slot ids on the host
and raises, so the out-of-range row becomes a pad row there).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from replayssm_jit import (
    LaunchConfig,
    commit_drafts,
    gdn_decode,
    gdn_snapshot_verify,
    gdn_verify,
    kda_decode,
    kda_snapshot_verify,
    kda_verify,
    mamba2_decode,
    mamba2_snapshot_verify,
    mamba2_verify,
    plan_decode,
)
from replayssm_jit.core.codecs import raw_bits
from replayssm_jit.families import FAMILIES, get_family
from replayssm_jit.families.base import Family, HeadShape
from replayssm_jit.families.layout import CacheLayout, family_layout
from replayssm_jit.families.spec import KernelSpec, spec_tilings
from replayssm_jit.launch.config import LAUNCH_ENV
from replayssm_jit.launch.environment import reload_launch_environment
from replayssm_jit.launch.policy import (
    DEFAULT_SM_COUNT,
    FLAG_CAPPED_STATE_REGISTERS,
    FLAG_FEW_RECORDS_WARPS,
    FLAG_FLUSH_EVERY_STEP,
    FLAG_SPECULATIVE_RECORDS,
    FLAG_SPLIT,
    can_split,
    can_split_verify,
    choose_launch,
    choose_rows_per_cta,
)
from replayssm_jit.reference import root_path

PRESET = "sanitizer"
WINDOW = 4  # replay window L (conventional specs use window 1)
DRAFTS = 1
ACT = "bf16"
BATCH = 6
NUM_SLOTS = 6
PAD = -1
LIVE_SLOTS = (4, 1, 3)  # the slots of the schedule; 0, 2 and 5 are never stepped
FAULT_SLOT = 5  # named by a row in ReplaySSM configs, its cursor corrupted before each step
OUT_OF_RANGE_IDS = (NUM_SLOTS, NUM_SLOTS + 1000, -2, -(2**31), 2**31 - 1)
JOIN_STEPS = (0, 1, 3)  # the step at which each live slot's sequence starts
PLAN_SEED = 12345
STEP_SEED = 777  # the device-tensor seed passed on odd steps
FULL_STEPS = (
    2 * WINDOW + 4
)  # every schedule's cases reached (a speculative one's ring rows rewritten)
# (checkpoint format, stochastic rounding): every format the preset builds; "f32+e4m3" is
# separate mode (an FP32 carried copy, an e4m3 read copy; Mamba-2 and GDN, no drafts), e4m3 and
# nvfp4 no drafts
STATES = (("f32", False), ("bf16", False), ("bf16", True), ("f16", False), ("e4m3", False),
          ("e4m3", True), ("f32+e4m3", False), ("f32+e4m3", True), ("nvfp4", False),
          ("nvfp4", True), ("f32+nvfp4", False), ("f32+nvfp4", True))  # fmt: skip
QUICK_STATES = (("f32", False), ("bf16", True), ("e4m3", True), ("f32+e4m3", True))


def format_supported(family: str, state: str, drafts: int) -> bool:
    """Whether the preset builds `family` with checkpoint format `state` and `drafts`."""
    if drafts > 1 and state not in ("f32", "bf16", "f16"):
        return False
    fam = get_family(family)
    if "+" in state and not fam.read_copy:
        return False
    return fam.nvfp4 or "nvfp4" not in state


REPLAY_KERNELS = ("per-item", "flush-every-step", "split")
SPEC_DRAFTS = (2, 4)  # draft lengths T of the speculative configs (ring capacity L + T)
SPEC_OPS = ("verify", "snapshot")
# Corrupted (n, p) cursor words of a T-draft layout: n out of [0, L + T), p out of [0, T], and
# n + p past L + T - 1, each a state no launch leaves.
SPEC_CORRUPT = (
    lambda T: (WINDOW + T, 0),
    lambda T: (-1, 0),
    lambda T: (0, T + 1),
    lambda T: (0, -1),
    lambda T: (WINDOW + T - 1, 1),
    lambda T: (2**31 - 1, 0),
    lambda T: (-(2**31), 2),
)


# ---------------------------------------------------------------------------------------------
# The per-family table: shape, plan options, decode op and input makers (host tensors)
# ---------------------------------------------------------------------------------------------


def _mamba2_params(s: HeadShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    H = s.value_heads
    return {
        "A": -(0.5 + 1.5 * torch.rand(H, generator=gen)),
        "D": torch.randn(H, generator=gen),
        "dt_bias": 0.1 * torch.randn(H, generator=gen),
    }


def _mamba2_token(
    s: HeadShape, batch: int, act: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    H, G, P, N = s.value_heads, s.key_heads, s.value_dim, s.key_dim
    return {
        "x": torch.randn(batch, H, P, generator=gen).to(act),
        "z": torch.randn(batch, H, P, generator=gen).to(act),
        "dt": torch.randn(batch, H, generator=gen) * 0.5 - 1.0,
        "B": (torch.randn(batch, G, N, generator=gen) / N**0.25).to(act),
        "C": (torch.randn(batch, G, N, generator=gen) / N**0.25).to(act),
    }


def _gdn_params(s: HeadShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    HV = s.value_heads
    return {
        "A_log": torch.log(0.5 + torch.rand(HV, generator=gen)),
        "dt_bias": 0.5 * torch.rand(HV, generator=gen) - 0.25,
    }


def _gdn_token(
    s: HeadShape, batch: int, act: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    H, HV, K, V = s.key_heads, s.value_heads, s.key_dim, s.value_dim
    return {
        "q": torch.randn(batch, H, K, generator=gen).to(act),
        "k": torch.randn(batch, H, K, generator=gen).to(act),
        "v": torch.randn(batch, HV, V, generator=gen).to(act),
        "a": -4.0 + 3.0 * torch.rand(batch, HV, generator=gen),
        "b": torch.randn(batch, HV, generator=gen),
    }


def _kda_params(s: HeadShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {**_gdn_params(s, gen), "dt_bias": 0.5 * torch.rand(s.value_heads * s.key_dim,
                                                              generator=gen) - 0.25}  # fmt: skip


def _kda_token(
    s: HeadShape, batch: int, act: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    a = -4.0 + 3.0 * torch.rand(batch, s.value_heads, s.key_dim, generator=gen)
    return {**_gdn_token(s, batch, act, gen), "a": a}


@dataclass(frozen=True)
class Case:
    """How this script drives one family: its layout's shape arguments (Family.shape_args),
    plan() options (every input path on), the decode op, and host-side input makers (per-layer
    parameters once per config, token inputs every step)."""

    shape: dict
    options: dict
    decode: Callable[..., torch.Tensor]
    params: Callable[[HeadShape, torch.Generator], dict[str, torch.Tensor]]
    token: Callable[[HeadShape, int, torch.dtype, torch.Generator], dict[str, torch.Tensor]]
    verify: Callable[..., torch.Tensor] | None  # None: the family has no speculative kernels
    snapshot: Callable[..., torch.Tensor] | None


# Small heads that keep the split step possible. GDN's K = 128 makes its 64-row, 4-warp tile the
# one the capped-register state kernel specializes (with K = 64 no tile would).
CASES: dict[str, Case] = {
    "mamba2": Case(
        shape=dict(num_heads=4, ngroups=2, headdim=64, dstate=64),
        options=dict(has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True),
        decode=mamba2_decode,
        params=_mamba2_params,
        token=_mamba2_token,
        verify=mamba2_verify,
        snapshot=mamba2_snapshot_verify,
    ),
    "gdn": Case(
        shape=dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=64),
        options=dict(use_qk_l2norm=True, gates_in_kernel=True),
        decode=gdn_decode,
        params=_gdn_params,
        token=_gdn_token,
        verify=gdn_verify,
        snapshot=gdn_snapshot_verify,
    ),
    "kda": Case(
        shape=dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=64),
        options=dict(use_qk_l2norm=True, gates_in_kernel=True),
        decode=kda_decode,
        params=_kda_params,
        token=_kda_token,
        verify=kda_verify,
        snapshot=kda_snapshot_verify,
    ),
}


def case_of(name: str) -> Case:
    if name not in CASES:
        raise SystemExit(
            f"sanitize_kernels: family {name!r} is registered but has no entry in CASES "
            "(add its shape, options, decode op and input makers)"
        )
    return CASES[name]


def sr_option(fam: Family) -> str:
    """The plan() option that turns on the family's "sr" flag."""
    return next(opt for opt, (flag, _) in fam.plan_options.items() if flag == "sr")


def make_layout(family: str, state: str, drafts: int = DRAFTS) -> CacheLayout:
    carried, _, read = state.partition("+")
    return family_layout(
        family, window=WINDOW, drafts=drafts, state_dtype=carried, act_dtype=ACT,
        read_dtype=read or None, **case_of(family).shape,
    )  # fmt: skip


def plan_options(family: str, sr: bool) -> dict:
    """Stochastic rounding comes with its seed read from a device tensor (the preset's form)."""
    return {**case_of(family).options, sr_option(get_family(family)): sr, "device_seed": sr}


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------

# The flag bits a ReplaySSM config fixes (overlap_prior_kernel is left to the policy; a
# conventional step reads no rings, so its speculative bit is left to the policy too).
FIXED_BITS = (
    FLAG_SPECULATIVE_RECORDS
    | FLAG_SPLIT
    | FLAG_FLUSH_EVERY_STEP
    | FLAG_FEW_RECORDS_WARPS
    | FLAG_CAPPED_STATE_REGISTERS
)


@dataclass(frozen=True)
class Config:
    family: str
    kernel: str  # "conventional", "per-item", "flush-every-step" or "split"
    rows_per_cta: int
    state: str
    sr: bool
    speculative: bool | None = None  # None: conventional (no rings to load)
    records_warps: int | None = None  # split only
    capped: bool | None = None  # split only
    flags: int = 0  # the launch flags plan() picks (on an H200's SM count)
    spec: KernelSpec | None = field(default=None, compare=False, repr=False)

    @property
    def mode(self) -> str:
        return "conventional" if self.kernel == "conventional" else "replay"

    @property
    def uri(self) -> str:
        return self.spec.uri

    @property
    def fixed_bits(self) -> int:
        return FIXED_BITS if self.mode == "replay" else FIXED_BITS & ~FLAG_SPECULATIVE_RECORDS

    def launch_config(self) -> LaunchConfig:
        fixed: dict = {"rows_per_cta": self.rows_per_cta}
        if self.kernel != "conventional":
            fixed.update(kernel=self.kernel, speculative_records=self.speculative)
        if self.kernel == "split":
            fixed.update(records_warps=self.records_warps, capped_state_registers=self.capped)
        return LaunchConfig(**fixed)

    @property
    def name(self) -> str:
        parts = [
            f"{self.family:<6}",
            f"{self.kernel:<16}",
            f"rows={self.rows_per_cta:<3}",
            f"state={self.state + ('+sr' if self.sr else ''):<7}",
        ]
        if self.speculative is not None:
            parts.append(f"speculative={int(self.speculative)}")
        if self.kernel == "split":
            parts.append(f"records_warps={self.records_warps} capped={int(self.capped)}")
        return " ".join(parts)


def launch_variants(fam: Family, mode: str) -> list[dict]:
    """(kernel, speculative, records_warps, capped) of every launch of `mode` the family
    compiles (its registry entry says which records widths and state-kernel forms)."""
    if mode == "conventional":
        return [dict(kernel="conventional")]
    variants = []
    for kernel in REPLAY_KERNELS:
        for speculative in (True, False):
            if kernel != "split":
                variants.append(dict(kernel=kernel, speculative=speculative))
                continue
            for warps in fam.launch.records_warps:
                for capped in (False, True) if fam.launch.capped_state_registers else (False,):
                    variants.append(
                        dict(kernel=kernel, speculative=speculative, records_warps=warps,
                             capped=capped)
                    )  # fmt: skip
    return variants


def expected_bits(cfg: Config) -> int:
    bits = 0
    if cfg.kernel == "split":
        bits |= FLAG_SPLIT
        bits |= FLAG_FEW_RECORDS_WARPS if cfg.records_warps == 4 else 0
        bits |= FLAG_CAPPED_STATE_REGISTERS if cfg.capped else 0
    if cfg.kernel == "flush-every-step":
        bits |= FLAG_FLUSH_EVERY_STEP
    if cfg.speculative:
        bits |= FLAG_SPECULATIVE_RECORDS
    return bits


def family_configs(family: str, quick: bool) -> list[list[Config]]:
    """The family's configs, grouped by launch variant (each group: its tiles x dtypes, in
    diagonals of that grid, so that its first configs cover every tile and every dtype)."""
    fam = get_family(family)
    groups: dict[tuple, list[tuple[tuple[int, int], Config]]] = {}
    for si, (state, sr) in enumerate(QUICK_STATES if quick else STATES):
        if not format_supported(family, state, DRAFTS):
            continue
        layout = make_layout(family, state)
        # (separate mode runs ReplaySSM steps only)
        for mode in ("replay",) if layout.read_dtype else ("conventional", "replay"):
            spec = plan_decode(
                layout, BATCH, device="cpu", mode=mode, **plan_options(family, sr)
            ).spec
            if mode == "replay" and not can_split(spec):
                raise SystemExit(f"sanitize_kernels: {spec.uri} cannot split; pick smaller heads")
            rows = [r for r, _ in spec_tilings(spec)]
            if quick:
                rows = sorted({rows[0], rows[-1]}, reverse=True)
            for variant in launch_variants(fam, mode):
                for ti, r in enumerate(rows):
                    cfg = Config(family, rows_per_cta=r, state=state, sr=sr, spec=spec, **variant)
                    launch = choose_launch(
                        spec, BATCH, layout.shape.value_heads, DEFAULT_SM_COUNT,
                        replay=mode == "replay", config=cfg.launch_config(),
                    )  # fmt: skip
                    got = (launch.kernel, launch.rows_per_cta, launch.flag_bits & cfg.fixed_bits)
                    want = (cfg.kernel, r, expected_bits(cfg))
                    if got != want:
                        raise SystemExit(
                            f"sanitize_kernels: the launch policy plans {got} for {cfg.name}, "
                            f"expected {want}"
                        )
                    cfg = replace(cfg, flags=launch.flag_bits)
                    order = ((ti - si) % len(rows), si)
                    groups.setdefault(tuple(sorted(variant.items())), []).append((order, cfg))
    return [[cfg for _, cfg in sorted(group, key=lambda e: e[0])] for group in groups.values()]


@dataclass(frozen=True)
class SpecConfig:
    """A speculative config: verify (with its commits) or the snapshot baseline, on a replay plan
    of a T-draft layout, with the verify kernels' row tile fixed."""

    family: str
    op: str  # "verify" (verify_step and commit_step) or "snapshot" (snapshot_step)
    drafts: int
    rows_per_cta: int
    state: str
    sr: bool
    spec: KernelSpec | None = field(default=None, compare=False, repr=False)
    kernel: str = "per-item"  # the verify step's: "per-item" or "split" (where compiled)

    mode = "replay"

    @property
    def uri(self) -> str:
        return self.spec.uri

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(rows_per_cta=self.rows_per_cta, kernel=self.kernel)

    @property
    def name(self) -> str:
        state = self.state + ("+sr" if self.sr else "")
        op = self.op + (" split" if self.kernel == "split" else "")
        return (f"{self.family:<6} {op:<16} rows={self.rows_per_cta:<3} state={state:<7} "
                f"drafts={self.drafts}")  # fmt: skip


def spec_configs(family: str, quick: bool) -> list[list[SpecConfig]]:
    """The family's speculative configs, grouped by (op, T), each group in diagonals of its
    tiles x dtypes grid as family_configs orders them."""
    groups: dict[tuple, list[tuple[tuple[int, int], SpecConfig]]] = {}
    for si, (state, sr) in enumerate(QUICK_STATES if quick else STATES):
        for drafts in SPEC_DRAFTS:
            if not format_supported(family, state, drafts):
                continue
            layout = make_layout(family, state, drafts)
            spec = plan_decode(layout, BATCH, device="cpu", **plan_options(family, sr)).spec
            if not spec.has_verify:
                raise SystemExit(f"sanitize_kernels: {spec.uri} compiles no verify kernels")
            rows = [r for r, _ in spec_tilings(spec)]
            if quick:
                rows = sorted({rows[0], rows[-1]}, reverse=True)
            split = ["split"] if can_split_verify(spec) else []
            for op, kernel in [(op, "per-item") for op in SPEC_OPS] + [
                ("verify", k) for k in split
            ]:
                for ti, r in enumerate(rows):
                    cfg = SpecConfig(family, op, drafts, r, state, sr, spec=spec, kernel=kernel)
                    got = choose_rows_per_cta(spec, kernel, BATCH, layout.shape.value_heads,
                                              DEFAULT_SM_COUNT, cfg.launch_config())  # fmt: skip
                    if got != r:
                        raise SystemExit(
                            f"sanitize_kernels: the launch policy plans verify rows {got} for "
                            f"{cfg.name}, expected {r}"
                        )
                    order = ((ti - si) % len(rows), si)
                    groups.setdefault((op, kernel, drafts), []).append((order, cfg))
    return [[cfg for _, cfg in sorted(group, key=lambda e: e[0])] for group in groups.values()]


def op_of(cfg: Config | SpecConfig) -> str:
    return cfg.op if isinstance(cfg, SpecConfig) else "decode"


def all_configs(families: list[str], quick: bool) -> list[Config | SpecConfig]:
    """Every config, interleaved across families, launch variants and speculative ops, so that
    a run cut short by its time budget has covered every variant on its first tiles and dtypes."""
    groups: list[list] = []
    for family in families:
        groups += family_configs(family, quick) + spec_configs(family, quick)
    return [c for batch in itertools.zip_longest(*groups) for c in batch if c is not None]


# ---------------------------------------------------------------------------------------------
# One config's schedule
# ---------------------------------------------------------------------------------------------


class ConfigFailed(AssertionError):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ConfigFailed(what)


def run_config(cfg: Config, *, device: torch.device, steps: int, outputs: str,
               empty_rings: bool) -> None:  # fmt: skip
    case = case_of(cfg.family)
    gen = torch.Generator().manual_seed(zlib.crc32(cfg.name.encode()))
    layout = make_layout(cfg.family, cfg.state)
    plan = plan_decode(
        layout, BATCH, device=device, mode=cfg.mode, config=cfg.launch_config(),
        seed=PLAN_SEED, check_slot_values=False, **plan_options(cfg.family, cfg.sr),
    )  # fmt: skip
    check(plan.spec.uri == cfg.uri, f"planned {plan.spec.uri}, expected {cfg.uri}")
    if device.type == "cuda":
        got = (plan.kernel, plan.rows_per_cta, plan.flag_bits & cfg.fixed_bits)
        want = (cfg.kernel, cfg.rows_per_cta, cfg.flags & cfg.fixed_bits)
        check(got == want, f"planned (kernel, rows, flags) {got}, expected {want}")
    shape, act = layout.shape, layout.act_dtype
    replay = cfg.mode == "replay"
    # Speculative loads read every ring row, held or not, so their rings are always initialised;
    # --empty-rings leaves the others' rings uninitialised (initcheck: only held rows are read).
    rings_empty = empty_rings and replay and not cfg.speculative
    host: dict[str, torch.Tensor] = {}
    slot_tensors: dict[str, torch.Tensor] = {}
    for t in layout.tensors():
        checkpoint = t.name in layout.checkpoint_names
        if not checkpoint and not replay:
            continue
        if t.name == "cursors":
            host[t.name] = torch.zeros(t.shape(NUM_SLOTS), dtype=t.dtype)
        elif not checkpoint and rings_empty:
            slot_tensors[t.name] = torch.empty(t.shape(NUM_SLOTS), dtype=t.dtype, device=device)
            continue
        elif t.dtype == torch.float4_e2m1fn_x2:  # every byte is two valid e2m1 codes
            codes = torch.randint(0, 256, t.shape(NUM_SLOTS), generator=gen, dtype=torch.uint8)
            host[t.name] = codes.view(t.dtype)
        else:
            values = torch.randn(t.shape(NUM_SLOTS), generator=gen)
            host[t.name] = (values.abs() if t.name.endswith("scale") else values).to(t.dtype)
        slot_tensors[t.name] = host[t.name].to(device)
    params = {k: v.to(device) for k, v in case.params(shape, gen).items()}
    out_shape = (BATCH, shape.value_heads, shape.value_dim)
    held = dict.fromkeys(LIVE_SLOTS, 0)
    epochs = dict.fromkeys(LIVE_SLOTS, 0)
    corrupt_held = (WINDOW, layout.capacity, -1, -(2**31), 2**31 - 1)
    for step in range(steps):
        active = [s for s, join in zip(LIVE_SLOTS, JOIN_STEPS) if join <= step]
        faulted = [FAULT_SLOT] if replay else []
        if device.type == "cuda":
            faulted.append(OUT_OF_RANGE_IDS[step % len(OUT_OF_RANGE_IDS)])
        rows = active + faulted + [PAD] * (BATCH - len(active) - len(faulted))
        rows = [rows[i] for i in torch.randperm(BATCH, generator=gen).tolist()]
        slot_indices = torch.tensor(rows, dtype=torch.int32).to(device)
        if replay:  # a host-to-device copy of the slot's cursor row, not a kernel
            host["cursors"][FAULT_SLOT, 0] = corrupt_held[step % len(corrupt_held)]
            slot_tensors["cursors"][FAULT_SLOT].copy_(host["cursors"][FAULT_SLOT])
        tok = {k: v.to(device) for k, v in case.token(shape, BATCH, act, gen).items()}
        if outputs == "empty":
            out = torch.empty(out_shape, dtype=act, device=device)
        else:
            out = torch.full(out_shape, float("nan"), dtype=act).to(device)
        seed = None
        if step % 2 and cfg.sr:  # only device_seed modules read a seed tensor
            seed = torch.tensor([STEP_SEED + step], dtype=torch.int64).to(device)
        case.decode(
            plan, **slot_tensors, **params, **tok, slot_indices=slot_indices, out=out, seed=seed
        )
        got = out.cpu()  # a copy of the raw output: initcheck reports any element left unwritten
        live_rows = [i for i, s in enumerate(rows) if s in active]
        pad_rows = [i for i, s in enumerate(rows) if s == PAD]
        fault_rows = [i for i, s in enumerate(rows) if s in faulted]
        check(
            bool(torch.isfinite(got[live_rows]).all()),
            f"step {step}: output not finite (or left NaN)",
        )
        check(bool((got[pad_rows] == 0).all()), f"step {step}: pad rows not zero")
        check(bool(torch.isnan(got[fault_rows]).all()), f"step {step}: faulted rows not all NaN")
        for s in active:
            if cfg.kernel == "flush-every-step":
                epochs[s] += 1
            elif cfg.kernel != "conventional":
                flush = held[s] + 1 >= WINDOW
                held[s] = 0 if flush else held[s] + 1
                epochs[s] += int(flush)
    if device.type == "cuda":
        torch.cuda.synchronize()
    live = list(LIVE_SLOTS)
    untouched = [s for s in range(NUM_SLOTS) if s not in LIVE_SLOTS]
    final = {name: raw_bits(t.cpu()) for name, t in slot_tensors.items() if name in host}
    if layout.state_dtype != torch.float4_e2m1fn_x2:  # (e2m1 codes are all finite)
        check(bool(torch.isfinite(final["state"][live].view(layout.state_dtype).float()).all()),
              "live checkpoints not finite")  # fmt: skip
    for name, t in final.items():
        check(torch.equal(t[untouched], raw_bits(host[name])[untouched]),
              f"unnamed slots' {name} changed")  # fmt: skip
    if replay:
        want = [[held[s], epochs[s], 0, 0] for s in LIVE_SLOTS]
        got = final["cursors"][live].tolist()
        check(got == want, f"cursors {got}, expected {want}")


def _check_draft_outputs(got: torch.Tensor, rows: list[int], counts: list[int], live: list[int],
                         faulted: list[int], step: int) -> None:  # fmt: skip
    """Live rows: drafts j < t finite, the rest zero; pad rows zero; faulted rows all NaN."""
    for b, s in enumerate(rows):
        if s in live:
            t = counts[b]
            check(bool(torch.isfinite(got[b, :t]).all()), f"step {step}: row {b} not finite")
            check(bool((got[b, t:] == 0).all()), f"step {step}: row {b} drafts past {t} not zero")
        elif s == PAD:
            check(bool((got[b] == 0).all()), f"step {step}: pad row {b} not zero")
        elif s in faulted:
            check(bool(torch.isnan(got[b]).all()), f"step {step}: faulted row {b} not all NaN")


def run_spec_config(cfg: SpecConfig, *, device: torch.device, steps: int, outputs: str) -> None:
    """A speculative config's schedule: the decode schedule's rows (live slots joining at steps
    0, 1 and 3, pad rows, an out-of-range id on CUDA, slot 5's corrupted cursor for verify),
    per-row draft counts cycling through 0..T. verify: chains on even steps (every fourth one
    committed by commit_drafts, the others by the next verify's fused commit), trees on odd
    steps committed by commit_drafts with the deepest draft's root path; commits mostly accept
    everything, so that held records reach the early flush and later drafts rewrite ring rows.
    snapshot: each live slot's T snapshot slots after the pool's six, an out-of-range snapshot
    slot on CUDA (a write skipped), and slot 0 named by the rows that must not read theirs."""
    case = case_of(cfg.family)
    # Both verify kernels of a spec and tile run the same schedule (whose coverage is checked).
    gen = torch.Generator().manual_seed(zlib.crc32(replace(cfg, kernel="per-item").name.encode()))
    T, verify = cfg.drafts, cfg.op == "verify"
    layout = make_layout(cfg.family, cfg.state, T)
    plan = plan_decode(
        layout, BATCH, device=device, config=cfg.launch_config(), seed=PLAN_SEED,
        check_slot_values=False, **plan_options(cfg.family, cfg.sr),
    )  # fmt: skip
    check(plan.spec.uri == cfg.uri, f"planned {plan.spec.uri}, expected {cfg.uri}")
    if device.type == "cuda":
        rows = plan.verify_rows_per_cta
        check(rows == cfg.rows_per_cta, f"planned verify rows {rows}, expected {cfg.rows_per_cta}")
        if verify:
            check(plan.verify_kernel == cfg.kernel,
                  f"planned verify kernel {plan.verify_kernel}, expected {cfg.kernel}")  # fmt: skip
    num_slots = NUM_SLOTS + len(LIVE_SLOTS) * T
    host: dict[str, torch.Tensor] = {}
    for t in layout.tensors():
        if t.name == "cursors":
            host[t.name] = torch.zeros(t.shape(num_slots), dtype=t.dtype)
        else:  # (rings always initialised: which rows the verify kernels load is theirs to pick)
            host[t.name] = torch.randn(t.shape(num_slots), generator=gen).to(t.dtype)
    slot_tensors = {name: t.to(device) for name, t in host.items()}
    shape, act = layout.shape, layout.act_dtype
    params = {k: v.to(device) for k, v in case.params(shape, gen).items()}
    out_shape = (BATCH, T, shape.value_heads, shape.value_dim)
    held = dict.fromkeys(LIVE_SLOTS, 0)
    pending = dict.fromkeys(LIVE_SLOTS, 0)
    epochs = dict.fromkeys(LIVE_SLOTS, 0)
    snap_of = {s: [NUM_SLOTS + i * T + j for j in range(T)] for i, s in enumerate(LIVE_SLOTS)}
    written: set[int] = set()
    flushed: set[int] = set()
    seen = {"flush": 0, "mixed": 0, "rewrite": 0, "tree": 0, "fused": 0, "zero": 0}
    for step in range(steps):
        active = [s for s, join in zip(LIVE_SLOTS, JOIN_STEPS) if join <= step]
        faulted = [FAULT_SLOT] if verify else []
        if device.type == "cuda":  # (ids past this pool's end: the snapshot slots follow 0..5)
            out_of_range = (num_slots, *OUT_OF_RANGE_IDS[1:])
            faulted.append(out_of_range[step % len(out_of_range)])
        rows = active + faulted + [PAD] * (BATCH - len(active) - len(faulted))
        rows = [rows[i] for i in torch.randperm(BATCH, generator=gen).tolist()]
        slot_indices = torch.tensor(rows, dtype=torch.int32).to(device)
        counts = [(step + b) % (T + 1) for b in range(BATCH)]
        num_drafts = torch.tensor(counts, dtype=torch.int32).to(device)
        tok = case.token(shape, BATCH * T, act, gen)
        inputs = {k: v.view(BATCH, T, *v.shape[1:]).to(device) for k, v in tok.items()}
        if outputs == "empty":
            out = torch.empty(out_shape, dtype=act, device=device)
        else:
            out = torch.full(out_shape, float("nan"), dtype=act).to(device)
        live_rows = [(b, s) for b, s in enumerate(rows) if s in active]
        seen["zero"] += sum(counts[b] == 0 for b, _ in live_rows)
        if not verify:
            table = [[0] * T if s not in active else list(snap_of[s]) for s in rows]
            if device.type == "cuda" and step % 2 and live_rows:
                table[live_rows[0][0]][0] = num_slots + step  # (its write is skipped)
            snapshot_slots = torch.tensor(table, dtype=torch.int32).to(device)
            case.snapshot(plan, state=slot_tensors["state"], **params, **inputs,
                          slot_indices=slot_indices, snapshot_slots=snapshot_slots, out=out,
                          num_drafts=num_drafts)  # fmt: skip
            _check_draft_outputs(out.cpu(), rows, counts, active, faulted, step)
            for b, _ in live_rows:
                written.update(x for x in table[b][: counts[b]] if 0 <= x < num_slots)
            continue
        # A corrupted cursor before each step (a host-to-device copy of its row, not a kernel).
        bad_n, bad_p = SPEC_CORRUPT[step % len(SPEC_CORRUPT)](T)
        host["cursors"][FAULT_SLOT, 0], host["cursors"][FAULT_SLOT, 3] = bad_n, bad_p
        slot_tensors["cursors"][FAULT_SLOT].copy_(host["cursors"][FAULT_SLOT])
        tree = step % 2 == 1
        parents = None
        if tree and step % 4 == 1:  # two interleaved chains: every deeper path compacts
            table = [[-1, -1, *range(T - 2)] for _ in rows]
        elif tree:
            table = [[-1] + [int(torch.randint(-1, j, (1,), generator=gen)) for j in range(1, T)]
                     for _ in rows]  # fmt: skip
        if tree:
            parents = torch.tensor(table, dtype=torch.int32)
        accept = [pending.get(s, 0) - (pending.get(s, 0) // 2 if (step + b) % 3 == 0 else 0)
                  for b, s in enumerate(rows)]  # fmt: skip
        seed = None
        if step % 2 and cfg.sr:
            seed = torch.tensor([STEP_SEED + step], dtype=torch.int64).to(device)
        case.verify(
            plan, **slot_tensors, **params, **inputs, slot_indices=slot_indices, out=out,
            num_drafts=num_drafts, parents=None if parents is None else parents.to(device),
            num_accepted=torch.tensor(accept, dtype=torch.int32).to(device), seed=seed,
        )  # fmt: skip
        _check_draft_outputs(out.cpu(), rows, counts, active, faulted, step)
        flushes = []
        for b, s in live_rows:
            seen["fused"] += int(accept[b] > 0)
            held[s] += min(accept[b], pending[s])
            flush = held[s] + counts[b] >= WINDOW + T
            flushes.append(flush)
            if flush:
                held[s], epochs[s] = 0, epochs[s] + 1
                flushed.add(s)
            elif s in flushed and counts[b]:
                seen["rewrite"] += 1
            pending[s] = counts[b]
        seen["flush"] += sum(flushes)
        seen["mixed"] += int(any(flushes) and not all(flushes))
        if tree or step % 4 == 2:  # explicit commits: the tree's deepest path, or a chain's all
            paths = []
            for b, s in enumerate(rows):
                p = pending.get(s, 0) if s in active else 0
                if tree and p:
                    paths.append(root_path(table[b][:p], p - 1))
                else:
                    paths.append(list(range(p)))
            seen["tree"] += int(any(p != list(range(len(p))) for p in paths))  # (a compaction)
            accepted = torch.tensor([len(p) for p in paths], dtype=torch.int32).to(device)
            path = None
            if tree:
                padded = [p + [0] * (T - len(p)) for p in paths]
                path = torch.tensor(padded, dtype=torch.int32).to(device)
            commit_drafts(plan, slot_tensors, num_accepted=accepted, slot_indices=slot_indices,
                          accepted_path=path)  # fmt: skip
            for b, s in live_rows:
                held[s] += len(paths[b])
                pending[s] = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    final = {name: t.cpu() for name, t in slot_tensors.items()}
    live = list(LIVE_SLOTS)
    if verify:
        check(bool(torch.isfinite(final["state"][live].float()).all()), "checkpoints not finite")
        want = [[held[s], epochs[s], 0, pending[s]] for s in LIVE_SLOTS]
        got = final["cursors"][live].tolist()
        check(got == want, f"cursors {got}, expected {want}")
        untouched = [s for s in range(num_slots) if s not in LIVE_SLOTS]
        if steps >= FULL_STEPS:  # the full schedule reaches every case it is written for
            check(all(seen.values()), f"the schedule missed a case: {seen}")
    else:
        check(bool(torch.isfinite(final["state"][sorted(written)].float()).all()),
              "snapshots not finite")  # fmt: skip
        untouched = [s for s in range(num_slots) if s not in written]
        for name in layout.ring_names + ("cursors",):  # (a snapshot writes checkpoints alone)
            check(torch.equal(final[name], host[name]), f"snapshot changed {name}")
    for name, t in final.items():
        check(torch.equal(t[untouched], host[name][untouched]), f"unwritten slots' {name} changed")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def check_preset(configs: list[Config], complete: bool) -> int:
    """Every URI the configs load is in the AOT preset (and, for the complete set, nothing
    else is); with REPLAYSSM_AOT_DIR set, each is also built there with the current sources."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support import aot_presets  # the test suites' presets (the module the tests import)

    preset = {s.uri: s for s in aot_presets.PRESETS[PRESET]()}
    needed = {c.uri: c.spec for c in configs}
    missing = sorted(set(needed) - set(preset))
    extra = sorted(set(preset) - set(needed)) if complete else []
    for uri in missing:
        print(f"not in preset {PRESET!r}: {uri}")
    for uri in extra:
        print(f"in preset {PRESET!r} but not loaded: {uri}")
    unbuilt = []
    if os.environ.get("REPLAYSSM_AOT_DIR"):
        from replayssm_jit.jit.build import find_prebuilt

        unbuilt = [uri for uri, spec in sorted(needed.items()) if find_prebuilt(spec) is None]
        for uri in unbuilt:
            print(f"not built (or stale) under REPLAYSSM_AOT_DIR: {uri}")
    problems = [
        f"{len(v)} {what}"
        for v, what in ((missing, "not in the preset"), (extra, "extra"), (unbuilt, "not built"))
        if v
    ]
    built = ", all built" if os.environ.get("REPLAYSSM_AOT_DIR") else ""
    print(
        f"check-preset: {len(configs)} configs load {len(needed)} specs; preset {PRESET!r} has "
        f"{len(preset)}: " + (f"MISMATCH ({', '.join(problems)})" if problems else f"ok{built}")
    )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES),
        help="families to run (default: every registered family)",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="largest and smallest row tiles only, FP32, BF16+SR, e4m3+SR and FP32 + e4m3+SR "
        "checkpoints only",
    )  # fmt: skip
    parser.add_argument(
        "--ops", nargs="+", choices=("decode", *SPEC_OPS), default=["decode", *SPEC_OPS],
        help="the steps to run: decode (every kernel choice), verify (with commits), snapshot",
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="print the configs and exit (CPU)")
    parser.add_argument(
        "--check-preset", action="store_true",
        help=f"check that every URI is in the AOT preset {PRESET!r} and exit (CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=FULL_STEPS, help="decode steps per config (2L + 4)"
    )
    parser.add_argument(
        "--outputs", choices=("empty", "nan"), default="empty",
        help="output buffers: uninitialised (initcheck) or NaN-poisoned",
    )  # fmt: skip
    parser.add_argument(
        "--empty-rings", action="store_true",
        help="leave the rings uninitialised where no speculative load reads them (initcheck)",
    )  # fmt: skip
    parser.add_argument(
        "--shard", default="0/1", help="K/N: run every N-th config from the K-th (default 0/1)"
    )
    parser.add_argument(
        "--time-budget", type=float, default=0.0,
        help="seconds after which no further config starts (0: none); the rest count as not run",
    )  # fmt: skip
    parser.add_argument(
        "--formats", default="",
        help="comma-separated checkpoint formats to run, as named in the configs (e.g. "
        "e4m3,e4m3+sr,f32+e4m3+sr; default: every one)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu: the same schedules on the PyTorch path (checks this script, not kernels)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    started = time.monotonic()
    os.environ.pop(LAUNCH_ENV, None)  # launch choices come from each config alone
    reload_launch_environment()
    if args.steps < 0:
        parser.error(f"--steps: expected >= 0, got {args.steps}")
    try:
        k, n = (int(v) for v in args.shard.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        parser.error(f"--shard: expected K/N with 0 <= K < N, got {args.shard!r}")
    families = [f for f in FAMILIES if f in args.families]  # registry order
    configs = [c for c in all_configs(families, args.quick) if op_of(c) in args.ops]
    if args.formats:
        wanted = set(args.formats.split(","))
        configs = [c for c in configs if c.state + ("+sr" if c.sr else "") in wanted]
    complete = not args.quick and families == list(FAMILIES) and len(args.ops) == 1 + len(SPEC_OPS)
    if args.check_preset:
        return check_preset(configs, complete)
    configs = configs[k::n]
    if args.list:
        for i, cfg in enumerate(configs):
            print(f"{i:4d} {cfg.name:<86} {cfg.uri}")
        counts = {f: sum(c.family == f for c in configs) for f in families}
        specs = len({c.uri for c in configs})
        print(f"{len(configs)} configs ({', '.join(f'{f} {c}' for f, c in counts.items())}), "
              f"{specs} specs")  # fmt: skip
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("sanitize_kernels: no CUDA device (--list and --check-preset run without one)")
            return 2
        from replayssm_jit.jit import env
        from replayssm_jit.jit.build import find_prebuilt

        if env.jit_disabled():
            unbuilt = sorted({c.uri for c in configs if find_prebuilt(c.spec) is None})
            if unbuilt:
                print(f"sanitize_kernels: {len(unbuilt)} specs not AOT-built for these sources "
                      f"(build the preset {PRESET!r} with the same REPLAYSSM_JIT_DEBUG): "
                      + ", ".join(unbuilt))  # fmt: skip
                return 2
        no_caching = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "-")
        print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"AOT {os.environ.get('REPLAYSSM_AOT_DIR', '-')}, "
              f"PYTORCH_NO_CUDA_MEMORY_CACHING={no_caching}")  # fmt: skip
    print(f"{len(configs)} configs, {args.steps} steps each, outputs {args.outputs}, "
          f"rings {'empty where unread' if args.empty_rings else 'initialised'}")  # fmt: skip
    ok = failed = 0
    for i, cfg in enumerate(configs):
        if args.time_budget and time.monotonic() - started > args.time_budget:
            print(f"time budget of {args.time_budget:.0f} s spent: {len(configs) - i} not run")
            break
        t0 = time.monotonic()
        # The config's name first: a sanitizer report printed while it runs lands after it.
        print(f"[{i + 1:4d}/{len(configs)}] {cfg.name} ", end="", flush=True)
        try:
            if isinstance(cfg, SpecConfig):
                run_spec_config(cfg, device=device, steps=args.steps, outputs=args.outputs)
            else:
                run_config(cfg, device=device, steps=args.steps, outputs=args.outputs,
                           empty_rings=args.empty_rings)  # fmt: skip
            ok += 1
            status = "ok"
        except Exception as exc:
            failed += 1
            status = "FAIL"
            print()
            if not isinstance(exc, ConfigFailed):
                traceback.print_exc()
            print(f"     {type(exc).__name__}: {exc}")
        print(f"{status} ({time.monotonic() - t0:.2f} s)", flush=True)
        if status == "FAIL" and device.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception:
                print("CUDA context lost: stopping")
                break
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # nothing cached left for --leak-check to report
    elapsed = time.monotonic() - started
    ran = ok + failed
    print(f"sanitize_kernels: {len(configs)} configs: {ok} ok, {failed} failed, "
          f"{len(configs) - ran} not run ({elapsed:.1f} s"
          f"{f', {elapsed / ran:.2f} s per config' if ran else ''})")  # fmt: skip
    if failed:
        return 1
    return 3 if ran < len(configs) else 0


if __name__ == "__main__":
    sys.exit(main())
