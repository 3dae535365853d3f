"""SGLang-style decode call sites: the same ops as integrations.vllm, with PAD_SLOT_ID = -1 and
the mamba cache indices SGLang keeps per request-pool entry.

    slots = mamba_slots(req_pool_indices, req_to_mamba_slot)   per batch row, -1 for padding
    mamba2_decode_step(plan, pool, x, dt, A, B, C, D=, z=, dt_bias=, cache_indices=slots, ...)
    gdn_decode_step(plan, pool, q, k, v, g, beta, cache_indices=slots, ...)

Plans are made with plan_decode(..., pad_slot_id=-1) (its default).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replayssm_jit.integrations import vllm
from replayssm_jit.ops.plan import DecodePlan

__all__ = ["PAD_SLOT_ID", "gdn_decode_step", "mamba2_decode_step", "mamba_slots"]

PAD_SLOT_ID = -1  # SGLang marks padded decode rows (CUDA-graph batch padding) with -1


def mamba_slots(req_pool_indices: torch.Tensor, req_to_mamba_slot: torch.Tensor) -> torch.Tensor:
    """[batch] int32 slot ids: req_to_mamba_slot[req_pool_indices[b]], or PAD_SLOT_ID where the
    request index is negative (a padded row). One gather, no host sync."""
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
    return torch.where(idx < 0, torch.full_like(looked_up, PAD_SLOT_ID), looked_up).to(torch.int32)


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
