"""Gated DeltaNet (a scalar decay per head) and the delta-rule code it shares with Kimi Delta
Attention (families/kda.py, a decay per key channel): the inputs, the records' shared memory and
the scale option. State [HV, V, K] per slot, records (g, u, k). Separate mode (GDN) also records
(v, beta): a flush recomputes each held u from the carried copy."""

from __future__ import annotations

import math
from collections.abc import Mapping

from replayssm_jit.core.dtypes import DTYPE_BYTES
from replayssm_jit.core.tiles import TARGET_CTAS_PER_SM
from replayssm_jit.families.base import Family, HeadShape, LaunchTraits, RingLayout
from replayssm_jit.families.schema import Input


def delta_inputs(decay: tuple[str, ...], decay_strides: str, dt_bias: str) -> tuple[Input, ...]:
    """A delta-rule family's token inputs in the bindings' order: q, k, v, then the gates,
    raw (a, b, A_log, dt_bias; gates_in_kernel) or precomputed (g, beta), a and g filling the
    binding's gate_a and b and beta its gate_b. decay: the per-head shape of a and g."""
    raw, pre = (
        ("gates_in_kernel", "gates_in_kernel", True),
        ("gates_in_kernel", "gates_in_kernel", False),
    )
    return (
        Input("q", ("lead", "key_heads", "key_dim"), "act", "inner", aligned=True),
        Input("k", ("lead", "key_heads", "key_dim"), "act", "inner", aligned=True),
        Input("v", ("lead", "value_heads", "value_dim"), "act", "inner", aligned=True),
        Input("a", ("lead", *decay), "f32", decay_strides, planned=raw, binds="gate_a"),
        Input("b", ("lead", "value_heads"), "f32", planned=raw, binds="gate_b"),
        Input("A_log", ("value_heads",), "f32", "contiguous", planned=raw),
        Input("dt_bias", (dt_bias,), "f32", "contiguous", planned=raw),
        Input("g", ("lead", *decay), "f32", decay_strides, planned=pre, binds="gate_a"),
        Input("beta", ("lead", "value_heads"), "f32", planned=pre, binds="gate_b"),
    )


class DeltaFamily(Family):
    def records_shared_bytes(self, spec) -> int:
        """Records::Smem of templates/gdn/split_kernel.cuh for a key head's value heads: held k
        rows, this token's k, q and v, the scalars, the per-channel decays (KDA), separate mode's
        held Gram (HeldGramSmem), and the held u rows where they fit (the 4-warp variant holds them in shared memory less often, so this
        bounds it too)."""
        act, cap = DTYPE_BYTES[spec.act_dtype], spec.capacity
        ring = max(cap - 1, 1)
        heads, k, v = spec.heads_per_key, spec.key_dim, spec.value_dim
        base = (ring + 2) * k * act + 4 * (4 * heads * cap + 3 * cap + 1 + 3 * heads)
        base += 4 * self.channel_decay_words(heads, cap, k)
        if spec.read_dtype is not None:  # separate mode: the held k Gram and a decay row per warp
            base += 4 * (cap * cap + 8 * cap)
        base += 8 * 16  # 16-byte alignment of the record arrays
        return self.held_rows_where_they_fit(base, heads * ring * v * 4, v * 4)

    def channel_decay_words(self, heads: int, cap: int, key_dim: int) -> int:
        """Words of per-channel log-decays a records CTA stages (the held rows and this token's)."""
        return heads * (cap + 1) * key_dim if self.decay_per_channel else 2

    def verify_records_shared_bytes(self, spec) -> int | None:
        """VerifyRecords::Smem of templates/gdn/verify_split_kernel.cuh: k and q rows, dots,
        norms, per-value-head decays and weights, all 4-byte words."""
        if self.decay_per_channel:
            return None  # (per channel: the per-item verify kernel only)
        T, k, heads = spec.drafts, spec.key_dim, spec.heads_per_key
        records = spec.capacity - 1 + T
        words = (records + T) * k + 2 * T * records + records + T
        words += 2 * heads * records + heads * T + 2 * heads * T * records + heads * T + heads
        return 4 * (words + 3 * T)  # and the draft tree

    def plan_scalars(self, options: Mapping[str, object], shape: HeadShape) -> dict:
        """scale: multiplies q after its norm (default head_k_dim ** -0.5)."""
        scale = options.get("scale")
        if scale is None:
            scale = shape.key_dim**-0.5
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise TypeError(f"scale: expected a float, got {type(scale).__name__} {scale!r}")
        if not math.isfinite(scale):
            raise ValueError(f"scale: expected a finite float, got {scale!r}")
        return {"scale": float(scale)}


# Separate mode's flush recomputes each held u = beta (v - alpha S k) from the carried copy.
SEPARATE_MODE_RINGS = (
    RingLayout("rec_v", heads="value", width="value_dim", dtype="act", read_copy_only=True),
    RingLayout("rec_beta", heads="value", width=None, dtype="f32", read_copy_only=True),
)

GDN = DeltaFamily(
    name="gdn",
    template="gdn/decode.cu.jinja",
    shape_args=("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"),
    spec_dims=(
        ("k", "key_dim", "head_k_dim"),
        ("v", "value_dim", "head_v_dim"),
        ("vph", "heads_per_key", "value_heads_per_key_head"),
    ),
    rings=(
        # u = beta (v - alpha S k) depends on the state, so it is kept in FP32.
        RingLayout("rec_u", heads="value", width="value_dim", dtype="f32"),
        RingLayout("rec_k", heads="key", width="key_dim", dtype="act"),
        RingLayout("rec_g", heads="value", width=None, dtype="f32"),
        *SEPARATE_MODE_RINGS,
    ),
    default_flags=("gates_in_kernel", "qk_l2norm"),
    plan_options={
        "use_qk_l2norm": ("qk_l2norm", True),
        "gates_in_kernel": ("gates_in_kernel", True),
        "stochastic_rounding": ("sr", False),
        "read_copy_round_to_nearest": ("read_rn", False),
        "device_seed": ("device_seed", False),
        "flush_mask": ("flush_mask", False),  # (as Mamba-2's)
    },
    launch=LaunchTraits(
        records_warps=(8, 4),
        capped_state_registers=True,
        flush_every_step_kernel=False,
        # The flush-every-step step runs best on the largest tile giving every SM one CTA
        # (docs/tuning.md, tile_targets).
        tile_targets={
            "conventional": (TARGET_CTAS_PER_SM,),
            "split": (TARGET_CTAS_PER_SM,),
            "per-item": (TARGET_CTAS_PER_SM,),
            "flush-every-step": (1,),
            # Separate mode's flush forms the held u's weights in every per-item CTA: one per SM.
            "per-item read copy": (1,),
        },
        # One records CTA serves a key head's value heads: the split pays off at fewer rows.
        verify_split_min_pairs_per_sm=1.5,
    ),
    read_copy=True,
    nvfp4=True,
    verify_scaled_checkpoint=True,
    verify_read_copy="per-item",
    inputs=delta_inputs(("value_heads",), "any", "value_heads"),
    bound_scalars=("scale",),
)
