"""Mamba-2 (tied head dim: A and dt per head): state [H, P, N] per slot, records (dt, x, B)."""

from __future__ import annotations

from collections.abc import Mapping

from replayssm_jit.families.base import DTYPE_BYTES, Family, RingLayout, check_bool
from replayssm_jit.launch.tiles import (
    SHARED_BYTES_PER_SM,
    SHARED_BYTES_RESERVED_PER_CTA,
    SPLIT_RECORDS_FULL_SM_CTAS,
    TARGET_CTAS_PER_SM,
)

PLAN_OPTIONS = {
    "has_D": ("d", True),
    "has_z": ("z", False),
    "has_dt_bias": ("dt_bias", True),
    "dt_softplus": ("dt_softplus", True),
    "stochastic_rounding": ("sr", False),
}


class Mamba2Family(Family):
    def records_shared_bytes(self, spec) -> int:
        """Records::Smem of templates/mamba2/split_kernel.cuh for a group's heads: held B rows,
        this token's x, the scalars, and the held x rows where a full SM of records CTAs still
        fits with them (else they are read through L2 and one row stands in for the array)."""
        act, cap = DTYPE_BYTES[spec.act_dtype], spec.capacity
        ring = max(cap - 1, 1)
        heads, p, n = spec.dim("hpg"), spec.dim("p"), spec.dim("n")
        base = heads * p * act + (ring + 2) * n * act + 4 * (3 * heads * cap + cap + 4 * heads)
        base += 6 * 16  # 16-byte alignment of the record arrays
        held_rows = heads * ring * p * act
        fits = (
            SHARED_BYTES_PER_SM // (base + held_rows + SHARED_BYTES_RESERVED_PER_CTA)
            >= SPLIT_RECORDS_FULL_SM_CTAS
        )
        return base + (held_rows if fits else p * act)

    def plan_flags(self, options: Mapping[str, object], shape) -> tuple[tuple[str, ...], dict]:
        unknown = sorted(set(options) - set(PLAN_OPTIONS))
        if unknown:
            raise TypeError(
                f"plan(): unexpected options {unknown} for mamba2; expected {sorted(PLAN_OPTIONS)}"
            )
        flags = []
        for option, (flag, default) in PLAN_OPTIONS.items():
            if check_bool(option, options.get(option, default)):
                flags.append(flag)
        return tuple(flags), {}


MAMBA2 = Mamba2Family(
    name="mamba2",
    template="mamba2/decode.cu.jinja",
    shape_args=("ngroups", "num_heads", "dstate", "headdim"),
    spec_dims=(
        ("p", "value_dim", "headdim"),
        ("n", "key_dim", "dstate"),
        ("hpg", "heads_per_key", "heads_per_group"),
    ),
    rings=(
        RingLayout("rec_x", heads="value", width="value_dim", dtype="act"),
        RingLayout("rec_b", heads="key", width="key_dim", dtype="act"),
        RingLayout("rec_dt", heads="value", width=None, dtype="f32"),
    ),
    flags=frozenset({"d", "z", "dt_bias", "dt_softplus", "sr"}),
    default_flags=("d", "dt_bias", "dt_softplus"),
    records_warps=(8,),
    capped_state_registers=False,
    flush_every_step_kernel=True,
    # The conventional step wants more, smaller tiles; where no tile gives 16 CTAs per SM
    # (batch 1), the largest giving 2 (docs/tuning.md, TILE_TARGETS_CTAS_PER_SM).
    tile_targets={
        "conventional": (16, TARGET_CTAS_PER_SM),
        "split": (TARGET_CTAS_PER_SM,),
        "per-item": (TARGET_CTAS_PER_SM,),
        "flush-every-step": (TARGET_CTAS_PER_SM,),
    },
)
