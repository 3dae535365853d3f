"""ReplaySSMBackend: vLLM's decode calls with their exact signatures, routed to the layer whose
state tensor the call names. Each method takes the arguments vLLM's own kernel takes, in its
order, and writes what that kernel writes (out; the returned o) while the state stays in the
layer's pool as checkpoint plus records.

    backend = ReplaySSMBackend()
    backend.register(state, mamba2_layout(...), **plan_options)    once per layer
    backend.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, ...)   mamba_ssm order
    backend.ssu(state, x, dt, A, B, C, D, dt_bias, z=..., ...)                ssu_dispatch order
    backend.fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, ...)
    backend.fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, ...)
    backend.fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound, ...)
    backend.fused_recurrent_kda_fla(q, k, v, g, beta, scale=None, initial_state=, ...)

The layer is found by its state's storage address (vLLM runs its Mamba layers inside an opaque
custom op, so this lookup runs eagerly); under torch.compile call the layer's own methods
(ReplaySSMBackend.layer(state) once, outside the compiled region), which look nothing up.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replayssm_jit.families.layout import CacheLayout
from replayssm_jit.integrations.vllm.gdn import gdn_call, gdn_packed_call, kda_call, kda_fla_call
from replayssm_jit.integrations.vllm.layer import ReplaySSMLayer
from replayssm_jit.integrations.vllm.mamba2 import mamba2_call
from replayssm_jit.integrations.vllm.rows import NULL_BLOCK_ID

__all__ = ["NULL_BLOCK_ID", "ReplaySSMBackend", "VLLMLayer"]


class VLLMLayer(ReplaySSMLayer):
    """One layer with vLLM's call signatures (no lookup: the compile-clean form)."""

    def __init__(self, layout, state, tensors=None, *, pad_slot_id=NULL_BLOCK_ID, **options):
        super().__init__(layout, state, tensors, pad_slot_id=pad_slot_id, **options)

    def selective_state_update(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = False,
        state_batch_indices: torch.Tensor | None = None,
        dst_state_batch_indices: torch.Tensor | None = None,
        null_block_id: int = NULL_BLOCK_ID,
        out: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        is_blackwell: bool = False,
        enable_stochastic_rounding: bool = False,
        cache_philox_rounds: int = 0,
        *,
        pad_slot_id: int | None = None,
    ) -> None:
        """mamba_ssm's order (D, z, dt_bias); pad_slot_id is older vLLM's name for
        null_block_id. Stochastic rounding is the plan's (plan_options), not per call: its
        generator is ours, so cache_philox_rounds (vLLM's generator's rounds) and is_blackwell
        (vLLM's kernel choice) select nothing here."""
        if pad_slot_id is not None:
            null_block_id = pad_slot_id
        if bool(enable_stochastic_rounding) != ("sr" in self.flags):
            raise ValueError(
                f"enable_stochastic_rounding: expected {'sr' in self.flags} (as planned: "
                f"stochastic_rounding=...), got {enable_stochastic_rounding}"
            )
        mamba2_call(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                    dst_state_batch_indices, null_block_id, out, num_accepted_tokens,
                    cu_seqlens)  # fmt: skip

    def ssu(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        z: torch.Tensor | None = None,
        dt_softplus: bool = False,
        state_batch_indices: torch.Tensor | None = None,
        dst_state_batch_indices: torch.Tensor | None = None,
        null_block_id: int = NULL_BLOCK_ID,
        out: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        is_blackwell: bool = False,
    ) -> None:
        """ssu_dispatch.selective_state_update's order: D, dt_bias positional, z keyword."""
        mamba2_call(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                    dst_state_batch_indices, null_block_id, out, num_accepted_tokens,
                    cu_seqlens)  # fmt: skip

    def fused_sigmoid_gating_delta_rule_update(
        self,
        A_log: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        dt_bias: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: float = 1.0,
        threshold: float = 20.0,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        inplace_final_state: bool = True,
        cu_seqlens: torch.Tensor | None = None,
        ssm_state_indices: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        use_qk_l2norm_in_kernel: bool = False,
        is_kda: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn_call(self, A_log, a, b, dt_bias, q, k, v, beta, threshold, scale,
                        initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                        num_accepted_tokens, use_qk_l2norm_in_kernel, is_kda)  # fmt: skip

    def fused_recurrent_gated_delta_rule_packed_decode(
        self,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        scale: float,
        initial_state: torch.Tensor,
        out: torch.Tensor,
        ssm_state_indices: torch.Tensor,
        use_qk_l2norm_in_kernel: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn_packed_call(self, mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                               ssm_state_indices, use_qk_l2norm_in_kernel)  # fmt: skip

    def fused_recurrent_kda(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor | None,
        lower_bound: float | None,
        initial_state: torch.Tensor,
        cu_seqlens: torch.Tensor,
        ssm_state_indices: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        fuse_gate: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kda_call(self, q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state,
                        cu_seqlens, ssm_state_indices, num_accepted_tokens, out,
                        fuse_gate)  # fmt: skip

    def fused_recurrent_kda_fla(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor | None = None,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        inplace_final_state: bool = True,
        use_qk_l2norm_in_kernel: bool = True,
        cu_seqlens: torch.Tensor | None = None,
        ssm_state_indices: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's fused_recurrent_kda (the name Kimi-Linear's layer calls): g, beta formed by
        the caller; a layer planned with gates_in_kernel=False."""
        return kda_fla_call(self, q, k, v, g, beta, scale, initial_state, inplace_final_state,
                            use_qk_l2norm_in_kernel, cu_seqlens, ssm_state_indices,
                            num_accepted_tokens)  # fmt: skip


class ReplaySSMBackend:
    """vLLM's calls for every registered layer, found by the state tensor each call names."""

    def __init__(self) -> None:
        self._layers: dict[int, VLLMLayer] = {}

    def register(
        self,
        state: torch.Tensor,
        layout: CacheLayout,
        tensors: Mapping[str, torch.Tensor] | None = None,
        **plan_options,
    ) -> VLLMLayer:
        """Make `state` (vLLM's per-layer SSM state) a ReplaySSM layer of `layout`. Layers whose
        state is one tensor (vLLM's hybrid allocator gives layers of different cache groups one
        tensor, with disjoint blocks) share its rings and cursors, which are kept per slot."""
        key = state.data_ptr() if isinstance(state, torch.Tensor) else None
        known = self._layers.get(key)
        if known is not None:
            options = dict(plan_options)
            pad = options.pop("pad_slot_id", NULL_BLOCK_ID)
            mine = (known.layout, tuple(known.state.shape), known.pad_slot_id, known.plan_options)
            if mine != (layout, tuple(state.shape), pad, options):
                raise ValueError(
                    f"state: expected the layout and options this tensor was registered with "
                    f"{mine}, got {(layout, tuple(state.shape), pad, options)}"
                )
            return known
        layer = VLLMLayer(layout, state, tensors, **plan_options)
        self._layers[key] = layer
        return layer

    def layer(self, state: object) -> VLLMLayer:
        """The layer registered with `state` (by its storage address)."""
        key = state.data_ptr() if isinstance(state, torch.Tensor) else None
        layer = self._layers.get(key)
        if layer is None:
            raise ValueError(
                f"state: expected a state tensor registered with ReplaySSMBackend.register() "
                f"({len(self._layers)} registered), got one at {key if key is None else hex(key)}"
            )
        return layer

    def selective_state_update(self, state, *args, **kwargs) -> None:
        return self.layer(state).selective_state_update(state, *args, **kwargs)

    def ssu(self, state, *args, **kwargs) -> None:
        return self.layer(state).ssu(state, *args, **kwargs)

    def fused_sigmoid_gating_delta_rule_update(self, *args, **kwargs):
        state = _named(args, kwargs, 10, "initial_state")
        return self.layer(state).fused_sigmoid_gating_delta_rule_update(*args, **kwargs)

    def fused_recurrent_gated_delta_rule_packed_decode(self, *args, **kwargs):
        state = _named(args, kwargs, 6, "initial_state")
        return self.layer(state).fused_recurrent_gated_delta_rule_packed_decode(*args, **kwargs)

    def fused_recurrent_kda(self, *args, **kwargs):
        state = _named(args, kwargs, 8, "initial_state")
        return self.layer(state).fused_recurrent_kda(*args, **kwargs)

    def fused_recurrent_kda_fla(self, *args, **kwargs):
        state = _named(args, kwargs, 6, "initial_state")
        return self.layer(state).fused_recurrent_kda_fla(*args, **kwargs)


def _named(args: tuple, kwargs: dict, position: int, name: str) -> object:
    """The argument `name` given at `position` or by keyword."""
    return args[position] if len(args) > position else kwargs.get(name)
