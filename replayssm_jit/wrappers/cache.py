"""Slot caches: the per-slot tensors of one layer (from its CacheLayout) plus a free list.

A convenience for standalone use: engines allocate the same tensors themselves from the layout
and call the functional ops (replayssm_jit.ops), or wrap them with `from_tensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from replayssm_jit.core.checks import (
    check_at_most,
    check_disjoint,
    check_positive_int,
    check_tensor,
)
from replayssm_jit.core.cursor_words import CURSOR_HELD
from replayssm_jit.families.layout import MAX_SLOTS, CacheLayout
from replayssm_jit.ops.lifecycle import copy_slots, reset_slots, slot_id_list
from replayssm_jit.ops.plan import check_pad_slot_id, resolve_device


def default_device() -> torch.device:
    """CUDA where it is available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class SlotCache:
    """A layer's slot tensors: checkpoint pool, record rings and cursors, [num_slots, ...] each.

    pad_slot_id: the id batch rows use for padding: negative (-1 by default, SGLang) or a slot
    in [0, num_slots) that is then reserved and never handed out (vLLM uses 0).
    """

    def __init__(
        self,
        layout: CacheLayout,
        num_slots: int | None = None,
        *,
        device: torch.device | str | None = None,
        pad_slot_id: int = -1,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(layout, CacheLayout):
            raise TypeError(f"layout: expected a CacheLayout, got {type(layout).__name__}")
        if tensors is None:
            check_positive_int("num_slots", num_slots)
            check_at_most("num_slots", num_slots, MAX_SLOTS, "slot ids are int32")
            device = resolve_device(default_device() if device is None else device)
        else:
            num_slots, device = _check_tensors(layout, tensors)
        check_pad_slot_id(pad_slot_id)
        if pad_slot_id >= num_slots:
            raise ValueError(
                f"pad_slot_id: expected a negative id or a slot in [0, {num_slots}), got {pad_slot_id}"
            )
        self.layout, self.num_slots, self.device, self.pad_slot_id = (
            layout,
            num_slots,
            device,
            pad_slot_id,
        )
        self.tensors: dict[str, torch.Tensor] = (
            dict(tensors) if tensors is not None else layout.allocate(num_slots, device)
        )
        self._free = [s for s in range(num_slots) if s != pad_slot_id]

    @classmethod
    def from_tensors(cls, layout: CacheLayout, *, pad_slot_id: int = -1, **tensors: torch.Tensor):
        """A cache over caller-owned tensors (named as layout.tensors(); nothing is allocated)."""
        cache = cls.__new__(cls)
        SlotCache.__init__(cache, layout, pad_slot_id=pad_slot_id, tensors=tensors)
        return cache

    # --- the tensors ---------------------------------------------------------------------
    @property
    def state(self) -> torch.Tensor:
        return self.tensors["state"]

    @property
    def cursors(self) -> torch.Tensor:
        return self.tensors["cursors"]

    @property
    def rings(self) -> dict[str, torch.Tensor]:
        """The record rings by name, in the kernels' order."""
        return {name: self.tensors[name] for name in self.layout.ring_names}

    @property
    def window(self) -> int:
        return self.layout.window

    @property
    def drafts(self) -> int:
        return self.layout.drafts

    @property
    def act_dtype(self) -> torch.dtype:
        return self.layout.act_dtype

    # --- slots ---------------------------------------------------------------------------
    def _slot_ids(self, name: str, slots: object) -> list[int]:
        """Slot ids from an int tensor or a sequence of ints, each a real slot (not the pad)."""
        return slot_id_list(name, slots, self.num_slots, pad_slot_id=self.pad_slot_id,
                            distinct=False)  # fmt: skip

    def allocate(self, count: int) -> torch.Tensor:
        """Hand out `count` free slots (checkpoints zeroed, no records) as an int32 tensor."""
        if not isinstance(count, int) or isinstance(count, bool):
            raise TypeError(f"count: expected an int, got {type(count).__name__} {count!r}")
        if not 0 <= count <= len(self._free):
            raise ValueError(f"count: expected 0 to {len(self._free)} free slots, got {count}")
        ids = torch.tensor(self._free[:count], dtype=torch.int32, device=self.device)
        self.reset(ids)
        del self._free[:count]
        return ids

    def free(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Return allocated slots to the free list (each once)."""
        values = self._slot_ids("slots", slots)
        free = set(self._free)
        seen: set[int] = set()
        for v in values:
            if v in free or v in seen:
                raise ValueError(
                    f"slots: expected allocated slot ids, each once, got {v} "
                    f"({'given twice' if v in seen else 'not allocated'})"
                )
            seen.add(v)
        self._free.extend(values)

    def reset(
        self, slots: torch.Tensor | Sequence[int], initial_state: torch.Tensor | None = None
    ) -> None:
        """Start new sequences in `slots` (distinct ids): checkpoints zero (or `initial_state`
        [len, *state per slot], converted to the state dtype), no records held, flush epoch 0
        (ops.lifecycle.reset_slots)."""
        reset_slots(self.layout, self.tensors, slots, initial_state, pad_slot_id=self.pad_slot_id)

    def fork(self, src: torch.Tensor | Sequence[int], dst: torch.Tensor | Sequence[int]) -> None:
        """Fork (prefix sharing): each allocated slot dst[i] becomes an exact copy of the
        allocated slot src[i] (checkpoint, every ring, cursor), so both continue from the same
        point (ops.lifecycle.copy_slots). dst: distinct ids, none in src; allocate() them first.
        """
        free = set(self._free)
        for name, ids in (("src", src), ("dst", dst)):
            for v in self._slot_ids(name, ids):
                if v in free:
                    raise ValueError(f"{name}: expected allocated slot ids, got {v} (free)")
        copy_slots(self.layout, self.tensors, src, dst, pad_slot_id=self.pad_slot_id)

    def records_held(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Records held since the last flush, per slot (int32 on the cache's device)."""
        index = torch.tensor(self._slot_ids("slots", slots), dtype=torch.long, device=self.device)
        return self.cursors[index, CURSOR_HELD]


def _check_tensors(
    layout: CacheLayout, tensors: Mapping[str, torch.Tensor]
) -> tuple[int, torch.device]:
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors: expected a mapping of tensors by name, got {type(tensors).__name__}"
        )
    names = [t.name for t in layout.tensors()]
    if set(tensors) != set(names):
        raise ValueError(f"tensors: expected exactly {names}, got {sorted(map(str, tensors))}")
    state = check_tensor("state", tensors["state"])
    num_slots = check_positive_int("num_slots", state.shape[0] if state.dim() else 0)
    layout.check_tensors(tensors, device=state.device, num_slots=num_slots)
    check_disjoint(tensors)  # (the cache's steps and lifecycle calls write every one)
    return num_slots, state.device


class FamilyCache(SlotCache):
    """A SlotCache that builds its layout from the family's arguments (`make_layout`)."""

    make_layout: Callable[..., CacheLayout]

    def __init__(self, num_slots: int, *, device: torch.device | str | None = None,
                 pad_slot_id: int = -1, **layout_args) -> None:  # fmt: skip
        layout = type(self).make_layout(**layout_args)
        super().__init__(layout, num_slots, device=device, pad_slot_id=pad_slot_id)
