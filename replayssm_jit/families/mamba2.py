"""Mamba-2 (tied head dim: A and dt per head): state [H, P, N] per slot, records (dt, x, B)."""

from __future__ import annotations

from replayssm_jit.core.dtypes import DTYPE_BYTES
from replayssm_jit.core.tiles import TARGET_CTAS_PER_SM
from replayssm_jit.families.base import Family, LaunchTraits, RingLayout
from replayssm_jit.families.schema import Input

# Mamba-2's token inputs, in the bindings' order (x, z [.., H, P]; dt [.., H]; B, C [.., G, N]).
MAMBA2_INPUTS = (
    Input("x", ("lead", "value_heads", "value_dim"), "act", "inner", aligned=True),
    Input("z", ("lead", "value_heads", "value_dim"), "act", "inner", aligned=True,
          planned=("has_z", "z", True)),
    Input("dt", ("lead", "value_heads"), "f32"),
    Input("A", ("value_heads",), "f32", "contiguous"),
    Input("D", ("value_heads",), "f32", "contiguous", planned=("has_D", "d", True)),
    Input("dt_bias", ("value_heads",), "f32", "contiguous",
          planned=("has_dt_bias", "dt_bias", True)),
    Input("B", ("lead", "key_heads", "key_dim"), "act", "inner", aligned=True),
    Input("C", ("lead", "key_heads", "key_dim"), "act", "inner", aligned=True),
)  # fmt: skip


class Mamba2Family(Family):
    def records_shared_bytes(self, spec) -> int:
        """Records::Smem of templates/mamba2/split_kernel.cuh for a group's heads: held B rows,
        this token's x, the scalars, and the held x rows where they fit."""
        act, cap = DTYPE_BYTES[spec.act_dtype], spec.capacity
        ring = max(cap - 1, 1)
        heads, p, n = spec.heads_per_key, spec.value_dim, spec.key_dim
        base = heads * p * act + (ring + 2) * n * act + 4 * (3 * heads * cap + cap + 4 * heads)
        base += 6 * 16  # 16-byte alignment of the record arrays
        return self.held_rows_where_they_fit(base, heads * ring * p * act, p * act)

    def verify_records_shared_bytes(self, spec) -> int | None:
        """VerifyRecords::Smem of templates/mamba2/verify_split_kernel.cuh: B and C rows, dots,
        per-head decays and weights, all 4-byte words."""
        T, n, heads = spec.drafts, spec.key_dim, spec.heads_per_key
        records = spec.capacity - 1 + T
        words = (records + T) * n + T * records + 3 * heads * records + heads * T * records
        words += heads * T + heads + 3 * T  # path sums, committed sums, the draft tree
        return 4 * words


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
    default_flags=("d", "dt_bias", "dt_softplus"),
    plan_options={
        "has_D": ("d", True),
        "has_z": ("z", False),
        "has_dt_bias": ("dt_bias", True),
        "dt_softplus": ("dt_softplus", True),
        "stochastic_rounding": ("sr", False),
        # Separate mode: round the read copy to nearest while SR rounds the carried one.
        "read_copy_round_to_nearest": ("read_rn", False),
        "device_seed": ("device_seed", False),
        # A [batch] mask the step reads on the device: a nonzero row flushes now (SGLang's
        # prefix tracking).
        "flush_mask": ("flush_mask", False),
    },
    launch=LaunchTraits(
        records_warps=(8,),
        capped_state_registers=False,
        flush_every_step_kernel=True,
        # The conventional step wants more, smaller tiles; where no tile gives 16 CTAs per SM
        # (batch 1), the largest giving 2. A windowed per-item step repeats its records' work in
        # every CTA: the largest tile giving each SM one (docs/tuning.md, tile_targets).
        tile_targets={
            "conventional": (16, TARGET_CTAS_PER_SM),
            "split": (TARGET_CTAS_PER_SM,),
            "per-item": (1,),
            "flush-every-step": (TARGET_CTAS_PER_SM,),
        },
    ),
    read_copy=True,
    nvfp4=True,
    verify_scaled_checkpoint=True,
    verify_read_copy=True,
    inputs=MAMBA2_INPUTS,
    fold_inputs=("A",),
)
