"""Delta-rule families: Gated DeltaNet (scalar decay per head), with KDA's per-channel decay
to join as one more entry. State [HV, V, K] per slot, records (g, u, k)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from replayssm_jit.families.base import DTYPE_BYTES, Family, HeadShape, RingLayout
from replayssm_jit.launch.tiles import TARGET_CTAS_PER_SM


class DeltaFamily(Family):
    def records_shared_bytes(self, spec) -> int:
        """Records::Smem of templates/gdn/split_kernel.cuh for a key head's value heads: held k
        rows, this token's k, q and v, the scalars, and the held u rows where they fit (the
        4-warp variant holds them in shared memory less often, so this bounds it too)."""
        act, cap = DTYPE_BYTES[spec.act_dtype], spec.capacity
        ring = max(cap - 1, 1)
        heads, k, v = spec.dim("vph"), spec.dim("k"), spec.dim("v")
        base = (ring + 2) * k * act + 4 * (4 * heads * cap + 3 * cap + 1 + 3 * heads)
        base += 6 * 16  # 16-byte alignment of the record arrays
        return self.held_rows_where_they_fit(base, heads * ring * v * 4, v * 4)

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
    ),
    default_flags=("gates_in_kernel", "qk_l2norm"),
    plan_options={
        "use_qk_l2norm": ("qk_l2norm", True),
        "gates_in_kernel": ("gates_in_kernel", True),
        "stochastic_rounding": ("sr", False),
        "device_seed": ("device_seed", False),
    },
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
    },
)
