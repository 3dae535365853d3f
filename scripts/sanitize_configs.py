"""scripts/sanitize_kernels.py's constants, per-family table and config enumeration."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from replayssm_jit import (
    LaunchConfig,
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
from replayssm_jit.families import get_family
from replayssm_jit.families.base import Family, HeadShape
from replayssm_jit.families.layout import CacheLayout, family_layout
from replayssm_jit.families.spec import KernelSpec, spec_tilings
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
