"""Commit the accepted drafts of each row's last verify (docs/speculative.md): chain or tree
path, checked against the pending drafts and, with the verify's parents, against the tree."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise

import torch

from replayssm_jit.families.layout import check_tensor_mapping
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.decode import (
    check_cursors,
    check_slot_tensors,
    commit_args,
    reads_device_values,
    torch_scalars,
)
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.speculative import (
    FUSED_FORM,
    check_accepted,
    check_chain_commit,
    check_index,
    check_speculative_plan,
    note_pending_trees,
)
from replayssm_jit.ops.torch_path import Pool, Rows

__all__ = ["commit_drafts"]


@torch.no_grad()
def commit_drafts(
    plan: DecodePlan,
    tensors: Mapping[str, torch.Tensor] | None = None,
    /,
    *,
    num_accepted: torch.Tensor,
    slot_indices: torch.Tensor,
    accepted_path: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
    **pool: torch.Tensor,
) -> None:
    """Commit the accepted drafts of each row's last verify (either family).

    The pool as keyword tensors, as the verify and decode ops take it
    (`commit_drafts(plan, **pool, num_accepted=, slot_indices=)`): the layout's cursors and
    rings by name (the checkpoint copies may be there too, in any format; none is touched). A mapping as the second
    positional argument is still accepted, in place of the keywords. num_accepted [batch]: a in
    [0, p], p the row's pending drafts. Chain (no accepted_path): drafts 0..a-1 become
    committed records; after a verify that took a tree (`parents`), a may not pass the chain
    the row's tree starts with (eager calls know the tree from that verify). Tree:
    accepted_path[b, :a] lists the accepted root-to-node path, strictly increasing within
    [0, p), and with `parents` (the verify's [batch, T]; pass them) checked
    against the tree: path[0]'s parent is -1, path[i]'s is path[i - 1]; its records are first
    moved to the rows right after the committed ones. Pad rows and rejected drafts change
    nothing; nothing flushes. num_accepted may not be the tensor the last verify took as its
    fused commit (that would commit those counts twice; a host-side check, graphs included).
    Values on the device (counts, paths, parents, cursors) are checked in eager mode only, as
    in the verify ops.
    """
    check_speculative_plan(plan, None, "replay", "commit_drafts")
    if tensors is not None and pool:
        raise TypeError(
            f"tensors: expected the pool either as a mapping or as keyword tensors, got both "
            f"(a mapping and {sorted(pool)})"
        )
    tensors = pool if tensors is None else tensors
    check_tensor_mapping(tensors)
    for name in (*plan.layout.ring_names, "cursors"):
        if tensors.get(name) is None:
            raise ValueError(f"tensors: expected the layout's {name!r} tensor, got none")
    T = plan.layout.drafts
    num_accepted = check_index(plan, "num_accepted", num_accepted, (), required=True)
    accepted_path = check_index(plan, "accepted_path", accepted_path, (T,))
    parents = check_index(plan, "parents", parents, (T,))
    index = {"num_accepted": num_accepted, "accepted_path": accepted_path, "parents": parents}
    # (a commit moves records and cursors only: no copy of the checkpoint is read or written)
    check_slot_tensors(plan, tensors, slot_indices, optional=plan.layout.checkpoint_names,
                       read=index)  # fmt: skip
    fused = FUSED_FORM.get(tensors["cursors"])
    fused = fused() if fused is not None else None  # (None once that tensor is freed)
    if fused is not None and _tensor_key(fused) == _tensor_key(num_accepted):
        raise ValueError(
            "num_accepted: expected the counts of the last verify's drafts, got the tensor that "
            "verify took as its fused num_accepted (the previous verify's counts: committing "
            "them again would commit twice; pass num_accepted to the next step instead)"
        )
    committed = None  # the committed slots, where the ids are read
    if reads_device_values(plan):
        rows = check_cursors(plan, tensors["cursors"], slot_indices, step=False)
        words = {b: w for b, _, w in rows}
        accepted = check_accepted(plan, num_accepted, words)
        if accepted_path is not None:
            tree = None if parents is None else parents.tolist()
            _check_paths(accepted_path.tolist(), tree, accepted, words)
        else:
            check_chain_commit(tensors["cursors"], accepted, {b: s for b, s, _ in rows},
                               "num_accepted")  # fmt: skip
        committed = {s: None for _, s, _ in rows}
    note_pending_trees(tensors["cursors"], committed)
    rings = [tensors[name] for name in plan.layout.ring_names]
    if plan.backend == "cpu":
        pool = Pool(None, None, dict(zip(plan.layout.ring_names, rings)), tensors["cursors"])
        torch_path.commit(
            torch_scalars(plan, plan.seed, None),
            pool,
            Rows(slot_indices, num_accepted=num_accepted),
            accepted_path,
        )
        return
    plan.module.commit_step(*commit_args(plan, tensors, num_accepted, accepted_path, slot_indices))


def _check_paths(paths, parents, accepted: dict[int, int], words: dict[int, list[int]]) -> None:
    """Each row's first a path entries: within [0, p), strictly increasing and, with the tree's
    parents, a root-to-node path of it."""
    for b, a in accepted.items():
        path, p = paths[b][:a], words[b][3]
        ok = all(0 <= i < p for i in path) and all(i < j for i, j in pairwise(path))
        if ok and parents is not None:
            ok = all(parents[b][i] == (path[k - 1] if k else -1) for k, i in enumerate(path))
        if not ok:
            tree = (
                ""
                if parents is None
                else f"a root-to-node path of its tree (parents {parents[b][:p]}), "
            )
            raise ValueError(
                f"accepted_path: expected row {b}'s first {a} entries {tree}strictly increasing "
                f"within [0, {p}) (the pending drafts), got {path}"
            )


def _tensor_key(t: torch.Tensor) -> tuple:
    return (str(t.device), t.data_ptr())
