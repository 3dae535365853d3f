"""vLLM's Mamba-2 decode call on a ReplaySSM layer: the body behind both argument orders,
mamba_ssm's `selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, ...)` and the SSU
dispatcher's `(state, x, dt, A, B, C, D, dt_bias, z=...)` (read from vLLM: see
docs/integrations.md for the commits).

A standard step: x, z, out [batch, H, P]; dt [batch, H, P] (head-expanded) or [batch, H];
B, C [batch, G, N]; A [H, P, N] / [H]; D, dt_bias [H, P] / [H]; state_batch_indices [batch] or
[batch, 1 + T]. MTP verify: the same packed over tokens, [batch * T, ...], with cu_seqlens
[batch + 1] (T tokens per row, T the layout's drafts) and num_accepted_tokens [batch].
"""

from __future__ import annotations

from itertools import pairwise

import torch

from replayssm_jit.integrations.vllm.layer import ReplaySSMLayer
from replayssm_jit.integrations.vllm.rows import reads_device_values

__all__ = ["mamba2_call", "tokens_per_row"]


def tokens_per_row(
    name: str, tokens: int, cu_seqlens: object, layer: ReplaySSMLayer, varlen: bool = False
) -> tuple[int, int, bool]:
    """(batch, T, varlen) of a packed call: T = 1 without cu_seqlens, else tokens / (len - 1),
    which must be 1 or the layout's drafts (uniform rows; values checked where they are read).
    With `varlen`, fewer tokens than batch * drafts are rows of 1..drafts tokens each."""
    if cu_seqlens is None:
        return tokens, 1, False
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError(f"cu_seqlens: expected a [batch + 1] tensor, got {cu_seqlens!r:.80}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    batch, drafts = cu_seqlens.shape[0] - 1, layer.layout.drafts
    if varlen and drafts > 1 and batch < tokens < batch * drafts:
        return batch, drafts, True
    T = tokens // batch
    if T * batch != tokens or T not in (1, drafts):
        raise ValueError(
            f"{name}: expected batch * T tokens with T = 1 or {drafts} (the layout's drafts) "
            f"for {batch} rows, got {tokens} tokens"
        )
    return batch, T, False


def _check_uniform(cu_seqlens: torch.Tensor | None, batch: int, T: int, layer, rows) -> None:
    if cu_seqlens is not None and reads_device_values(rows.plan):
        want = [T * i for i in range(batch + 1)]
        if cu_seqlens.tolist() != want:
            raise ValueError(
                f"cu_seqlens: expected {T} tokens per row {want} (varlen rows with fewer drafts "
                f"are not supported yet), got {cu_seqlens.tolist()}"
            )


def _per_head(name: str, t: torch.Tensor | None, lead: int) -> torch.Tensor | None:
    """A view of one value per head from [*lead, H] or the head-expanded [*lead, H, P(, N)]
    form (stride 0 in the expanded dims, as vLLM builds it with expand())."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for d in range(lead + 1, t.dim()):
        if t.stride(d) != 0 and t.shape[d] > 1:
            raise ValueError(
                f"{name}: expected stride 0 along dim {d} (head-expanded, one value per head), "
                f"got strides {t.stride()}"
            )
    while t.dim() > lead + 1:
        t = t.select(-1, 0)
    return t


def _params(t: torch.Tensor | None) -> torch.Tensor | None:
    """[H] float32 contiguous: a view for vLLM's float32 parameters (a copy otherwise)."""
    return None if t is None else t.to(torch.float32).contiguous()


def mamba2_call(
    layer: ReplaySSMLayer,
    state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
    state_batch_indices, dst_state_batch_indices, null_block_id, out, num_accepted_tokens,
    cu_seqlens, *, parents=None, flush_mask=None,
) -> None:  # fmt: skip
    """The shared body: checks, index mapping, then one registered op (writes `out`).
    `parents` ([batch, T] int32, the verify's draft tree) is the SGLang tree verify's;
    `flush_mask` ([batch] bool, rows a step flushes now) its prefix tracking's, steps only."""
    layer.check_state(state)
    if null_block_id != layer.pad_slot_id:
        raise ValueError(
            f"null_block_id: expected the layer's pad slot id {layer.pad_slot_id}, got "
            f"{null_block_id}"
        )
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected the output tensor vLLM passes, got {type(out).__name__}")
    if out.dim() != 3 or not out.is_contiguous():
        raise ValueError(
            f"out: expected a contiguous [tokens, H, P] tensor, got {list(out.shape)} with "
            f"strides {out.stride()}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x: expected [tokens, H, P], got {getattr(x, 'shape', x)}")
    planned = "dt_softplus" in layer.flags
    if bool(dt_softplus) != planned:
        raise ValueError(f"dt_softplus: expected {planned} (as planned), got {dt_softplus}")
    if state_batch_indices is None:
        raise ValueError("state_batch_indices: expected the rows' slots, got None")
    batch, T, varlen = tokens_per_row("x", x.shape[0], cu_seqlens, layer, varlen=True)
    rows = layer.rows(batch)
    if varlen:
        _check_varlen(cu_seqlens, x.shape[0], T, rows)
    else:
        _check_uniform(cu_seqlens, batch, T, layer, rows)
    slots = rows.slot_ids("state_batch_indices", state_batch_indices)
    rows.same_slots("dst_state_batch_indices", dst_state_batch_indices, state_batch_indices, slots)
    accepted = rows.accepted_from_engine(num_accepted_tokens, layer.pool["cursors"], slots)
    A, D, dt_bias = (_params(_per_head(n, t, 0)) for n, t in (("A", A), ("D", D),
                                                               ("dt_bias", dt_bias)))  # fmt: skip
    dt = _per_head("dt", dt, 1)
    lead = (batch,) if T == 1 else (batch, T)
    gates = rows.step_gates if T == 1 else rows.draft_gates
    named = (("x", x), ("B", B), ("C", C), ("z", z))
    tree = {} if parents is None else {"parents": parents}  # (the decode op takes none)
    forced = step_flush_mask(flush_mask, T)  # (the verify op takes none)
    if varlen:  # rows of 1..T tokens: gathered into the plan's [batch, T, ...] buffers
        packed = rows.packed_rows()
        packed.lay_out(cu_seqlens, x.shape[0])
        packed.gather_gate("dt", dt, x.shape[0], gates[0])
        tokens = {n: None if t is None else packed.gather_in(n, t) for n, t in named}
        layer.launch(rows, "verify", **tokens, out=packed.padded["out"], dt=gates[0], A=A, D=D,
                     dt_bias=dt_bias, slot_indices=slots, num_accepted=accepted,
                     num_drafts=packed.num_drafts, **tree)  # fmt: skip
        packed.scatter_out(out, x.shape[0])
        return
    # (the buffer is contiguous, so any dt strides copy in; splitting dim 0 is always a view)
    gates[0].view(-1, gates[0].shape[-1]).copy_(dt)
    tokens = {n: None if t is None else t.unflatten(0, lead) for n, t in named}
    layer.launch(rows, "decode" if T == 1 else "verify", **tokens, out=out.unflatten(0, lead),
                 dt=gates[0], A=A, D=D, dt_bias=dt_bias, slot_indices=slots,
                 num_accepted=accepted, **tree, **forced)  # fmt: skip


def step_flush_mask(flush_mask: object, T: int) -> dict:
    """The decode op's flush_mask argument, as keywords ({} for none): a verify (T > 1) forces
    no flush, so a mask there is refused rather than dropped."""
    if flush_mask is None:
        return {}
    if T != 1:
        raise ValueError(
            f"flush_mask: expected None with {T} tokens per row (a verify forces no flush), got "
            "a tensor"
        )
    return {"flush_mask": flush_mask}


def _check_varlen(cu_seqlens: torch.Tensor, tokens: int, T: int, rows) -> None:
    """Where values are read: cu_seqlens from 0 to `tokens`, each row 0..T tokens."""
    if not reads_device_values(rows.plan):
        return
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in pairwise(cu)]
    if cu[0] != 0 or cu[-1] != tokens or not all(0 <= n <= T for n in lengths):
        raise ValueError(
            f"cu_seqlens: expected 0 ... {tokens} with 0..{T} tokens per row (the layout's "
            f"drafts), got {cu}"
        )
