"""Prefix caching: read the exact state of a slot at any position, and start slots from one.

    state = materialize_slots(plan, tensors, slots, A=A)   FP32 [n, *S], nothing changed
    materialize_states(plans, pools, slot_table, out, params)  [layers, batch] on the device
    reset_slots(layout, tensors, slots, state)             load: decode on from that state

A ReplaySSM slot's state is its checkpoint plus the records it holds since the last flush;
materialize_slots folds those records into a copy of the checkpoint in FP32, as the next flush
would, so an engine can store a prefix's state at any position, not only at flush boundaries.
Pending speculative drafts (cursor word 3) are not part of it: they are not committed.
materialize_states is the engines' form: a [layers, batch] table of slot ids on the device, no
host read of device values and no Python loop per slot (graph-capturable), the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from replayssm_jit.core.checks import check_no_alias, check_tensor
from replayssm_jit.core.cursor_words import CURSOR_HELD
from replayssm_jit.families.layout import check_pool_layout
from replayssm_jit.families.schema import bind
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.lifecycle import slot_id_list
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.registry import family_ops

__all__ = ["materialize_slots", "materialize_states"]

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


@torch.no_grad()
def materialize_states(
    plans: DecodePlan | Sequence[DecodePlan],
    pools: Sequence[Mapping[str, torch.Tensor]],
    slot_table: torch.Tensor,
    out: Sequence[torch.Tensor] | torch.Tensor,
    params: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> None:
    """materialize_slots over a [layers, batch] table, into caller-owned tensors: out[l][b] =
    the FP32 state of slot slot_table[l, b] of layer l (its carried checkpoint with its held
    records folded in: materialize_slots' bits on the CPU path; on CUDA tensors within FP32
    rounding of them, as the matmul's kernel may differ with the record count). Nothing in the
    pools changes.

    plans: one DecodePlan per layer, or one for every layer. pools: each layer's slot tensors by
        name. slot_table: [layers, batch] int32 on the pools' device; a negative id is a pad,
        whose out row is left untouched (its bits stay). out: per layer [batch, *S] float32 on
        that device (a [layers, batch, *S] tensor serves), S the state's per-slot shape
        (Mamba-2 [H, P, N], GDN and KDA [HV, V, K]). params: per layer the fold's parameters
        (Mamba-2 {"A": A [H] float32}; GDN, KDA {}); None where no layer needs any.
    No host read of device values and no loop per slot: each layer folds CAP-1 record positions
    for every row at once, the positions past a row's count zeroed (exact zeros after its
    records: the bits stay materialize_slots'). On CPU tensors the ids and held
    counts are checked (ValueError); on a device they cannot be without a sync, so a row whose
    id is past the pool or whose cursor holds a count outside 0..CAP-1 is written NaN.
    Runs the torch path on every device (the CUDA kernel has not yet run on a GPU).
    """
    layers = _check_states_args(plans, pools, slot_table, out, params)
    for plan, tensors, ids, dest, fold_params in layers:
        _materialize_layer(plan, tensors, ids, dest, fold_params)


@torch.no_grad()
def materialize_states_cuda(
    plans: DecodePlan | Sequence[DecodePlan],
    pools: Sequence[Mapping[str, torch.Tensor]],
    slot_table: torch.Tensor,
    out: Sequence[torch.Tensor] | torch.Tensor,
    params: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> None:
    """materialize_states through each layer's module binding (materialize_step: a CTA per head
    and row, the records folded one by one, so FP32 rounding apart from the torch path). Not on
    any default path: it has not yet run on a GPU (tests/protocol/test_materialize_states.py's
    gpu test compares it with materialize_slots). Arguments as materialize_states', on CUDA
    tensors, each out[l] contiguous."""
    layers = _check_states_args(plans, pools, slot_table, out, params)
    for layer, (plan, _, _, dest, _) in enumerate(layers):
        if not plan.replay:
            raise ValueError(f"plans[{layer}]: expected mode='replay' (the binding folds held "
                             f"records), got mode='conventional'")  # fmt: skip
        if dest.device.type != "cuda" or not dest.is_contiguous():
            raise ValueError(f"out[{layer}]: expected a contiguous CUDA tensor, got device "
                             f"{dest.device}, strides {dest.stride()}")  # fmt: skip
    for plan, tensors, ids, dest, fold_params in layers:
        values = {**tensors, **fold_params, "slot_ids": ids, "out": dest}
        plan.module.materialize_step(*bind(plan.family, "materialize_step", values))


def _check_states_args(plans, pools, slot_table, out, params) -> list[tuple]:
    """Every argument of materialize_states checked before anything is written (a failed call
    changes nothing): returns (plan, tensors, ids, out, params) per layer."""
    if not isinstance(pools, Sequence) or isinstance(pools, Mapping):
        raise TypeError(f"pools: expected a sequence of per-layer tensor mappings, got "
                        f"{type(pools).__name__}")  # fmt: skip
    count = len(pools)
    if isinstance(plans, DecodePlan):
        plans = [plans] * count
    if not isinstance(plans, Sequence) or len(plans) != count:
        raise ValueError(f"plans: expected a DecodePlan or {count} of them (one per pool), got "
                         f"{plans!r:.80}")  # fmt: skip
    if params is None:
        params = [{}] * count
    if not isinstance(params, Sequence) or len(params) != count:
        raise ValueError(f"params: expected None or {count} mappings (one per pool), got "
                         f"{params!r:.80}")  # fmt: skip
    if not isinstance(out, (Sequence, torch.Tensor)) or len(out) != count:
        raise ValueError(f"out: expected {count} tensors (one per pool), got {out!r:.80}")
    if count == 0:
        raise ValueError("pools: expected at least one layer, got none")
    device = plans[0].device if isinstance(plans[0], DecodePlan) else None
    check_tensor("slot_table", slot_table, shape=(count, None), dtype=torch.int32, device=device)
    batch = slot_table.shape[1]
    layers = []
    for layer, (plan, tensors, dest, given) in enumerate(zip(plans, pools, out, params)):
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plans[{layer}]: expected a DecodePlan, got {type(plan).__name__}")
        if plan.device != device:
            raise ValueError(f"plans[{layer}]: expected device {device} (plans[0]'s), got "
                             f"{plan.device}")  # fmt: skip
        family, ops = plan.family.name, family_ops(plan.family)
        if not isinstance(given, Mapping):
            raise TypeError(f"params[{layer}]: expected a mapping, got {type(given).__name__}")
        names = ops.fold_params
        for name in sorted(set(given) - set(names)):
            raise TypeError(f"params[{layer}]: expected only {list(names)} for {family}, got "
                            f"{name} too")  # fmt: skip
        for name in sorted(set(names) - set(given)):
            raise TypeError(f"params[{layer}]: expected {name} ({family}'s records need it), "
                            f"got None")  # fmt: skip
        num_slots = plan.layout.check_tensors(tensors, device=plan.device)
        check_pool_layout(plan.layout, tensors.get("cursors"))
        ops.check_fold_params(plan, tensors, given)
        per_slot = tuple(tensors["state"].shape[1:])
        if plan.layout.state_dtype == torch.float4_e2m1fn_x2:
            per_slot = (*per_slot[:-1], 2 * per_slot[-1])  # two codes a byte
        check_tensor(f"out[{layer}]", dest, shape=(batch, *per_slot), dtype=_F32, device=device)
        check_no_alias({f"out[{layer}]": dest}, {**tensors, "slot_table": slot_table, **given})
        ids = slot_table[layer]
        if ids.device.type == "cpu":
            _check_host_rows(plan, tensors, layer, ids, num_slots)
        layers.append((plan, tensors, ids, dest, given))
    return layers


def _check_host_rows(plan, tensors, layer: int, ids: torch.Tensor, num_slots: int) -> None:
    """On CPU tensors (host values, no sync): each id a pad or in [0, num_slots), and each
    named slot's cursor holding 0..CAP-1 records (none where the plan is conventional)."""
    for b, slot in enumerate(ids.tolist()):
        if slot >= num_slots:
            raise ValueError(f"slot_table[{layer}, {b}]: expected a pad (negative) or a slot in "
                             f"[0, {num_slots}), got {slot}")  # fmt: skip
        if slot < 0:
            continue
        held, limit = int(tensors["cursors"][slot, CURSOR_HELD]), plan.layout.capacity - 1
        if not plan.replay and held:
            raise ValueError(f"plans[{layer}]: expected mode='replay' for slot {slot}, which "
                             f"holds {held} records, got mode='conventional'")  # fmt: skip
        if not 0 <= held <= limit:
            raise ValueError(f"slot_table[{layer}, {b}]: expected cursors holding 0..{limit} "
                             f"records, got {held} in slot {slot} (a corrupted or never reset "
                             f"cursor)")  # fmt: skip


def _materialize_layer(plan, tensors, ids: torch.Tensor, dest: torch.Tensor, params) -> None:
    """One layer's rows: gather, fold CAP-1 record positions for every row with those past its
    count zeroed, select; nothing reads a device value on the host."""
    num_slots = tensors["state"].shape[0]
    pad = ids < 0
    rows = ids.clamp(0, num_slots - 1).long()  # pads and stray ids read slot 0 or the last
    held = tensors["cursors"][rows, CURSOR_HELD]
    if plan.replay:
        stray = (held < 0) | (held >= plan.layout.capacity)
        value = family_ops(plan.family).fold_rows(plan, tensors, rows, held, params)
    else:
        stray = held != 0
        value = torch_path.checkpoint_values(tensors, rows)
    shape = (-1, *[1] * (value.dim() - 1))
    value = torch.where((stray | (ids >= num_slots)).view(shape), float("nan"), value)
    dest.copy_(torch.where(pad.view(shape), dest, value))


def _empty(plan: DecodePlan, tensors) -> torch.Tensor:
    state = tensors["state"]
    return torch.empty((0, *state.shape[1:]), dtype=_F32, device=state.device)
