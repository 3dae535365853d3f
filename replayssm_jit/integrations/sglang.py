"""SGLang-style decode call sites: the same ops as integrations.vllm, with PAD_SLOT_ID = -1 and
the mamba cache indices SGLang keeps per request-pool entry.

SGLang's current calls (read from its code: docs/integrations.md), on SGLangLayer:
    slots = layer.pad_rows(mamba_cache_indices, num_live)      rows >= num_live -> -1
    layer.decode(q, k, v, a, b, A_log=, dt_bias=, ssm_states=, cache_indices=, query_start_loc=)
    layer.packed_decode(mixed_qkv, a, b, A_log=, dt_bias=, scale=, ssm_states=,
                        cache_indices=, num_v_heads=, head_v_dim=)
SGLang pads a CUDA graph's rows with req_pool_indices 0, a real request's entry, so its
mamba_cache_indices name a live slot there: the pad rows are known only by position (rows
past the batch's live count), which pad_rows maps to -1 on the device.

Older simplified entries:
    slots = mamba_slots(req_pool_indices, req_to_mamba_slot, num_live)   -1 for padding
    mamba2_decode_step(plan, pool, x, dt, A, B, C, D=, z=, dt_bias=, cache_indices=slots, ...)
    gdn_decode_step(plan, pool, q, k, v, g, beta, cache_indices=slots, ...)

Plans are made with plan_decode(..., pad_slot_id=-1) (its default).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replayssm_jit.families.layout import CacheLayout
from replayssm_jit.integrations import vllm
from replayssm_jit.integrations.vllm.gdn import gdn_call, gdn_packed_call
from replayssm_jit.integrations.vllm.layer import ReplaySSMLayer
from replayssm_jit.integrations.vllm.mamba2 import mamba2_call
from replayssm_jit.ops.plan import DecodePlan

__all__ = [
    "PAD_SLOT_ID",
    "SGLangLayer",
    "gdn_decode_step",
    "mamba2_decode_step",
    "mamba_slots",
]

PAD_SLOT_ID = -1  # SGLang marks padded decode rows (CUDA-graph batch padding) with -1


def mamba_slots(
    req_pool_indices: torch.Tensor,
    req_to_mamba_slot: torch.Tensor,
    num_live: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """[batch] int32 slot ids: req_to_mamba_slot[req_pool_indices[b]], or PAD_SLOT_ID where the
    request index is negative or the row is at or past num_live (SGLang pads a CUDA graph's
    rows with request index 0, a live request's; give num_live there). No host sync."""
    for name, t in (
        ("req_pool_indices", req_pool_indices),
        ("req_to_mamba_slot", req_to_mamba_slot),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected an int32 or int64 tensor, got {t!r:.60}")
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {list(t.shape)}")
    idx = req_pool_indices.long()
    looked_up = req_to_mamba_slot.long()[idx.clamp(min=0)]
    pad = idx < 0
    if num_live is not None:
        pad = pad | (torch.arange(idx.shape[0], device=idx.device) >= num_live)
    return torch.where(pad, torch.full_like(looked_up, PAD_SLOT_ID), looked_up).to(torch.int32)


def mamba2_decode_step(
    plan: DecodePlan,
    pool: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    *,
    cache_indices: torch.Tensor,
    out: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    check_tied: bool = True,
) -> torch.Tensor:
    """vllm.mamba2_selective_state_update with SGLang's pad id (-1) and cache indices."""
    cache_indices = vllm.slot_ids("cache_indices", cache_indices, plan)  # (errors name ours)
    return vllm.mamba2_selective_state_update(
        plan, pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices=cache_indices,
        null_block_id=PAD_SLOT_ID, out=out, num_accepted_tokens=num_accepted_tokens,
        check_tied=check_tied,
    )  # fmt: skip


def gdn_decode_step(
    plan: DecodePlan,
    pool: Mapping[str, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    *,
    cache_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vllm.gdn_fused_recurrent with SGLang's pad id (-1) and cache indices."""
    cache_indices = vllm.slot_ids("cache_indices", cache_indices, plan)  # (errors name ours)
    return vllm.gdn_fused_recurrent(
        plan, pool, q, k, v, g, beta, scale, ssm_state_indices=cache_indices,
        num_accepted_tokens=num_accepted_tokens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, out=out, pad_id=PAD_SLOT_ID,
    )  # fmt: skip


class SGLangLayer(ReplaySSMLayer):
    """One layer with SGLang's calls (pad id -1): Mamba-2's selective_state_update, GDN's
    kernel-dispatcher decode and packed_decode. pad_rows keeps a
    [max_bs] int32 buffer and a row-number buffer, so that the mapping allocates nothing."""

    def __init__(
        self,
        layout: CacheLayout,
        state: torch.Tensor,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        max_batch: int,
        **plan_options,
    ) -> None:
        super().__init__(layout, state, tensors, pad_slot_id=PAD_SLOT_ID, **plan_options)
        dev = state.device
        self._row = torch.arange(max_batch, dtype=torch.int32, device=dev)
        self._is_pad = torch.zeros(max_batch, dtype=torch.bool, device=dev)
        self._slots = torch.zeros(max_batch, dtype=torch.int32, device=dev)

    def pad_rows(
        self, mamba_cache_indices: torch.Tensor, num_live: int | torch.Tensor
    ) -> torch.Tensor:
        """[bs] int32 slots: mamba_cache_indices where the row is live (row < num_live, an int
        or a device scalar, so a graph replay may change it), PAD_SLOT_ID past it. A pad row
        then never aliases the live slot its request index 0 names."""
        if not isinstance(mamba_cache_indices, torch.Tensor) or mamba_cache_indices.dim() != 1:
            raise ValueError(
                f"mamba_cache_indices: expected a [bs] tensor, got {mamba_cache_indices!r:.60}"
            )
        bs = mamba_cache_indices.shape[0]
        if bs > self._row.shape[0]:
            raise ValueError(
                f"mamba_cache_indices: expected at most max_batch={self._row.shape[0]} rows, "
                f"got {bs}"
            )
        is_pad = torch.ge(self._row[:bs], num_live, out=self._is_pad[:bs])
        slots = self._slots[:bs]
        slots.copy_(mamba_cache_indices)
        return slots.masked_fill_(is_pad, PAD_SLOT_ID)

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
        pad_slot_id: int = PAD_SLOT_ID,
        out: torch.Tensor | None = None,
        disable_state_update: bool = False,
        intermediate_states_buffer: torch.Tensor | None = None,
        cache_steps: int | None = None,
        retrieve_parent_token: torch.Tensor | None = None,
        intermediate_state_indices: torch.Tensor | None = None,
    ) -> None:
        """SGLang's Mamba-2 decode (a Mamba-2 layer's SGLangLayer): x, z, out [bs, H, P], dt
        [bs, H, P] head-expanded, state_batch_indices [bs] or [bs, 1], pads -1. EAGLE's
        tree-verify arguments are refused (not supported yet)."""
        eagle = {"disable_state_update": disable_state_update or None,
                 "intermediate_states_buffer": intermediate_states_buffer,
                 "cache_steps": cache_steps, "retrieve_parent_token": retrieve_parent_token,
                 "intermediate_state_indices": intermediate_state_indices}  # fmt: skip
        _no_extras("selective_state_update", eagle)
        mamba2_call(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                    None, pad_slot_id, out, None, None)  # fmt: skip

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        """The dispatcher's GDN decode: q, k [1, B, H, K], v [1, B, HV, V], a, b [B, HV] raw
        gates, one token per row (query_start_loc 0..B); returns o [1, B, HV, V]."""
        _no_extras("decode", kwargs)
        o, _ = gdn_call(self, A_log, a, b, dt_bias, q, k, v, 1.0, 20.0, None, ssm_states, True,
                        query_start_loc, cache_indices, None, True, False)  # fmt: skip
        return o

    def packed_decode(
        self,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        scale: float,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        num_v_heads: int,
        head_v_dim: int,
        **kwargs,
    ) -> torch.Tensor:
        """The dispatcher's packed GDN decode from conv1d's [B, 2*H*K + HV*V] output; returns
        o [1, B, HV, V] (a view of [B, 1, HV, V], as SGLang's kernel returns it)."""
        _no_extras("packed_decode", kwargs)
        shape = self.layout.shape
        if (num_v_heads, head_v_dim) != (shape.value_heads, shape.value_dim):
            raise ValueError(
                f"num_v_heads, head_v_dim: expected {shape.value_heads}, {shape.value_dim} (the "
                f"layout's), got {num_v_heads}, {head_v_dim}"
            )
        batch = mixed_qkv.shape[0]
        # The output SGLang's own kernel allocates and returns.
        out = torch.empty(batch, 1, num_v_heads, head_v_dim, dtype=mixed_qkv.dtype,
                          device=mixed_qkv.device)  # fmt: skip
        gdn_packed_call(self, mixed_qkv, a, b, A_log, dt_bias, scale, ssm_states, out,
                        cache_indices, True)  # fmt: skip
        return out.transpose(0, 1)


def _no_extras(call: str, kwargs: dict) -> None:
    """Keyword inputs this adapter does not implement (prefix tracking's masks, ...) refuse."""
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise TypeError(f"{call}: expected no further inputs (not supported yet), got {given}")
