"""Per-batch-size plan and index buffers of one engine layer, and the engines' index
conventions mapped onto the ops' (slot ids, accepted counts) with no allocation, no host sync
under capture, and no clone of the cursor table.

    rows = LayerRows.make(plan)                     once per batch size (before CUDA-graph capture)
    slots = rows.slot_ids("state_batch_indices", indices)   [batch] int32 view or buffer
    accepted = rows.accepted_from_engine(num_accepted_tokens, cursors, slots)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm_jit.core.cursor_words import CURSOR_PENDING
from replayssm_jit.families.schema import expected_shape
from replayssm_jit.integrations.vllm.varlen import PackedRows
from replayssm_jit.ops import decode
from replayssm_jit.ops.library import plan_handle
from replayssm_jit.ops.plan import DecodePlan

NULL_BLOCK_ID = 0  # vLLM pads decode rows with block 0, which it never hands to a request

__all__ = ["LayerRows"]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def reads_device_values(plan: DecodePlan) -> bool:
    """Whether an adapter may read index values on the host: as the ops decide, and never
    while dynamo traces (a .tolist() there would break the graph)."""
    return decode.reads_device_values(plan) and not torch.compiler.is_compiling()


def narrow_to_int32(
    name: str,
    src: torch.Tensor,
    dst: torch.Tensor,
    wide: torch.Tensor,
    reads: bool,
    what: str = "slot ids",
) -> torch.Tensor:
    """`src` (int32 or int64, shaped as `dst`) copied into the int32 buffer `dst`. int64 values
    outside int32 raise where values are read, and else saturate through the int64 buffer
    `wide` (a plain copy would wrap: 2**32 + 1 would name slot 1)."""
    if src.dtype == torch.int64:
        if reads:
            bad = next(((i, v) for i, v in enumerate(src.tolist())
                        if not INT32_MIN <= v <= INT32_MAX), None)  # fmt: skip
            if bad is not None:
                raise ValueError(
                    f"{name}: expected {what} in the int32 range [{INT32_MIN}, {INT32_MAX}], "
                    f"got {bad[1]} in row {bad[0]}"
                )
        else:
            src = torch.clamp(src, INT32_MIN, INT32_MAX, out=wide[: src.shape[0]])
    return dst.copy_(src)


@dataclass(eq=False)
class LayerRows:
    """A plan with its torch.library handle and the buffers an adapter writes instead of
    allocating: slot ids, the accepted-count mapping, and FP32 copies of the engines' bf16 gates."""

    plan: DecodePlan
    handle: int
    slots: torch.Tensor  # [batch] int32: column 0 of [batch, 1 + T] indices
    gather: torch.Tensor  # [batch] int32: slot ids with pads clamped to a readable row
    pending: torch.Tensor  # [batch] int32: cursor word 3 of each row's slot
    accepted: torch.Tensor  # [batch] int32: the ops' num_accepted
    wide: torch.Tensor  # [batch] int64: int64 indices and counts saturated before narrowing
    step_gates: tuple[torch.Tensor, ...]  # FP32 [batch, ...] per family (dt; a, b)
    draft_gates: tuple[torch.Tensor, ...]  # the same with a draft dim [batch, T, ...]
    packed: PackedRows | None = None  # a layout with drafts: varlen MTP's row buffers

    @classmethod
    def make(cls, plan: DecodePlan) -> LayerRows:
        batch, dev, T = plan.batch_size, plan.device, plan.layout.drafts
        shape = plan.layout.shape
        # The family's FP32 per-token gates its planned flags take (dt; a, b; or g, beta).
        gate_inputs = [arg for arg in plan.family.inputs if arg.dtype == "f32"
                       and arg.shape[:1] == ("lead",) and arg.present(plan.spec.flags)]  # fmt: skip

        def gates(lead):
            return tuple(torch.zeros(expected_shape(arg, shape, lead), dtype=torch.float32,
                                     device=dev) for arg in gate_inputs)  # fmt: skip

        def ints():
            return torch.zeros(batch, dtype=torch.int32, device=dev)

        return cls(
            plan, plan_handle(plan), ints(), ints(), ints(), ints(),
            torch.zeros(batch, dtype=torch.int64, device=dev), gates((batch,)),
            gates((batch, T)) if T > 1 else (),
        )  # fmt: skip

    def packed_rows(self) -> PackedRows:
        """Varlen MTP's row buffers, made at the first packed call (warm-up, before capture)."""
        if self.packed is None:
            self.packed = PackedRows.make(self.plan)
        return self.packed

    # -----------------------------------------------------------------------------------------

    def slot_ids(self, name: str, indices: object) -> torch.Tensor:
        """[batch] int32 contiguous slot ids from the engine's [>= batch] or [>= batch, 1 + T]
        int32/int64 indices (column 0: one slot per request holds checkpoint and records). A
        view where the engine's tensor already is one, else written into the slots buffer;
        with vLLM's null block as the pad, always the buffer, negative ids (vLLM's
        PAD_SLOT_ID -1) mapped to the null block."""
        batch = self.plan.batch_size
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected dtype int32 or int64, got {indices.dtype}")
        if indices.dim() not in (1, 2) or indices.shape[0] < batch:
            raise ValueError(
                f"{name}: expected shape [{batch}] or [{batch}, 1 + T] (batch rows first), got "
                f"{list(indices.shape)}"
            )
        column = indices[:batch, 0] if indices.dim() == 2 else indices[:batch]
        if self.plan.pad_slot_id == NULL_BLOCK_ID:
            # vLLM pads CUDA-graph rows with PAD_SLOT_ID (-1) where its kernels take either
            # pad: a negative id becomes the null block, on the device.
            if column.dtype != torch.int32:
                column = narrow_to_int32(name, column, self.slots, self.wide,
                                         reads_device_values(self.plan))  # fmt: skip
            return torch.clamp(column, min=NULL_BLOCK_ID, out=self.slots)
        if column.dtype == torch.int32 and column.is_contiguous():
            return column
        return narrow_to_int32(name, column, self.slots, self.wide,
                               reads_device_values(self.plan))  # fmt: skip

    def same_slots(self, name: str, dst: object, src: object, slots: torch.Tensor) -> None:
        """dst_state_batch_indices must name the slots state_batch_indices names: a ReplaySSM
        step writes the slot it read (a copy to another block is a prefix-cache operation)."""
        if dst is None or dst is src:
            return
        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(dst).__name__}")
        if reads_device_values(self.plan):
            batch = self.plan.batch_size
            col = dst[:batch, 0] if dst.dim() == 2 else dst[:batch]
            if self.plan.pad_slot_id == NULL_BLOCK_ID:  # PAD_SLOT_ID rows, as slot_ids maps them
                col = col.clamp(min=NULL_BLOCK_ID)
            if col.shape != slots.shape or not torch.equal(col.to(torch.int32), slots):
                raise ValueError(
                    f"{name}: expected the slots of state_batch_indices {slots.tolist()} (a "
                    f"ReplaySSM step updates its slot in place), got {col.tolist()}"
                )

    def accepted_from_engine(
        self, num_accepted_tokens: object, cursors: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor | None:
        """vLLM's num_accepted_tokens (tokens of the previous verify window kept, the bonus
        token included, minimum 1; pad rows 1) as the ops' num_accepted (pending drafts to keep,
        0 where none is pending): min(num_accepted_tokens, pending) on the device. After
        reset_slots or a plain step nothing is pending, and the engine's 1 commits nothing."""
        if num_accepted_tokens is None:
            return None
        batch = self.plan.batch_size
        name = "num_accepted_tokens"
        if not isinstance(num_accepted_tokens, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(num_accepted_tokens)}")
        if num_accepted_tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"{name}: expected dtype int32 or int64, got {num_accepted_tokens.dtype}"
            )
        if num_accepted_tokens.dim() != 1 or num_accepted_tokens.shape[0] < batch:
            raise ValueError(
                f"{name}: expected shape [{batch}] (one count per row), got "
                f"{list(num_accepted_tokens.shape)}"
            )
        counts = num_accepted_tokens[:batch]
        # Pads (-1 or the null block) read a real row; their count is never used.
        torch.clamp(slots, min=0, out=self.gather)
        torch.index_select(cursors[:, CURSOR_PENDING], 0, self.gather, out=self.pending)
        if reads_device_values(self.plan):
            self._check_counts(counts, slots)
        # Through int64, floored at 0: a count below int32's range must not wrap to a positive one
        # where values are not read (a graph replay); there it commits nothing.
        torch.minimum(counts, self.pending, out=self.wide)
        return self.accepted.copy_(self.wide.clamp_(min=0))

    def _check_counts(self, counts: torch.Tensor, slots: torch.Tensor) -> None:
        pad = self.plan.pad_slot_id
        for b, (n, s, p) in enumerate(zip(counts.tolist(), slots.tolist(), self.pending.tolist())):
            if s == pad:
                continue
            if n < 1 or (n > p and not (p == 0 and n == 1)):
                want = "1 (nothing pending: first step after a reset or a plain step)"
                if p:
                    want = f"1..{p} (the previous verify's {p} tokens, bonus token included)"
                raise ValueError(f"num_accepted_tokens: expected {want} in row {b}, got {n}")
