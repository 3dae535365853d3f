"""Slot-indexed decode caches shared by every family: state pool, record rings, cursors.

A cache owns, per slot, one checkpoint (the recurrent state at its last flush), ring buffers of
the input records since then, and a cursor row (int32 [4]: records held, flush epoch, a scratch
word the kernels use to agree on who advances the cursor, spare). Kernels read and advance the
cursors on the device, so decode steps need no host sync.
"""

from __future__ import annotations

import torch

CURSOR_WORDS = 4


class SlotCache:
    """State pool [num_slots, *state_shape] plus named rings [num_slots, *ring_shape].

    The rings' order is the order the kernels take them in (see DecodeWrapper._launch).

    `pad_slot_id` in [0, num_slots) is reserved (vLLM uses 0) and never handed out.
    """

    def __init__(
        self,
        num_slots: int,
        state_shape: tuple[int, ...],
        state_dtype: torch.dtype,
        rings: dict[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        device: torch.device | str,
        pad_slot_id: int = -1,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots = num_slots
        self.pad_slot_id = pad_slot_id
        self.state = torch.zeros((num_slots, *state_shape), dtype=state_dtype, device=self.device)
        self.rings = {
            name: torch.zeros((num_slots, *shape), dtype=dtype, device=self.device)
            for name, (shape, dtype) in rings.items()
        }
        self.cursors = torch.zeros((num_slots, CURSOR_WORDS), dtype=torch.int32, device=self.device)
        self._free = [s for s in range(num_slots) if s != pad_slot_id]

    def allocate(self, count: int) -> torch.Tensor:
        """Hand out `count` free slots (reset to a zero state) as an int32 device tensor."""
        if count > len(self._free):
            raise ValueError(f"count: expected at most {len(self._free)} free slots, got {count}")
        slots, self._free = self._free[:count], self._free[count:]
        ids = torch.tensor(slots, dtype=torch.int32, device=self.device)
        self.reset(ids)
        return ids

    def free(self, slots: torch.Tensor | list[int]) -> None:
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        taken = set(range(self.num_slots)) - set(self._free) - {self.pad_slot_id}
        bad = [s for s in values if s not in taken]
        if bad:
            raise ValueError(f"slots: expected allocated slot ids, got {bad[0]}")
        self._free.extend(values)

    def reset(self, slots: torch.Tensor, initial_state: torch.Tensor | None = None) -> None:
        """Set the checkpoints of `slots` (zeros, or `initial_state` [len, *state_shape]) and drop their records."""
        index = slots.to(device=self.device, dtype=torch.long)
        if initial_state is None:
            self.state[index] = 0
        else:
            want = (len(index), *self.state.shape[1:])
            if tuple(initial_state.shape) != want:
                raise ValueError(
                    f"initial_state: expected shape {list(want)}, got {list(initial_state.shape)}"
                )
            self.state[index] = initial_state.to(self.state.dtype)
        self.cursors[index] = 0

    def records_held(self, slots: torch.Tensor) -> torch.Tensor:
        """Records held since the last flush, per slot (a device tensor; reading it syncs)."""
        return self.cursors[slots.to(device=self.device, dtype=torch.long), 0]
