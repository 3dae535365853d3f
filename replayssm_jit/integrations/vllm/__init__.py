"""vLLM-style decode call sites mapped onto the functional ops (no kernels of their own).

vLLM's current calls with their exact signatures: ReplaySSMBackend / VLLMLayer (backend.py);
the out-of-tree plugin: plugin.py. The older simplified entries below stay for existing callers:

    mamba2_selective_state_update(plan, pool, x, dt, A, B, C, D=, z=, dt_bias=,
        dt_softplus=, state_batch_indices=, null_block_id=0, out=, num_accepted_tokens=)
    gdn_fused_recurrent(plan, pool, q, k, v, g, beta, scale=, ssm_state_indices=,
        num_accepted_tokens=, use_qk_l2norm_in_kernel=, cu_seqlens=)
    per_head_params(A, D, dt_bias)         head-expanded Mamba-2 parameters to our [H] form
    slot_tensor_specs(layout)              (name, per-slot shape, dtype) for a cache manager
    page_entries / page_tensors            our tensors in a layer's MambaSpec and vLLM's page views
    fla_state_view / copy_state_from_fla   our GDN state [HV, V, K] against fla/HF [HV, K, V]

`pool` is the layer's slot tensors by name (layout.tensors(): state, the rings, cursors), which
the engine allocates in place of its own SSM state tensor. The plan comes from plan_decode once
per batch shape, with pad_slot_id=0 (vLLM's null block). docs/integrations-direct-calls.md shows
the engine-side lines.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replayssm_jit.families.layout import CacheLayout, family_layout
from replayssm_jit.integrations.vllm.backend import ReplaySSMBackend, VLLMLayer
from replayssm_jit.integrations.vllm.pages import PageEntries, page_entries, page_tensors
from replayssm_jit.integrations.vllm.rows import NULL_BLOCK_ID, narrow_to_int32
from replayssm_jit.ops import gdn_decode, gdn_verify, mamba2_decode, mamba2_verify
from replayssm_jit.ops.decode import reads_device_values
from replayssm_jit.ops.plan import DecodePlan

__all__ = [
    "NULL_BLOCK_ID",
    "PageEntries",
    "ReplaySSMBackend",
    "VLLMLayer",
    "copy_state_from_fla",
    "fla_state_view",
    "gdn_fused_recurrent",
    "mamba2_selective_state_update",
    "page_entries",
    "page_tensors",
    "per_head_params",
    "slot_tensor_specs",
]


# ---------------------------------------------------------------------------------------------
# Shared checks
# ---------------------------------------------------------------------------------------------


def check_pad_id(plan: DecodePlan, pad_id: int, name: str) -> None:
    """The engine's pad id must be the one the plan's kernels compare slot ids with."""
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    if plan.pad_slot_id != pad_id:
        raise ValueError(
            f"{name}: expected the plan's pad_slot_id={plan.pad_slot_id} (plan_decode(..., "
            f"pad_slot_id={pad_id})), got {pad_id}"
        )


def slot_ids(name: str, indices: object, plan: DecodePlan) -> torch.Tensor:
    """[batch] int32 contiguous slot ids from [batch] or [batch, 1 + T] indices (column 0: our
    scheme keeps one slot per request; the other columns are the engine's per-draft states)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {indices.dtype}")
    if indices.dim() == 2:
        indices = indices[:, 0]
    if indices.dim() != 1 or indices.shape[0] != plan.batch_size:
        raise ValueError(
            f"{name}: expected shape [{plan.batch_size}] or [{plan.batch_size}, *] "
            f"(plan.batch_size), got {list(indices.shape)}"
        )
    # A [batch] int32 copy only where the engine's dtype or column stride differs.
    return _narrow(name, indices, plan, "slot ids")


def _narrow(name: str, t: torch.Tensor, plan: DecodePlan, what: str) -> torch.Tensor:
    """`t` as int32 contiguous, through rows.narrow_to_int32 (int64 values outside int32 raise
    where values are read, and saturate otherwise rather than wrap)."""
    if t.dtype == torch.int32:
        return t.contiguous()
    dst = torch.empty(t.shape, dtype=torch.int32, device=t.device)
    wide = torch.empty(t.shape, dtype=torch.int64, device=t.device)
    return narrow_to_int32(name, t, dst, wide, reads_device_values(plan), what)


def accepted_counts(num_accepted_tokens: object, plan: DecodePlan) -> torch.Tensor | None:
    """[batch] int32 contiguous, or None."""
    if num_accepted_tokens is None:
        return None
    if not isinstance(num_accepted_tokens, torch.Tensor):
        raise TypeError(
            f"num_accepted_tokens: expected a torch.Tensor, got {type(num_accepted_tokens).__name__}"
        )
    if num_accepted_tokens.shape != (plan.batch_size,):
        raise ValueError(
            f"num_accepted_tokens: expected shape [{plan.batch_size}] (plan.batch_size), got "
            f"{list(num_accepted_tokens.shape)}"
        )
    if num_accepted_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"num_accepted_tokens: expected dtype int32 or int64 (accepted token counts), got "
            f"{num_accepted_tokens.dtype}"
        )
    return _narrow("num_accepted_tokens", num_accepted_tokens, plan, "counts")


def _check_pool(pool: object) -> Mapping[str, torch.Tensor]:
    if not isinstance(pool, Mapping):
        raise TypeError(
            f"pool: expected the layer's slot tensors by name, got {type(pool).__name__}"
        )
    return pool


def _tied(name: str, t: torch.Tensor, dims: tuple[int, ...], check_values: bool) -> None:
    """Each of `dims` is broadcast (stride 0 or size 1) or, with check_values, all-equal."""
    loose = [d for d in dims if t.stride(d) != 0 and t.shape[d] > 1]
    if not loose:
        return
    if not check_values:
        raise ValueError(
            f"{name}: expected stride 0 along dims {list(dims)} (head-expanded, one value per "
            f"head), got strides {t.stride()} (pass check_tied=True to accept all-equal values)"
        )
    first = t
    for d in dims:
        first = first.narrow(d, 0, 1)
    # (reads the tensor: a host sync, which is why stride-0 views skip it)
    if not bool((t == first).all()):
        raise ValueError(
            f"{name}: expected one value per head, tied along dims {list(dims)} (ReplaySSM "
            f"kernels take per-head parameters), got differing values along them"
        )


def _per_head(
    name: str, t: torch.Tensor | None, H: int, check_values: bool, lead: tuple[int, ...] = ()
) -> torch.Tensor | None:
    """[*lead, H] float32 from [*lead, H] or a head-expanded [*lead, H, P(, N)] tied tensor."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    k = len(lead)
    if t.dim() < k + 1 or tuple(t.shape[: k + 1]) != (*lead, H) or t.dim() > k + 3:
        want = ", ".join(str(d) for d in (*lead, H))
        raise ValueError(
            f"{name}: expected shape [{want}] or [{want}, P] / [{want}, P, N] (head-expanded), "
            f"got {list(t.shape)}"
        )
    extra = tuple(range(k + 1, t.dim()))
    _tied(name, t, extra, check_values)
    for _ in extra:
        t = t.select(-1, 0)  # a view of one element per head
    # Only the per-head values are converted or gathered, never the expanded tensor.
    return t.to(torch.float32)


def per_head_params(
    A: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    *,
    check_tied: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(A, D, dt_bias) as [H] float32 contiguous from the forms mamba_ssm / transformers pass:
    A [H] or [H, P, N], D and dt_bias [H] or [H, P]. Expanded dims must have stride 0, or, with
    check_tied, hold one value per head (checked on the host: call this once at load time)."""
    heads = A.shape[0] if isinstance(A, torch.Tensor) and A.dim() else 0  # (0: refused below)
    A = _per_head("A", A, heads, check_tied)
    H = A.shape[0]
    D = _per_head("D", D, H, check_tied)
    dt_bias = _per_head("dt_bias", dt_bias, H, check_tied)
    return tuple(None if t is None else t.contiguous() for t in (A, D, dt_bias))


# ---------------------------------------------------------------------------------------------
# Mamba-2: selective_state_update
# ---------------------------------------------------------------------------------------------


def mamba2_selective_state_update(
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
    state_batch_indices: torch.Tensor,
    null_block_id: int = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    check_tied: bool = True,
) -> torch.Tensor:
    """A `selective_state_update`-style Mamba-2 decode on the layer's ReplaySSM pool.

    Standard step: x, z [batch, H, P]; B, C [batch, G, N]; dt [batch, H] or [batch, H, P]
    (head-expanded). Spec decode: the same with a draft dim, x [batch, T, H, P], dt [batch, T, H
    (, P)], B, C [batch, T, G, N], for a layout with drafts=T; num_accepted_tokens [batch] (the
    previous verify's accepted count, bonus token included) is committed first, fused.
    A [H] or [H, P, N], D and dt_bias [H] or [H, P]: tied per head. dt may be in the activation
    dtype. state_batch_indices [batch] or [batch, *] (column 0), rows equal to null_block_id are
    padding: zero output, nothing written. Returns out (written in place where given).
    """
    check_pad_id(plan, null_block_id, "null_block_id")
    pool = _check_pool(pool)
    if bool(dt_softplus) != ("dt_softplus" in plan.spec.flags):
        raise ValueError(
            f"dt_softplus: expected {'dt_softplus' in plan.spec.flags} (as planned: "
            f"plan_decode(..., dt_softplus=...)), got {dt_softplus}"
        )
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    H = plan.layout.shape.value_heads
    spec = x.dim() == 4
    lead = tuple(x.shape[: 2 if spec else 1])
    A, D, dt_bias = per_head_params(A, D, dt_bias, check_tied=check_tied)
    dt = _per_head("dt", dt, H, check_tied, lead)
    slots = slot_ids("state_batch_indices", state_batch_indices, plan)
    accepted = accepted_counts(num_accepted_tokens, plan)
    args = dict(**pool, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, out=out,
                slot_indices=slots)  # fmt: skip
    if spec:
        return mamba2_verify(plan, **args, num_accepted=accepted)
    # A standard step after a verify commits its accepted drafts first (fused).
    return mamba2_decode(plan, **args, num_accepted=accepted)


# ---------------------------------------------------------------------------------------------
# GDN: fused_recurrent_gated_delta_rule
# ---------------------------------------------------------------------------------------------


def _check_uniform(cu_seqlens: object, batch: int, T: int, plan: DecodePlan) -> None:
    """cu_seqlens must be [batch + 1] and, where values are read, 0, T, 2T, ... (uniform rows)."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.shape != (batch + 1,):
        got = list(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
        raise ValueError(f"cu_seqlens: expected shape [{batch + 1}], got {got}")
    if reads_device_values(plan) and cu_seqlens.tolist() != [T * i for i in range(batch + 1)]:
        raise ValueError(
            f"cu_seqlens: expected {T} tokens per row (0, {T}, {2 * T}, ...): the ops take a "
            f"fixed draft count, got {cu_seqlens.tolist()}"
        )


def gdn_fused_recurrent(
    plan: DecodePlan,
    pool: Mapping[str, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    *,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pad_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """A `fused_recurrent_gated_delta_rule`-style GDN decode on the layer's ReplaySSM pool.

    The plan must be made with gates_in_kernel=False (g, beta given) and the same
    use_qk_l2norm and scale. q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV] with either
    B = batch (one row per sequence) or B = 1 with cu_seqlens [batch + 1] of uniform T. T = 1 is
    a standard step; T = layout.drafts a verify, with num_accepted_tokens fused in.
    ssm_state_indices [batch] or [batch, 1 + T]: column 0 names the slot; pad_id rows write
    nothing. Returns o [B, T, HV, V] (a view of `out` [batch, T, HV, V] / [batch, HV, V] where
    given). The final state is not returned: it stays in the pool as checkpoint plus records.
    """
    check_pad_id(plan, pad_id, "pad_id")
    pool = _check_pool(pool)
    if "gates_in_kernel" in plan.spec.flags:
        raise ValueError(
            "plan: expected a plan with gates_in_kernel=False (this call site passes g and "
            "beta), got gates_in_kernel=True"
        )
    if bool(use_qk_l2norm_in_kernel) != ("qk_l2norm" in plan.spec.flags):
        raise ValueError(
            f"use_qk_l2norm_in_kernel: expected {'qk_l2norm' in plan.spec.flags} (as planned: "
            f"plan_decode(..., use_qk_l2norm=...)), got {use_qk_l2norm_in_kernel}"
        )
    planned = plan.family_options["scale"]
    if scale is not None and abs(float(scale) - planned) > 1e-6 * abs(planned):
        raise ValueError(
            f"scale: expected {planned} (as planned: plan_decode(..., scale=...)), got {scale}"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected shape [B, T, H, K], got {list(q.shape)}")
    batch = plan.batch_size
    lead = tuple(q.shape[:2])
    if lead[0] == batch and cu_seqlens is None:
        T = lead[1]
    elif lead[0] == 1 and lead[1] % batch == 0:
        T = lead[1] // batch
        _check_uniform(cu_seqlens, batch, T, plan)
    else:
        raise ValueError(
            f"q: expected [{batch}, T, H, K] or [1, {batch} * T, H, K] with cu_seqlens "
            f"(plan.batch_size={batch}), got {list(q.shape)}"
        )
    # [1, batch * T, ...] and [batch, T, ...] name the same elements: these are views.
    q, k, v = (t.reshape(batch, T, *t.shape[2:]) for t in (q, k, v))
    g, beta = (t.reshape(batch, T, *t.shape[2:]).to(torch.float32) for t in (g, beta))
    slots = slot_ids("ssm_state_indices", ssm_state_indices, plan)
    accepted = accepted_counts(num_accepted_tokens, plan)
    if T == 1:
        step_out = None if out is None else out.view(batch, *out.shape[-2:])

        # A standard step after a verify commits its accepted drafts first (fused).
        o = gdn_decode(plan, **pool, q=q[:, 0], k=k[:, 0], v=v[:, 0], g=g[:, 0],
                       beta=beta[:, 0], slot_indices=slots, out=step_out,
                       num_accepted=accepted)  # fmt: skip
    else:
        if plan.layout.drafts != T:
            raise ValueError(
                f"q: expected T = 1 or T = {plan.layout.drafts} (the layout's drafts) tokens per "
                f"row, got T = {T}"
            )
        o = gdn_verify(plan, **pool, q=q, k=k, v=v, g=g, beta=beta, slot_indices=slots,
                       out=out, num_accepted=accepted)  # fmt: skip
    return o.view(*lead, *o.shape[-2:])


# ---------------------------------------------------------------------------------------------
# State layout and shapes
# ---------------------------------------------------------------------------------------------


def fla_state_view(state: torch.Tensor) -> torch.Tensor:
    """Our GDN state [..., HV, V, K] (K contiguous) seen as fla/HF's [..., HV, K, V].

    A transpose view: free, no bytes move, but its last dim has stride K, so code that needs
    fla's contiguous layout pays .contiguous(), one read and one write of the whole state. A
    checkpoint alone is not a sequence's state while records are held: read states only from
    slots whose cursor holds no records (after reset_slots, or a flush)."""
    return state.transpose(-1, -2)


def copy_state_from_fla(state: torch.Tensor, fla_state: torch.Tensor) -> torch.Tensor:
    """Write fla/HF-layout states [..., HV, K, V] into our [..., HV, V, K] tensor, in place.

    One strided read and one write of the data (our slots must be contiguous, so no view can
    serve); use it with reset_slots(initial_state=...) semantics, i.e. with zeroed cursors."""
    if fla_state.shape != fla_state_view(state).shape:
        raise ValueError(
            f"fla_state: expected shape {list(fla_state_view(state).shape)} (ours with V and K "
            f"swapped), got {list(fla_state.shape)}"
        )
    return state.copy_(fla_state.transpose(-1, -2))


def slot_tensor_specs(
    layout: CacheLayout | str, **layer_config
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, per-slot shape, dtype) of each tensor a layer's cache needs, from its layout or
    from the family name and the layer's config (mamba2_layout / gdn_layout arguments). A
    cache manager allocates [num_slots, *shape] of each, with contiguous slots (layout.tensors()
    gives the alignment and packing rules)."""
    if not isinstance(layout, CacheLayout):
        layout = family_layout(layout, **layer_config)
    elif layer_config:
        raise TypeError(
            f"layer_config: expected none with a CacheLayout, got {sorted(layer_config)}"
        )
    return [(t.name, t.per_slot_shape, t.dtype) for t in layout.tensors()]
