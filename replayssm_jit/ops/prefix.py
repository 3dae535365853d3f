"""Prefix caching: read the exact state of a slot at any position, and start slots from one.

    state = materialize_slots(plan, tensors, slots, A=A)   FP32 [n, *S], nothing changed
    reset_slots(layout, tensors, slots, state)             load: decode on from that state

A ReplaySSM slot's state is its checkpoint plus the records it holds since the last flush;
materialize_slots folds those records into a copy of the checkpoint in FP32, as the next flush
would, so an engine can store a prefix's state at any position, not only at flush boundaries.
Pending speculative drafts (cursor word 3) are not part of it: they are not committed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from replayssm_jit.core.cursor_words import CURSOR_HELD
from replayssm_jit.families.layout import check_pool_layout
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.lifecycle import slot_id_list
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.registry import family_ops

__all__ = ["materialize_slots"]

_F32 = torch.float32


@torch.no_grad()
def materialize_slots(
    plan: DecodePlan,
    tensors: Mapping[str, torch.Tensor],
    slots: torch.Tensor | Sequence[int],
    **params: torch.Tensor,
) -> torch.Tensor:
    """The current FP32 state of each slot in `slots`: its checkpoint (the carried copy, decoded
    where it is e4m3; separate mode's read copy is not read) with the records it holds folded in
    (exact FP32, in the order the flush folds them). Nothing is written.

    plan: a plan of the layer (its layout, flags and mode; a conventional plan's state is the
        checkpoint itself). tensors: the layer's slot tensors by name. slots: [n] slot ids (an
        int tensor on any device or a list of ints; repeats allowed). params: Mamba-2 takes
        A [H] float32 on the state's device (its records hold dt, not the decay); GDN and KDA
        none.
    Returns [n, *S] float32 on the state's device (Mamba-2 S = [H, P, N], GDN [HV, V, K]).
    Reads the cursors on the host (a sync): a prefix-cache operation, not a decode step's.
    """
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    family, ops = plan.family.name, family_ops(plan.family)
    names = ops.fold_params
    for name in sorted(set(params) - set(names)):
        raise TypeError(f"{name}: expected only {list(names)} for {family}, got {name} too")
    for name in sorted(set(names) - set(params)):
        raise TypeError(f"{name}: expected a tensor ({family}'s records need it), got None")
    num_slots = plan.layout.check_tensors(tensors, device=plan.device)
    check_pool_layout(plan.layout, tensors.get("cursors"))
    ops.check_fold_params(plan, tensors, params)
    ids = slot_id_list("slots", slots, num_slots, distinct=False)
    if not plan.replay:
        for slot, words in zip(ids, tensors["cursors"][ids].tolist() if ids else []):
            if words[0]:
                raise ValueError(
                    f"plan: expected mode='replay' for slot {slot}, which holds {words[0]} "
                    f"records (a conventional plan's state would leave them out), got "
                    f"mode='conventional'"
                )
        return (
            torch.cat([torch_path.checkpoint_values(tensors, slice(s, s + 1)) for s in ids])
            if ids
            else _empty(plan, tensors)
        )
    held_limit = plan.layout.capacity - 1
    cursors = tensors["cursors"][ids].tolist() if ids else []
    out = []
    for slot, words in zip(ids, cursors):
        held = words[CURSOR_HELD]
        if not 0 <= held <= held_limit:
            raise ValueError(
                f"slots: expected cursors holding 0..{held_limit} records, got {held} in slot "
                f"{slot} (a corrupted or never reset cursor)"
            )
        out.append(ops.fold(plan, tensors, slot, held, params))
    return torch.cat(out) if out else _empty(plan, tensors)


def _empty(plan: DecodePlan, tensors) -> torch.Tensor:
    state = tensors["state"]
    return torch.empty((0, *state.shape[1:]), dtype=_F32, device=state.device)
