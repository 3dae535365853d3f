"""The conventional spec baseline to measure verify against (docs/speculative.md): each row runs
its drafts as a chain of conventional steps into snapshot slots; commit_snapshots copies the
accepted one back. Plans of either mode."""

from __future__ import annotations

from collections.abc import Callable

import torch

from replayssm_jit.families import GDN, KDA, MAMBA2, Family
from replayssm_jit.families.schema import bind
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.decode import (
    check_slot_tensors,
    live_rows,
    reads_device_values,
    torch_scalars,
)
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.speculative import (
    check_draft_op,
    check_index,
    check_speculative_plan,
    draft_bounded,
    draft_counts,
)
from replayssm_jit.ops.torch_path import Rows

__all__ = [
    "commit_snapshots",
    "gdn_snapshot_verify",
    "kda_snapshot_verify",
    "mamba2_snapshot_verify",
]


def _check_snapshot_slots(
    plan: DecodePlan,
    num_slots: int,
    live: list[tuple[int, int]],
    snapshot_slots: torch.Tensor,
    used: dict[int, range],
    *,
    distinct: bool,
) -> None:
    """snapshot_slots[b, j] for j in used[b] of each live row: real slots, none a live row's
    slot, and (with `distinct`, where they are written) none twice."""
    given = snapshot_slots.tolist()
    live_slots = {s for _, s in live}
    seen: dict[int, tuple[int, int]] = {}
    for b, _ in live:
        for j in used[b]:
            s = given[b][j]
            where = f"snapshot_slots[{b}, {j}]"
            if not 0 <= s < num_slots or s == plan.pad_slot_id:
                raise ValueError(
                    f"snapshot_slots: expected {where} in [0, {num_slots}) other than "
                    f"pad_slot_id={plan.pad_slot_id}, got {s}"
                )
            if s in live_slots:
                raise ValueError(
                    f"snapshot_slots: expected {where} to be no row's slot_indices entry, "
                    f"got slot {s}"
                )
            if distinct and s in seen:
                raise ValueError(
                    f"snapshot_slots: expected distinct slots, got slot {s} at {where} and at "
                    f"snapshot_slots[{seen[s][0]}, {seen[s][1]}]"
                )
            seen[s] = (b, j)


def _check_one_copy(plan: DecodePlan, op: str) -> None:
    """The baseline copies plain state slots: a one-copy f32/bf16/f16 checkpoint (e4m3/NVFP4
    copies and read copies take verify and commit_drafts only)."""
    if plan.layout.checkpoint_names != ("state",):
        raise ValueError(
            f"plan: expected a layout with one f32/bf16/f16 checkpoint for {op} (the conventional "
            f"baseline copies plain state slots), got checkpoint tensors "
            f"{list(plan.layout.checkpoint_names)}"
        )


def _snapshot(
    plan: DecodePlan,
    state: torch.Tensor,
    inputs: dict[str, object],
    *,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    snapshot_slots: object,
    num_drafts: object,
    torch_snapshot,
) -> torch.Tensor:
    T = plan.layout.drafts
    _check_one_copy(plan, "the snapshot verify")
    tensors = {"state": state}
    optional = (*plan.layout.ring_names, "cursors")
    read = {**inputs, "snapshot_slots": snapshot_slots, "num_drafts": num_drafts}
    num_slots = check_slot_tensors(plan, tensors, slot_indices, optional=optional,
                                   written={"out": out}, read=read)  # fmt: skip
    snapshot_slots = check_index(plan, "snapshot_slots", snapshot_slots, (T,), required=True)
    num_drafts = check_index(plan, "num_drafts", num_drafts, ())
    if reads_device_values(plan):
        live = live_rows(plan, slot_indices)
        written = {b: range(t) for b, t in draft_counts(plan, live, num_drafts).items()}
        _check_snapshot_slots(plan, num_slots, live, snapshot_slots, written, distinct=True)
    if plan.backend == "cpu":
        rows = Rows(slot_indices, out, num_drafts=num_drafts, snapshot_slots=snapshot_slots)
        torch_snapshot(torch_scalars(plan, plan.seed, None), state, inputs, rows)
        return out
    values = {
        **inputs, "state": state, "out": out, "slot_indices": slot_indices,
        "snapshot_slots": snapshot_slots, "pad_slot_id": plan.pad_slot_id,
        "num_drafts": num_drafts, "rows": plan.verify_rows_per_cta,
    }  # fmt: skip
    plan.module.snapshot_step(*bind(plan.family, "snapshot_step", values))
    return out


@torch.no_grad()
def mamba2_snapshot_verify(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slot_indices: torch.Tensor,
    snapshot_slots: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_drafts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The conventional spec baseline (a plan of either mode): per row, read
    state[slot_indices[b]] once, run the t drafts as a chain of conventional steps, and write the
    state after draft j into state[snapshot_slots[b, j]] (slots the caller reserves: none a
    row's own, each once). Returns out [batch, T, H, P], zero for j >= t. The row's own state is
    not written: commit_snapshots copies the accepted snapshot into it.
    """
    # The arguments by name: the family's schema picks and checks its inputs among them.
    return _snapshot_op(
        plan, MAMBA2, "mamba2_snapshot_verify", torch_path.mamba2_snapshot, locals()
    )


def _delta_snapshot_verify(family: Family, torch_snapshot: Callable[..., None], doc: str):
    """The snapshot verify of a delta-rule family (GDN, KDA): both take the same arguments by
    name; the family's schema checks its gates' shapes."""
    name = f"{family.name}_snapshot_verify"

    @torch.no_grad()
    def snapshot_verify(
        plan: DecodePlan,
        *,
        state: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_indices: torch.Tensor,
        snapshot_slots: torch.Tensor,
        a: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
        A_log: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        g: torch.Tensor | None = None,
        beta: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        num_drafts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # The arguments by name (locals() also lists the closure's names, none an argument's).
        return _snapshot_op(plan, family, name, torch_snapshot, locals())

    snapshot_verify.__name__ = snapshot_verify.__qualname__ = name
    snapshot_verify.__doc__ = doc
    return snapshot_verify


gdn_snapshot_verify = _delta_snapshot_verify(
    GDN,
    torch_path.gdn_snapshot,
    """The conventional GDN spec baseline; see mamba2_snapshot_verify. Returns out
    [batch, T, HV, V].""",
)
kda_snapshot_verify = _delta_snapshot_verify(
    KDA,
    torch_path.kda_snapshot,
    """The conventional KDA spec baseline; see mamba2_snapshot_verify, gates as kda_verify's.
    Returns out [batch, T, HV, V].""",
)


def _snapshot_op(plan, family, op, torch_snapshot, args) -> torch.Tensor:
    """The body of every family's snapshot verify: `args` are its arguments by name."""
    inputs, out = check_draft_op(plan, family, None, op, args)
    return _snapshot(plan, args["state"], inputs, out=out, slot_indices=args["slot_indices"],
                     snapshot_slots=args["snapshot_slots"], num_drafts=args.get("num_drafts"),
                     torch_snapshot=torch_snapshot)  # fmt: skip


@torch.no_grad()
def commit_snapshots(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
    snapshot_slots: torch.Tensor,
    num_accepted: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """Accept the snapshot baseline's drafts: state[slot_indices[b]] <- state[snapshot_slots[b,
    a - 1]] for each row with a = num_accepted[b] >= 1 that is not a pad row (a clamped to
    [0, T] on the device). Torch ops only, with no host sync (where values are not checked), so
    it can be captured in a CUDA graph.
    """
    T = check_speculative_plan(plan, None, None, "commit_snapshots")
    _check_one_copy(plan, "commit_snapshots")
    optional = (*plan.layout.ring_names, "cursors")
    read = {"snapshot_slots": snapshot_slots, "num_accepted": num_accepted}
    num_slots = check_slot_tensors(plan, {"state": state}, slot_indices, optional=optional,
                                   read=read)  # fmt: skip
    snapshot_slots = check_index(plan, "snapshot_slots", snapshot_slots, (T,), required=True)
    num_accepted = check_index(plan, "num_accepted", num_accepted, (), required=True)
    if reads_device_values(plan):
        live = live_rows(plan, slot_indices)
        counts = draft_bounded(plan, "num_accepted", num_accepted, live)
        read = {b: range(a - 1, a) if a else range(0) for b, a in counts.items()}
        _check_snapshot_slots(plan, num_slots, live, snapshot_slots, read, distinct=False)
    accepted = num_accepted.long().clamp(0, T)
    dst = slot_indices.long()
    src = snapshot_slots.long().gather(1, (accepted - 1).clamp(min=0)[:, None]).squeeze(1)
    copy = (accepted > 0) & (dst != plan.pad_slot_id)
    # Rows that copy nothing copy one slot onto itself instead, so that the launch keeps a fixed
    # shape: a source of a copying row (read, never written) or, if no row copies, slot 0.
    first = torch.argmax(copy.to(torch.int32)).view(1)  # (a tensor index: no .item() sync)
    anchor = torch.where(copy.any(), src.index_select(0, first), torch.zeros_like(first))
    dst = torch.where(copy, dst, anchor)
    src = torch.where(copy, src, anchor)
    state.index_copy_(0, dst, state.index_select(0, src))
