"""vLLM's GDN and KDA decode calls on a ReplaySSM layer (shapes read from vLLM's fla ops; see
docs/integrations.md for the commits):

    fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta=1.0,
        threshold=20.0, scale=None, initial_state=, inplace_final_state=True, cu_seqlens=,
        ssm_state_indices=, num_accepted_tokens=, use_qk_l2norm_in_kernel=, is_kda=False)
        -> (o, initial_state)      q, k [1, N*T, H, K] (or [N, T, H, K]); v [.., HV, V];
                                    a, b [N*T, HV] raw gates; o like v
    fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale,
        initial_state, out, ssm_state_indices, use_qk_l2norm_in_kernel=False) -> (out, state)
                                    mixed_qkv [N, 2*H*K + HV*V]; out [N, 1, HV, V] (N*HV*V)
    fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state,
        cu_seqlens, ssm_state_indices, num_accepted_tokens=None, out=None, fuse_gate=None)
        -> (out, initial_state)    raw g [1, N*T, HV, K], raw beta [1, N*T, HV], dt_bias [HV*K]
    fused_recurrent_kda(q, k, v, g, beta=None, scale=None, initial_state=None,
        inplace_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None,
        ssm_state_indices=None, num_accepted_tokens=None)    fla's form (Kimi-Linear's layer):
                                    g [1, N*T, HV, K] log-decay, beta [1, N*T, HV] in (0, 1)

The gates are raw (the plan has gates_in_kernel=True) except in fla's KDA form
(gates_in_kernel=False); bf16 gates are copied into the plan's
FP32 buffers, nothing else is converted. The returned o is allocated as the engine's kernel
allocates it, only where the call takes no out.
"""

from __future__ import annotations

import math

import torch

from replayssm_jit.integrations.vllm.layer import ReplaySSMLayer
from replayssm_jit.integrations.vllm.mamba2 import (
    _check_uniform,
    _check_varlen,
    step_flush_mask,
    tokens_per_row,
)

__all__ = ["gdn_call", "gdn_packed_call", "kda_call", "kda_fla_call"]


def _check_plan_scalars(
    layer: ReplaySSMLayer, rows, scale, use_qk_l2norm, lower_bound=None, raw_gates=True
):
    flags = rows.plan.spec.flags
    if ("gates_in_kernel" in flags) != raw_gates:
        what = "raw gates a, b" if raw_gates else "g and beta formed by the caller"
        raise ValueError(
            f"plan: expected gates_in_kernel={raw_gates} (this call passes {what}), got "
            f"{not raw_gates}"
        )
    if bool(use_qk_l2norm) != ("qk_l2norm" in flags):
        raise ValueError(
            f"use_qk_l2norm_in_kernel: expected {'qk_l2norm' in flags} (as planned), got "
            f"{use_qk_l2norm}"
        )
    planned = rows.plan.family_options["scale"]
    if scale is not None and not math.isclose(float(scale), planned, rel_tol=1e-6):
        raise ValueError(f"scale: expected {planned} (as planned), got {scale}")
    bound = rows.plan.family_options.get("lower_bound")
    if "lower_bound" in rows.plan.family_options and lower_bound != bound:
        raise ValueError(f"lower_bound: expected {bound} (as planned), got {lower_bound}")


def _lead_view(name: str, t: object, lead: tuple[int, ...], inner: int) -> torch.Tensor:
    """t viewed as [*lead, *inner dims]: engines pack tokens as [1, N*T, ...] or [N*T, ...]."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    inner_shape = tuple(t.shape[t.dim() - inner :])
    if t.numel() != math.prod(lead) * math.prod(inner_shape):
        raise ValueError(
            f"{name}: expected {list(lead)} tokens of {list(inner_shape)}, got {list(t.shape)}"
        )
    return t.view(*lead, *inner_shape)


def _delta(layer, rows, T, lead, q, k, v, a, b, A_log, dt_bias, slots, accepted, o,
           parents=None, cu_seqlens=None, flush_mask=None) -> None:  # fmt: skip
    """One launch; with cu_seqlens (varlen rows of 0..T tokens, `lead` the packed tokens) the
    inputs are gathered into the plan's [batch, T, ...] buffers and o scattered back.
    flush_mask: a step's rows that flush now (SGLang's prefix tracking)."""
    gates = rows.step_gates if T == 1 else rows.draft_gates
    extra = {} if parents is None else {"parents": parents}
    extra.update(step_flush_mask(flush_mask, T))
    views = {n: _lead_view(n, t, lead, 2) for n, t in (("q", q), ("k", k), ("v", v))}
    inner = gates[0].dim() - (1 if T == 1 else 2)  # a's per-token dims: [HV] or KDA's [HV, K]
    a, b = _lead_view("a", a, lead, inner), _lead_view("b", b, lead, 1)
    if cu_seqlens is None:
        a32, b32 = gates[0].copy_(a), gates[1].copy_(b)
        qkv, out = views, o.view(*lead, *o.shape[-2:])
    else:
        tokens, packed = lead[0], rows.packed_rows()
        packed.lay_out(cu_seqlens, tokens)
        a32 = packed.gather_gate("a", a, tokens, gates[0])
        b32 = packed.gather_gate("b", b, tokens, gates[1])
        qkv = {n: packed.gather_in(n, t) for n, t in views.items()}
        out, extra["num_drafts"] = packed.padded["out"], packed.num_drafts
    if A_log is None:  # fla's form: g and beta formed by the caller, no parameters
        gate_args = {"g": a32, "beta": b32}
    else:
        gate_args = {"a": a32, "b": b32, "A_log": A_log.to(torch.float32),
                     "dt_bias": dt_bias.to(torch.float32)}  # fmt: skip
    layer.launch(rows, "decode" if T == 1 else "verify", **qkv, **gate_args, slot_indices=slots,
                 num_accepted=accepted, out=out, **extra)  # fmt: skip
    if cu_seqlens is not None:
        packed.scatter_out(o.view(lead[0], *o.shape[-2:]), lead[0])


def _rows_of(layer, q, cu_seqlens, ssm_state_indices):
    """(rows, T, lead, varlen cu_seqlens or None) of a call whose q is [1, N*T, H, K] with
    cu_seqlens or [N, T, H, K]; fewer than N*T tokens are varlen rows of 0..T tokens."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, K], got {getattr(q, 'shape', q)}")
    if cu_seqlens is None:
        batch, T = q.shape[0], q.shape[1]
        if T not in (1, layer.layout.drafts):
            raise ValueError(f"q: expected T = 1 or {layer.layout.drafts} tokens, got {T}")
    else:
        if q.shape[0] != 1:
            raise ValueError(f"q: expected [1, tokens, H, K] with cu_seqlens, got {list(q.shape)}")
        batch, T, varlen = tokens_per_row("q", q.shape[1], cu_seqlens, layer, varlen=True)
        if varlen:
            rows = layer.rows(batch)
            _check_varlen(cu_seqlens, q.shape[1], T, rows)
            return rows, T, (q.shape[1],), cu_seqlens
    rows = layer.rows(batch)
    _check_uniform(cu_seqlens, batch, T, layer, rows)
    return rows, T, (batch,) if T == 1 else (batch, T), None


def gdn_call(
    layer: ReplaySSMLayer,
    A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state, inplace_final_state,
    cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel, is_kda,
    *, parents=None, flush_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fused_sigmoid_gating_delta_rule_update on the layer: a step (T = 1) or an MTP verify
    (with `parents`, the [batch, T] draft tree of SGLang's tree verify); `flush_mask`: a step's
    rows that flush now (SGLang's prefix tracking)."""
    layer.check_state(initial_state)
    if is_kda:
        raise ValueError(
            "is_kda: expected False (KDA decodes through fused_recurrent_kda), got True"
        )
    if not inplace_final_state:
        raise ValueError(
            "inplace_final_state: expected True (the state stays in the pool as checkpoint "
            "plus records; no separate final state is formed), got False"
        )
    if (float(beta), float(threshold)) != (1.0, 20.0):
        raise ValueError(
            f"beta, threshold: expected softplus(beta=1.0, threshold=20.0) as the kernels form "
            f"it, got beta={beta}, threshold={threshold}"
        )
    rows, T, lead, varlen = _rows_of(layer, q, cu_seqlens, ssm_state_indices)
    _check_plan_scalars(layer, rows, scale, use_qk_l2norm_in_kernel)
    slots = rows.slot_ids("ssm_state_indices", ssm_state_indices)
    accepted = rows.accepted_from_engine(num_accepted_tokens, layer.pool["cursors"], slots)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # as the engine's kernel returns it
    _delta(layer, rows, T, lead, q, k, v, a, b, A_log, dt_bias, slots, accepted, o, parents,
           varlen, flush_mask)  # fmt: skip
    return o, initial_state


def gdn_packed_call(
    layer: ReplaySSMLayer,
    mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
    use_qk_l2norm_in_kernel, *, flush_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The packed one-token decode: q, k, v are views into mixed_qkv (no copy); `flush_mask`
    as gdn_call's."""
    layer.check_state(initial_state)
    shape = layer.layout.shape
    H, HV, K, V = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
    width = 2 * H * K + HV * V
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2:
        raise ValueError(
            f"mixed_qkv: expected [N, {width}], got {getattr(mixed_qkv, 'shape', None)}"
        )
    if mixed_qkv.shape[1] < width or mixed_qkv.stride(1) != 1:
        raise ValueError(
            f"mixed_qkv: expected [N, >= {width}] (q, k, v channels) with unit stride in the "
            f"last dim, got {list(mixed_qkv.shape)} with strides {mixed_qkv.stride()}"
        )
    batch = mixed_qkv.shape[0]
    rows = layer.rows(batch)
    _check_plan_scalars(layer, rows, scale, use_qk_l2norm_in_kernel)
    if not isinstance(out, torch.Tensor) or out.numel() != batch * HV * V:
        raise ValueError(
            f"out: expected {batch * HV * V} elements ([N, 1, HV, V]), got "
            f"{getattr(out, 'shape', out)}"
        )
    q = mixed_qkv[:, : H * K].unflatten(1, (H, K))
    k = mixed_qkv[:, H * K : 2 * H * K].unflatten(1, (H, K))
    v = mixed_qkv[:, 2 * H * K : width].unflatten(1, (HV, V))
    slots = rows.slot_ids("ssm_state_indices", ssm_state_indices)
    _delta(layer, rows, 1, (batch,), q, k, v, a, b, A_log, dt_bias, slots, None, out,
           flush_mask=flush_mask)  # fmt: skip
    return out, initial_state


def kda_call(
    layer: ReplaySSMLayer,
    q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
    ssm_state_indices, num_accepted_tokens, out, fuse_gate,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fused_recurrent_kda on the layer: raw gates formed in the kernel either way (fuse_gate
    only chose where vLLM formed them), l2norm in the kernel, scale K^-1/2."""
    layer.check_state(initial_state)
    if dt_bias is None:
        raise ValueError("dt_bias: expected the layer's [HV * K] bias, got None")
    rows, T, lead, varlen = _rows_of(layer, q, cu_seqlens, ssm_state_indices)
    _check_plan_scalars(layer, rows, None, True, lower_bound)
    slots = rows.slot_ids("ssm_state_indices", ssm_state_indices)
    accepted = rows.accepted_from_engine(num_accepted_tokens, layer.pool["cursors"], slots)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # as the engine's kernel does
    _delta(layer, rows, T, lead, q, k, v, g, beta, A_log, dt_bias, slots, accepted, out,
           cu_seqlens=varlen)  # fmt: skip
    return out, initial_state


def kda_fla_call(
    layer: ReplaySSMLayer,
    q, k, v, g, beta, scale, initial_state, inplace_final_state, use_qk_l2norm_in_kernel,
    cu_seqlens, ssm_state_indices, num_accepted_tokens,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fla's fused_recurrent_kda on the layer (Kimi-Linear's decode and MTP calls): g and beta
    formed by vLLM (fused_kda_gate, sigmoid), so the plan has gates_in_kernel=False."""
    layer.check_state(initial_state)
    if not inplace_final_state:
        raise ValueError(
            "inplace_final_state: expected True (the state stays in the pool as checkpoint "
            "plus records; no separate final state is formed), got False"
        )
    if beta is None:
        raise ValueError("beta: expected the [1, tokens, HV] write strengths, got None")
    rows, T, lead, varlen = _rows_of(layer, q, cu_seqlens, ssm_state_indices)
    _check_plan_scalars(layer, rows, scale, use_qk_l2norm_in_kernel, raw_gates=False)
    slots = rows.slot_ids("ssm_state_indices", ssm_state_indices)
    accepted = rows.accepted_from_engine(num_accepted_tokens, layer.pool["cursors"], slots)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # as the engine's kernel returns it
    _delta(layer, rows, T, lead, q, k, v, g, beta, None, None, slots, accepted, o,
           cu_seqlens=varlen)  # fmt: skip
    return o, initial_state
