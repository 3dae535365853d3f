"""Slot lifecycle on caller-owned tensors: start a sequence in a slot, fork a slot into another.

An engine owns a layer's slot tensors (allocated from its CacheLayout: state, the record rings,
cursors [slots, 4] int32) and calls these between decode steps:

    reset_slots(layout, tensors, slots, initial_state=None)  new sequences in `slots`
    copy_slots(layout, tensors, src, dst)                    dst[i] becomes a copy of src[i]

`tensors` maps the layout's names to the tensors (`layout.tensors()`: "state", each ring,
"cursors"), each [num_slots, *per_slot_shape] as the decode ops take them. Slot ids are a 1-D
integer tensor (any device) or a list of ints, each in [0, num_slots), distinct, and not
`pad_slot_id` where one is given (vLLM reserves slot 0 for its padded rows). Everything is
checked before anything is written, so a call that raises changes nothing.

Reading the ids of a device tensor syncs with the host. `check_slot_values=False` skips that
read (ids on the tensors' device are then used as given: out-of-range, repeated or pad ids are
the caller's responsibility, as with the decode ops' check_slot_values=False), which leaves the
calls free of host syncs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from replayssm_jit.core.checks import check_bool, check_disjoint, check_int, check_tensor
from replayssm_jit.core.codecs import raw_bits
from replayssm_jit.families.layout import POOL_LAYOUTS, CacheLayout, check_tensor_mapping
from replayssm_jit.ops.speculative import copy_pending_trees
from replayssm_jit.ops.torch_path.checkpoint import store_checkpoint

__all__ = ["copy_slots", "reset_slots", "slot_id_list"]


def slot_id_list(
    name: str,
    slots: object,
    num_slots: int,
    *,
    pad_slot_id: int | None = None,
    distinct: bool = True,
) -> list[int]:
    """The ids of `slots` (a 1-D integer tensor on any device, or a sequence of ints) as a list,
    each in [0, num_slots), not `pad_slot_id` (where given) and, with `distinct`, each once.
    Raises a TypeError or ValueError that names `name`."""
    if isinstance(slots, torch.Tensor):
        _check_id_tensor(name, slots)
        values = slots.tolist()
    elif isinstance(slots, Sequence) and not isinstance(slots, (str, bytes)):
        values = list(slots)
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: expected int slot ids, got {type(v).__name__} {v!r}")
    else:
        raise TypeError(
            f"{name}: expected an int tensor or a list of ints, got {type(slots).__name__}"
        )
    pad = "" if pad_slot_id is None else f" other than pad_slot_id={pad_slot_id}"
    for v in values:
        if not 0 <= v < num_slots or v == pad_slot_id:
            raise ValueError(f"{name}: expected slot ids in [0, {num_slots}){pad}, got {v}")
    if distinct:
        seen: set[int] = set()
        for v in values:
            if v in seen:
                raise ValueError(f"{name}: expected distinct slot ids, got {v} twice")
            seen.add(v)
    return values


def _check_id_tensor(name: str, slots: torch.Tensor) -> None:
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {list(slots.shape)}")


def _check_layout(layout: object) -> CacheLayout:
    if not isinstance(layout, CacheLayout):
        raise TypeError(f"layout: expected a CacheLayout, got {type(layout).__name__}")
    return layout


def _slot_tensors(
    layout: CacheLayout, tensors: object, *, optional: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor], int, torch.device]:
    """(the tensors by name, num_slots, device), each tensor checked against the layout (those
    in `optional` may be missing) and the given ones sharing no memory (steps write each)."""
    check_tensor_mapping(tensors)
    state = check_tensor("state", tensors.get("state"))
    num_slots = layout.check_tensors(tensors, device=state.device, optional=optional)
    present = {name: t for name, t in tensors.items() if t is not None}
    check_disjoint(present)
    return present, num_slots, state.device


def _index(
    name: str,
    slots: object,
    num_slots: int,
    device: torch.device,
    *,
    pad_slot_id: int | None,
    check_values: bool,
    distinct: bool = True,
) -> tuple[torch.Tensor, list[int] | None]:
    """(int64 index on `device`, the ids as a list) of checked slot ids; with `check_values`
    False the ids are not read (None in place of the list)."""
    if not check_values:
        if not isinstance(slots, torch.Tensor):
            raise TypeError(
                f"{name}: expected an int tensor on {device} (check_slot_values=False), "
                f"got {type(slots).__name__}"
            )
        _check_id_tensor(name, slots)
        check_tensor(name, slots, device=device)
        return slots.to(torch.int64), None
    values = slot_id_list(name, slots, num_slots, pad_slot_id=pad_slot_id, distinct=distinct)
    return torch.tensor(values, dtype=torch.int64, device=device), values


def _check_options(pad_slot_id: object, check_slot_values: object) -> None:
    if pad_slot_id is not None:
        check_int("pad_slot_id", pad_slot_id)
    check_bool("check_slot_values", check_slot_values)


def reset_slots(
    layout: CacheLayout,
    tensors: Mapping[str, torch.Tensor],
    slots: torch.Tensor | Sequence[int],
    initial_state: torch.Tensor | None = None,
    *,
    pad_slot_id: int | None = None,
    check_slot_values: bool = True,
) -> None:
    """Start new sequences in `slots`: each checkpoint zero (or its row of `initial_state`),
    each cursor row all zero (no records held, flush epoch 0, no CTA arrivals, no pending drafts).

    layout: the layer's CacheLayout. tensors: its slot tensors by name, as layout.tensors()
        lists them: state [num_slots, *S] and cursors [num_slots, 4] int32 are written; the
        rings may be left out (their stale rows are never read: a step reads only the records
        its cursor holds).
    slots: [n] distinct slot ids (int tensor on any device, or a list of ints), none of them
        pad_slot_id.
    initial_state: None (zero checkpoints) or [n, *S] of a floating dtype on any device, where
        S is the state's per-slot shape (Mamba-2 [H, P, N], GDN [HV, V, K]); converted to the
        state's dtype (round to nearest) and device: e4m3 and nvfp4 via FP32, with their
        scales, and separate mode's read copy from the same values. Its values must be
        finite (ValueError otherwise; not checked with check_slot_values=False, where a
        non-finite value is the caller's: an e4m3 row or nvfp4 head holding one decodes NaN).
    Nothing else changes; every slot not named keeps its bits. The pool's cursors are recorded
    as of `layout`: an op given a plan of another layout on them raises.
    """
    _check_options(pad_slot_id, check_slot_values)
    layout = _check_layout(layout)
    tensors, num_slots, device = _slot_tensors(layout, tensors, optional=layout.ring_names)
    index, _ = _index(
        "slots", slots, num_slots, device, pad_slot_id=pad_slot_id, check_values=check_slot_values
    )
    state = tensors["state"]
    if initial_state is not None:
        s = layout.shape  # (an nvfp4 state holds two values a byte: its own shape is narrower)
        values_shape = (s.value_heads, s.value_dim, s.key_dim)
        check_tensor("initial_state", initial_state, shape=(index.shape[0], *values_shape))
        if not initial_state.dtype.is_floating_point:
            raise TypeError(f"initial_state: expected a floating dtype, got {initial_state.dtype}")
        # (a host read: skipped with check_slot_values=False, as the slot ids' is)
        if check_slot_values and not bool(torch.isfinite(initial_state).all()):
            bad = (~torch.isfinite(initial_state)).nonzero()[0].tolist()
            raise ValueError(
                f"initial_state: expected finite values (e4m3 and nvfp4 scales would turn one "
                f"inf or NaN into a NaN row or head), got {initial_state[tuple(bad)].item()} "
                f"at {bad}"
            )
    if initial_state is None:
        for name in layout.checkpoint_names:
            raw_bits(tensors[name]).index_fill_(0, index, 0)
    else:
        values = initial_state.to(device=device)
        if layout.checkpoint_names == ("state",):
            state.index_copy_(0, index, values.to(state.dtype))
        else:
            store_checkpoint(tensors, index, values.to(torch.float32))
    tensors["cursors"].index_fill_(0, index, 0)
    POOL_LAYOUTS.set(tensors["cursors"], layout)


def copy_slots(
    layout: CacheLayout,
    tensors: Mapping[str, torch.Tensor],
    src: torch.Tensor | Sequence[int],
    dst: torch.Tensor | Sequence[int],
    *,
    pad_slot_id: int | None = None,
    check_slot_values: bool = True,
) -> None:
    """Fork (prefix sharing): slot dst[i] becomes an exact copy of slot src[i] (checkpoint,
    every ring, cursor row), so both continue from the same point: given the same tokens they
    produce the same bits (except with stochastic rounding, whose noise is keyed by the slot).

    layout: the layer's CacheLayout. tensors: all its slot tensors by name (layout.tensors():
        state, each ring, cursors), [num_slots, ...] each.
    src: [n] slot ids (int tensor on any device, or a list of ints); one src may be given
        several times (one sequence forked into several slots).
    dst: [n] distinct slot ids, none of them in src; neither may name pad_slot_id.
    Only the dst slots change.
    """
    _check_options(pad_slot_id, check_slot_values)
    tensors, num_slots, device = _slot_tensors(_check_layout(layout), tensors)
    src_index, src_ids = _index(
        "src", src, num_slots, device, pad_slot_id=pad_slot_id, check_values=check_slot_values,
        distinct=False,
    )  # fmt: skip
    dst_index, dst_ids = _index(
        "dst", dst, num_slots, device, pad_slot_id=pad_slot_id, check_values=check_slot_values
    )
    if dst_index.shape[0] != src_index.shape[0]:
        raise ValueError(
            f"dst: expected {src_index.shape[0]} slot ids (as src), got {dst_index.shape[0]}"
        )
    if src_ids is not None and dst_ids is not None:
        shared = sorted(set(src_ids) & set(dst_ids))
        if shared:
            raise ValueError(f"dst: expected slot ids not in src, got {shared[0]}")
    for t in map(raw_bits, tensors.values()):
        # (index_select gathers a new tensor first, so no dst row is read after it is written)
        t.index_copy_(0, dst_index, t.index_select(0, src_index))
    copy_pending_trees(tensors["cursors"], src_ids, dst_ids)
