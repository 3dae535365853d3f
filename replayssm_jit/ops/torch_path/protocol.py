"""The step protocol on the torch path, written once for every family: pad rows, the cursor read
and its validity check, the fused commit, the flush decision, then per group of rows the
family's maths (a `compute` callback), then the epoch and cursor advance; commit; and the
snapshot baseline's row loop. Its CUDA twin is templates/common/step.cuh, which every kernel
sequences; docs/speculative.md is the verify's contract.

Per batch row b with slot s = slot_indices[b]:
  * s == pad_slot_id: out[b] = 0; nothing else is read or written.
  * A corrupted cursor (no launch leaves one): out[b] = NaN; nothing else is read or written
    (the kernels' held_count_valid guard). A step accepts n in [0, L) without drafts, [0, L + T)
    with them; a verify and a commit n >= 0, p in [0, T] and n + p < L + T.
  * A step: with j = n + 1 records, the row flushes when j >= L, in flush-every-step mode, or
    where flush_mask[b] is nonzero (a plan with the flush_mask flag).
    Cursor afterwards: in flush-every-step mode without "sr", a row that held nothing only
    advances the epoch (finish_step_cursor leaves words 0 and 2); otherwise (0 after a flush else
    j, epoch + 1 after a flush, 0, 0): a step drops pending drafts uncommitted.
  * A verify: n <- n + clamp(num_accepted[b], 0, p) (the fused commit); t = clamp(num_drafts[b],
    0, T); the row flushes its n records first when n + t >= L + T. Cursor afterwards (0 after a
    flush else n, epoch + 1 after a flush, 0, t).
Rows are grouped by (n, flush) and each group is computed at once, vectorised over rows and
heads. Slots must be distinct among non-pad rows (the callers check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from replayssm_jit.core.cursor_words import (
    CURSOR_ARRIVALS,
    CURSOR_EPOCH,
    CURSOR_HELD,
    CURSOR_PENDING,
)
from replayssm_jit.ops.torch_path.checkpoint import Copy, RoundingKey, load_state, store_flush

__all__ = [
    "Group",
    "Pool",
    "Rows",
    "StepScalars",
    "commit",
    "run_snapshot",
    "run_step",
    "run_verify",
]

_F32 = torch.float32


@dataclass(frozen=True)
class StepScalars:
    """The scalars a step takes besides its tensors, as the module's bindings do: ReplaySSM or
    conventional, flush-every-step mode, the window L, the spec's flags, the pad slot id, the
    stochastic-rounding seed and the layout's drafts T (the ring holds L + T rows)."""

    replay: bool
    flush_every_step: bool
    window: int
    flags: frozenset[str]  # the spec's, checked against its Family.flags when it was made
    pad_slot_id: int
    seed: int
    drafts: int = 1

    @property
    def held_limit(self) -> int:
        """One past the largest held count a standard step may find: L - 1 without drafts, else
        L + T - 1 (a verify that did not flush leaves n + t <= L + T - 1, then a commit)."""
        return self.window if self.drafts == 1 else self.window + self.drafts

    @property
    def stochastic(self) -> bool:
        return "sr" in self.flags

    def rounding(self, epochs: torch.Tensor) -> RoundingKey | None:
        """The carried copy's rounding key for rows at `epochs` (None: round to nearest)."""
        return RoundingKey(self.seed, epochs) if self.stochastic else None


@dataclass(frozen=True)
class Pool:
    """The slot tensors a launch takes: the carried checkpoint copy (None for a commit), separate
    mode's read copy (or None), the rings by name (None where a conventional step takes none) and the cursors."""

    state: Copy | None
    read: Copy | None
    rings: dict[str, torch.Tensor | None]
    cursors: torch.Tensor | None

    @classmethod
    def named(cls, tensors: dict[str, torch.Tensor | None]) -> Pool:
        """A pool from a layout's tensors by name (state, its scales, read_state, its scales,
        each ring rec_*, cursors)."""
        rings = {k: t for k, t in tensors.items() if k.startswith("rec_")}
        return cls(Copy.named(tensors, "state"), Copy.named(tensors, "read"), rings,
                   tensors.get("cursors"))  # fmt: skip


@dataclass(frozen=True)
class Rows:
    """The batch: each row's slot, the output buffer (None for a commit), and the per-row
    tensors a step (flush_mask), a verify, a commit or the snapshot baseline takes, None where
    not given."""

    slot_indices: torch.Tensor
    out: torch.Tensor | None = None
    num_drafts: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    num_accepted: torch.Tensor | None = None
    snapshot_slots: torch.Tensor | None = None
    flush_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class Group:
    """Rows of one launch that hold the same record count and take the same flush decision:
    their batch rows and slots, n (after a verify's fused commit), whether they flush, the
    epochs their stochastic rounding is keyed by (0 without "sr") and, for a verify, each row's
    draft count t and draft ancestry [rows, T, T]."""

    rows: torch.Tensor
    slots: torch.Tensor
    held: int
    flush: bool
    epochs: torch.Tensor
    drafts: torch.Tensor | None = None
    ancestors: torch.Tensor | None = None


# The family's maths for one group: its state, ring and out writes.
Compute = Callable[[Group], None]


def _cursor_words(cursors: torch.Tensor, slots: torch.Tensor):
    """(n, epoch, p) of each slot's cursor, int64, read before anything is written."""
    words = cursors[slots].to(torch.int64)
    return words[:, CURSOR_HELD], words[:, CURSOR_EPOCH], words[:, CURSOR_PENDING]


def _cursor_valid(setup: StepScalars, held, pending, verify: bool) -> torch.Tensor:
    """Whether each cursor is one a launch may leave (module notes), for a standard step or for
    a verify and a commit."""
    if not verify:
        return (held >= 0) & (held < setup.held_limit)
    capacity = setup.window + setup.drafts
    return (held >= 0) & (pending >= 0) & (pending <= setup.drafts) & (held + pending < capacity)


def _ancestors(parents: torch.Tensor | None, rows: int, drafts: int, device) -> torch.Tensor:
    """[rows, T, T] bool: [r, j, i] = draft i is draft j or one of its ancestors. parents: [rows,
    T] int64 or None (a chain); a parent outside [-1, j) counts as -1, as the kernels clamp it."""
    index = torch.arange(drafts, device=device)
    if parents is None:
        parents = (index - 1).expand(rows, drafts)
    parents = torch.where((parents >= -1) & (parents < index), parents, -1)
    anc = torch.zeros((rows, drafts, drafts), dtype=torch.bool, device=device)
    every = torch.arange(rows, device=device)
    for j in range(drafts):  # a parent's row is complete before its children's (parent < j)
        p = parents[:, j]
        inherited = anc[every, p.clamp(min=0)] & (p >= 0)[:, None]
        anc[:, j] = inherited | (index == j)
    return anc


def _run(setup: StepScalars, pool: Pool, rows: Rows, compute: Compute, verify: bool) -> None:
    """The protocol of one step (verify=False) or verify launch: module notes."""
    out, T = rows.out, setup.drafts
    slot_of_row = rows.slot_indices.to(device=out.device, dtype=torch.int64)
    pad = slot_of_row == setup.pad_slot_id
    live = torch.nonzero(~pad).flatten()
    slots = slot_of_row[live]
    if not setup.replay:  # conventional: one step of each state, no cursors
        out[pad] = 0
        if live.numel():
            compute(Group(live, slots, 0, True, torch.zeros_like(slots)))
        return
    cursors = pool.cursors
    if cursors is None:
        raise ValueError("cursors: expected a tensor in replay mode, got None")
    held, epoch, pending = _cursor_words(cursors, slots)
    valid = _cursor_valid(setup, held, pending, verify)
    out[pad] = 0
    out[live[~valid]] = float("nan")
    live, slots, held, epoch, pending = (v[valid] for v in (live, slots, held, epoch, pending))
    drafts = anc = None
    if verify:
        if rows.num_accepted is not None:  # the fused commit of the last verify
            accepted = rows.num_accepted.to(out.device, torch.int64)[live].clamp(min=0)
            held = held + torch.minimum(accepted, pending)
        if rows.num_drafts is None:
            drafts = torch.full_like(held, T)
        else:
            drafts = rows.num_drafts.to(out.device, torch.int64)[live].clamp(0, T)
        flush = held + drafts >= setup.window + T
        given = None if rows.parents is None else rows.parents.to(out.device, torch.int64)[live]
        anc = _ancestors(given, live.numel(), T, out.device)
    else:
        flush = (held + 1 >= setup.window) | setup.flush_every_step
        if rows.flush_mask is not None:  # (step.cuh's flush_masked)
            flush = flush | (rows.flush_mask.to(out.device)[live] != 0)
    for n, f in sorted(set(zip(held.tolist(), flush.tolist()))):
        members = (held == n) & (flush == f)
        group_slots = slots[members]
        epochs = epoch[members] if setup.stochastic else torch.zeros_like(group_slots)
        group_drafts = None if drafts is None else drafts[members]
        compute(Group(live[members], group_slots, n, f, epochs, group_drafts,
                      None if anc is None else anc[members]))  # fmt: skip
        # A step adds its token's record; a verify's drafts stay pending (word 3).
        after = n if verify else n + 1
        if not verify and not setup.stochastic and setup.flush_every_step and n == 0:
            # finish_step_cursor's epoch-only advance: words 0 and 2 stay as they were
            cursors[group_slots, CURSOR_EPOCH] = cursors[group_slots, CURSOR_EPOCH] + 1
        else:
            cursors[group_slots, CURSOR_HELD] = 0 if f else after
            if f:  # (int32 wraps)
                cursors[group_slots, CURSOR_EPOCH] = cursors[group_slots, CURSOR_EPOCH] + 1
            cursors[group_slots, CURSOR_ARRIVALS] = 0
        cursors[group_slots, CURSOR_PENDING] = (
            group_drafts.to(cursors.dtype) if verify else 0
        )  # a step drops pending drafts, never commits them


def run_step(setup: StepScalars, pool: Pool, rows: Rows, compute: Compute) -> None:
    """One decode step (conventional or ReplaySSM) of every row: `compute` per group."""
    _run(setup, pool, rows, compute, verify=False)


def run_verify(setup: StepScalars, pool: Pool, rows: Rows, compute: Compute) -> None:
    """One verify of every row's drafts (with the fused commit): `compute` per group."""
    _run(setup, pool, rows, compute, verify=True)


def verify_states(
    setup: StepScalars,
    pool: Pool,
    group: Group,
    fold: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
) -> tuple[torch.Tensor, int]:
    """A verify group's FP32 states and the records they still hold. A group that does not
    flush reads what a non-flush step reads: separate mode's read copy, else the checkpoint,
    decoded. One that flushes early loads the carried copy, folds its committed records (never
    the drafts: fold(s, slots, n)), stores it and the read copy as a step's flush does
    (store_flush), and replays the drafts from the folded FP32 values, holding none."""
    if not group.flush:
        reads = pool.state if pool.read is None else pool.read
        return load_state(reads, group.slots), group.held
    s = fold(load_state(pool.state, group.slots), group.slots, group.held)
    store_flush(pool.state, pool.read, group.slots, s, setup.rounding(group.epochs),
                "read_rn" in setup.flags)  # fmt: skip
    return s, 0


def commit(setup: StepScalars, pool: Pool, rows: Rows,
           accepted_path: torch.Tensor | None) -> None:  # fmt: skip
    """Commit the accepted drafts of the last verify, as the module's commit_step binding does.

    rows.num_accepted [batch] int; accepted_path [batch, T] int or None. Per row (pad rows and
    corrupted cursors are left alone): a = clamp(num_accepted[b], 0, p). A tree path (indices
    clamped to [0, p)) is compacted first: for i < a in order, every ring's row n + path[i] is
    copied to row n + i. Then word 0 = n + a and word 3 = 0; words 1 and 2 stay.
    """
    cursors = pool.cursors
    slot_of_row = rows.slot_indices.to(device=cursors.device, dtype=torch.int64)
    live = torch.nonzero(slot_of_row != setup.pad_slot_id).flatten()
    slots = slot_of_row[live]
    held, _, pending = _cursor_words(cursors, slots)
    valid = _cursor_valid(setup, held, pending, verify=True)
    live, slots, held, pending = live[valid], slots[valid], held[valid], pending[valid]
    accepted = rows.num_accepted.to(cursors.device, torch.int64)[live].clamp(min=0)
    accepted = torch.minimum(accepted, pending)
    if accepted_path is not None:
        path = accepted_path.to(cursors.device, torch.int64)[live].clamp(min=0)
        path = torch.minimum(path, (pending - 1).clamp(min=0)[:, None])
        for i in range(path.shape[1]):
            m = accepted > i
            if not bool(m.any()):
                break
            src, dst = held[m] + path[m, i], held[m] + i
            for ring in pool.rings.values():  # (the gather copies before the row is written)
                ring[slots[m], :, dst] = ring[slots[m], :, src]
    cursors[slots, CURSOR_HELD] = (held + accepted).to(cursors.dtype)
    cursors[slots, CURSOR_PENDING] = 0


# token(s, rows, j, live) -> (y, s): one conventional step of draft j from FP32 states s.
Token = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def run_snapshot(setup: StepScalars, state: torch.Tensor, rows: Rows, token: Token) -> None:
    """The conventional spec baseline's rows: pad rows zero, the others read state[slot] once and
    run their t drafts as a chain, writing the state after draft j (rounded to nearest: the
    binding takes no seed) into state[snapshot_slots[b, j]] (skipped where that id is out of
    range, as the kernels do) and out[b, j]; out[b, j >= t] = 0."""
    out, T = rows.out, setup.drafts
    slot_of_row = rows.slot_indices.to(device=out.device, dtype=torch.int64)
    pad = slot_of_row == setup.pad_slot_id
    out[pad] = 0
    live_rows = torch.nonzero(~pad).flatten()
    if rows.num_drafts is None:
        drafts = torch.full((live_rows.numel(),), T, dtype=torch.int64, device=out.device)
    else:
        drafts = rows.num_drafts.to(out.device, torch.int64)[live_rows].clamp(0, T)
    live = live_drafts(drafts, T)
    targets = rows.snapshot_slots.to(out.device, torch.int64)[live_rows]
    written = live & (targets >= 0) & (targets < state.shape[0])
    s = state[slot_of_row[live_rows]].to(_F32)
    outs = []
    for j in range(T):
        y, s = token(s, live_rows, j, live)
        state[targets[written[:, j], j]] = s[written[:, j]].to(state.dtype)
        outs.append(torch.where(live[:, j].view(-1, *([1] * (y.dim() - 1))), y, 0.0))
    out[live_rows] = torch.stack(outs, dim=1).to(out.dtype)


# ---------------------------------------------------------------------------------------------
# Ring and draft rows, and the decays every family folds with
# ---------------------------------------------------------------------------------------------


def with_current(ring: torch.Tensor | None, slots, held: int, current: torch.Tensor):
    """The held ring rows [rows, heads, held, ...] of `slots` (as FP32) followed by this token's
    row `current` [rows, heads, ...]: [rows, heads, held + 1, ...]."""
    current = current.to(_F32).unsqueeze(2)
    if held == 0:
        return current
    return torch.cat([ring[slots, :, :held].to(_F32), current], dim=2)


def held_rows(ring: torch.Tensor, slots, held: int) -> torch.Tensor:
    """The held ring rows [rows, heads, held, ...] of `slots` as FP32."""
    return ring[slots, :, :held].to(_F32)


def live_drafts(drafts: torch.Tensor, T: int) -> torch.Tensor:
    """[rows, T] bool: draft j < t of its row."""
    return torch.arange(T, device=drafts.device) < drafts[:, None]


def draft_inputs(t: torch.Tensor, rows: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """FP32 rows of a [batch, T, ...] input, zero past each row's t: unused drafts' inputs (any
    bits, NaN included) never reach a sum."""
    v = t[rows].to(_F32)
    mask = live.view(*live.shape, *([1] * (v.dim() - 2)))
    return torch.where(mask, v, torch.zeros((), dtype=_F32))


def window_mask(held: int, anc: torch.Tensor) -> torch.Tensor:
    """[rows, T, held + T] bool: what draft j replays, the committed records then its path."""
    committed = torch.ones((*anc.shape[:2], held), dtype=torch.bool, device=anc.device)
    return torch.cat([committed, anc], dim=-1)


def write_draft_records(slots: torch.Tensor, held: int, live: torch.Tensor,
                        records: list[tuple[torch.Tensor, torch.Tensor]]) -> None:  # fmt: skip
    """Draft j's record at ring row held + j of each row with j < t. records: (ring, its values
    [rows, T, ...] per draft)."""
    for j in range(live.shape[1]):
        m = live[:, j]
        if not bool(m.any()):
            break  # (live drafts are a prefix of each row)
        for ring, values in records:
            ring[slots[m], :, held + j] = values[m, j].to(ring.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """The kernels' softplus: x above 20, else log1p(exp(x))."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def suffix_decays(log_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For log_decay [..., j]: decay [..., j], decay[i] = exp(sum_{m>i} log_decay[m]) (the last
    is 1), and total [...] = exp(sum of all), each the exp of one FP32 suffix sum."""
    inclusive = log_decay.flip(-1).cumsum(-1).flip(-1)  # inclusive[i] = sum_{m>=i}
    exclusive = torch.cat([inclusive[..., 1:], torch.zeros_like(inclusive[..., :1])], dim=-1)
    return torch.exp(exclusive), torch.exp(inclusive[..., 0])
