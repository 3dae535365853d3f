"""What the speculative ops (ops/verify.py, ops/commit.py, ops/snapshot.py) check alike: the
plan, the index tensors, the live rows, draft counts and accepted counts against the cursors."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replayssm_jit.core.checks import TensorTags, check_tensor
from replayssm_jit.core.dtypes import MAX_VERIFY_DRAFTS
from replayssm_jit.families.base import Family
from replayssm_jit.ops.decode import check_inputs, check_plan, cursor_fault, output_buffer
from replayssm_jit.ops.plan import DecodePlan

# The num_accepted each pool's last verify took (by its cursors): commit_drafts given that same
# tensor would commit the previous verify's counts a second time, to this verify's drafts.
FUSED_FORM = TensorTags()
# Per pool (by its cursors), {slot: a} for the slots whose last verify took a tree: its drafts
# 0..a-1 form a chain, the most a commit without accepted_path (a chain commit) may accept there.
# Known from eager calls only (a graph reads no ids): a graph-mode verify or commit forgets them all.
PENDING_TREES = TensorTags()


def chain_prefix(parents: list[int], drafts: int) -> int:
    """How many of the first `drafts` drafts form a chain (draft i's parent is i - 1)."""
    a = 0
    while a < drafts and parents[a] == a - 1:
        a += 1
    return a


def note_pending_trees(cursors: torch.Tensor, prefixes: dict[int, int | None] | None) -> None:
    """After a verify or commit: `prefixes` {slot: its tree's chain prefix, None where its
    pending drafts (if any) are a chain} for the call's live slots, or None where the call read
    no ids (graph mode: every slot is forgotten)."""
    if prefixes is None:
        PENDING_TREES.discard(cursors)
        return
    held = PENDING_TREES.get(cursors, {})
    if not held and all(a is None for a in prefixes.values()):
        return  # (chains only: nothing to remember, no tag to set)
    held = {**held, **prefixes}
    PENDING_TREES.set(cursors, {s: a for s, a in held.items() if a is not None})


def copy_pending_trees(cursors: torch.Tensor, src: list[int] | None, dst: list[int] | None) -> None:
    """After copy_slots: each dst slot now holds its src's pending drafts, tree or chain (all
    forgotten where the ids were not read)."""
    held = PENDING_TREES.get(cursors, {})
    if src is None or dst is None:
        PENDING_TREES.discard(cursors)
    elif held:
        note_pending_trees(cursors, {d: held.get(s) for s, d in zip(src, dst)})


def check_chain_commit(cursors: torch.Tensor, accepted: dict[int, int], slots: dict[int, int],
                       name: str) -> None:  # fmt: skip
    """A chain commit (no accepted_path) of accepted[b] drafts in slot slots[b]: no more than the
    chain its last verify's tree starts with, where that verify took one (PENDING_TREES)."""
    trees = PENDING_TREES.get(cursors, {})
    for b, a in accepted.items():
        prefix = trees.get(slots[b])
        if prefix is not None and a > prefix:
            raise ValueError(
                f"{name}: expected at most {prefix} for row {b} (slot {slots[b]}) without "
                f"accepted_path: its last verify took a tree whose first {prefix} drafts form a "
                f"chain, and a chain commit accepts drafts 0..a-1 (pass the accepted root-to-node "
                f"path as accepted_path), got {a}"
            )


def check_speculative_plan(plan: object, family: Family | None, mode: str | None, op: str) -> int:
    """The plan (of `family`, where given) has `mode` (any where None) and a layout with drafts T
    in [2, 8]; returns T."""
    if family is None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    else:
        check_plan(plan, family)
    if mode is not None and plan.mode != mode:
        raise ValueError(f"plan: expected a plan of mode={mode!r} for {op}, got mode={plan.mode!r}")
    drafts = plan.layout.drafts
    if not plan.spec.has_verify:
        raise ValueError(
            f"plan: expected a layout with drafts in [2, {MAX_VERIFY_DRAFTS}] for {op} (the "
            f"ring's draft rows; plan a layout made with drafts=T), got drafts={drafts}"
        )
    return drafts


def check_draft_op(
    plan: object, family: Family, mode: str | None, op: str, args: Mapping[str, object]
) -> tuple[dict[str, object], torch.Tensor]:
    """A family's op over drafts (verify, snapshot verify), its plan checked: its token inputs
    from `args` with the draft dim (check_inputs) and out [batch, T, value heads, value dim]
    (given, checked, or allocated)."""
    T = check_speculative_plan(plan, family, mode, op)
    shape = plan.layout.shape
    inputs = check_inputs(plan, (plan.batch_size, T), args)
    out = output_buffer(plan, args.get("out"), (T, shape.value_heads, shape.value_dim))
    return inputs, out


def check_index(
    plan: DecodePlan, name: str, t: object, per_row: tuple[int, ...], *, required: bool = False
) -> torch.Tensor | None:
    """An int32 [batch, *per_row] contiguous tensor on the plan's device, or None where allowed."""
    if t is None and not required:
        return None
    return check_tensor(name, t, shape=(plan.batch_size, *per_row), dtype=torch.int32,
                        device=plan.device, contiguous=True)  # fmt: skip


def draft_counts(
    plan: DecodePlan, live: list[tuple[int, int]], num_drafts: torch.Tensor | None
) -> dict[int, int]:
    """t per live row, each checked in [0, T]."""
    if num_drafts is None:
        return {b: plan.layout.drafts for b, _ in live}
    return draft_bounded(plan, "num_drafts", num_drafts, live)


def draft_bounded(
    plan: DecodePlan, name: str, counts: torch.Tensor, live: list[tuple[int, int]]
) -> dict[int, int]:
    """counts[b] per live row (a [batch] tensor of draft counts), each checked in [0, T]."""
    T = plan.layout.drafts
    values = counts.tolist()
    for b, _ in live:
        if not 0 <= values[b] <= T:
            raise ValueError(
                f"{name}: expected values in [0, {T}] (the layout's drafts), got "
                f"{values[b]} in row {b}"
            )
    return {b: values[b] for b, _ in live}


def check_accepted(
    plan: DecodePlan,
    num_accepted: torch.Tensor,
    words: dict[int, list[int]],
) -> dict[int, int]:
    """a per live row in [0, p], p the row's pending drafts (cursor word 3); rows whose cursors
    are corrupted are the kernels' to fault."""
    values = num_accepted.tolist()
    for b, w in words.items():
        if cursor_fault(plan, w, step=False) is None and not 0 <= values[b] <= w[3]:
            raise ValueError(
                f"num_accepted: expected values in [0, {w[3]}] (the pending drafts of the last "
                f"verify, cursor word 3), got {values[b]} in row {b}"
            )
    return {b: values[b] for b in words}
