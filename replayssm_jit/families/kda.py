"""Kimi Delta Attention (KDA): Gated DeltaNet with a log-decay per key channel. It shares GDN's
inputs, shared-memory bound and scale option (families/gdn.py, parameterised by
decay_per_channel) and GDN's kernels (templates/kda/decode.cu.jinja renders templates/gdn with
the per-channel parameter set). State [HV, V, K] per slot, records (g, u, k) with K channels of g;
separate mode (a read copy) on the torch path only."""

from __future__ import annotations

import math
from collections.abc import Mapping

from replayssm_jit.families.base import HeadShape, LaunchTraits, RingLayout
from replayssm_jit.families.gdn import GDN, SEPARATE_MODE_RINGS, DeltaFamily, delta_inputs


class KimiDeltaFamily(DeltaFamily):
    def plan_scalars(self, options: Mapping[str, object], shape: HeadShape) -> dict:
        """scale as GDN's, and lower_bound: None for fla's gate g = -exp(A_log) softplus(a +
        dt_bias), or a finite negative float for the "safe" gate g = lower_bound sigmoid(
        exp(A_log) (a + dt_bias)) (Kimi-K3 uses -5); it forms gates, so it needs
        gates_in_kernel."""
        scalars = super().plan_scalars(options, shape)
        bound = options.get("lower_bound")
        if bound is not None:
            if not isinstance(bound, (int, float)) or isinstance(bound, bool):
                raise TypeError(
                    f"lower_bound: expected None or a float, got {type(bound).__name__} {bound!r}"
                )
            if not (math.isfinite(bound) and bound < 0):
                raise ValueError(f"lower_bound: expected a finite negative float, got {bound!r}")
            if not options.get("gates_in_kernel", True):
                raise ValueError(
                    "lower_bound: expected None with gates_in_kernel=False (the caller forms "
                    f"g), got {bound!r}"
                )
            bound = float(bound)
        return {**scalars, "lower_bound": bound}


KDA = KimiDeltaFamily(
    name="kda",
    template="kda/decode.cu.jinja",
    shape_args=GDN.shape_args,
    spec_dims=GDN.spec_dims,
    rings=(
        RingLayout("rec_u", heads="value", width="value_dim", dtype="f32"),
        RingLayout("rec_k", heads="key", width="key_dim", dtype="act"),
        # A log-decay per key channel: K floats per record where GDN keeps one.
        RingLayout("rec_g", heads="value", width="key_dim", dtype="f32"),
        *SEPARATE_MODE_RINGS,
    ),
    default_flags=GDN.default_flags,
    plan_options=GDN.plan_options,
    # GDN's kernels and tiles; the split verify (verify_split_min_pairs_per_sm) is not compiled.
    launch=LaunchTraits(
        records_warps=GDN.launch.records_warps,
        capped_state_registers=True,
        flush_every_step_kernel=False,
        tile_targets=GDN.launch.tile_targets,
    ),
    decay_per_channel=True,
    nvfp4=True,
    verify_scaled_checkpoint=True,
    # A log-decay per key channel: a and g [.., HV, K], dt_bias [HV * K]; lower_bound 0 for none.
    inputs=delta_inputs(("value_heads", "key_dim"), "inner", "value_heads*key_dim"),
    bound_scalars=("scale", "lower_bound"),
)
