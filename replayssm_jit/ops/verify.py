"""Speculative decoding on caller-owned tensors: verify draft tokens, commit the accepted ones,
and the conventional snapshot baseline to measure against. The contract: docs/speculative.md.

    mamba2_verify(plan, state=, rec_x=, rec_b=, rec_dt=, cursors=, x=, dt=, A=, B=, C=, ...)
    gdn_verify / kda_verify(plan, state=, rec_u=, rec_k=, rec_g=, cursors=, q=, k=, v=, ...)
    commit_drafts(plan, tensors, num_accepted=, slot_indices=, accepted_path=None)
    mamba2_ / gdn_ / kda_snapshot_verify(plan, state=, ..., snapshot_slots=)
    commit_snapshots(plan, state=, snapshot_slots=, num_accepted=, slot_indices=)

The token inputs are those of ops/mamba2.py and ops/gdn.py with a draft dim (dim 1) of
T = plan.layout.drafts (2..8), each with any strides in its batch, draft and head dims (x, z, B,
C, q, k, v: a unit stride in the last dim and 16-byte aligned rows):
    Mamba-2  x, z [batch, T, H, P]; dt [batch, T, H] float32; B, C [batch, T, G, N]
    GDN      q, k [batch, T, H, K]; v [batch, T, HV, V]; a, b or g, beta [batch, T, HV] float32
    KDA      as GDN, with a or g [batch, T, HV, K] float32 (a decay per key channel)
    out          [batch, T, H, P] / [batch, T, HV, V], act dtype, contiguous
    num_drafts   [batch] int32 contiguous: drafts per row t in [0, T] (T for every row if None)
    parents      [batch, T] int32 contiguous: parents[b, j] in [-1, j) (a chain if None)
    num_accepted [batch] int32 contiguous: drafts of the previous verify to accept, in [0, p]
    accepted_path, snapshot_slots [batch, T] int32 contiguous
Verify and commit take plans of mode="replay"; the snapshot ops plans of either mode (their
kernels come with the verify kernels in the module of any plan whose layout has T >= 2).

Everything is checked before anything is written, so a call that raises changes nothing. The
values held on the device (draft counts, parents, accepted counts against the pending drafts,
paths, snapshot slots) are checked on the CPU backend and, on CUDA, with check_slot_values
outside a graph capture; otherwise the kernels clamp them as docs/speculative.md says.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from itertools import pairwise

import torch

from replayssm_jit.core.checks import TensorTags, check_tensor
from replayssm_jit.core.cursor_words import CURSOR_HELD, CURSOR_PENDING
from replayssm_jit.core.dtypes import MAX_VERIFY_DRAFTS
from replayssm_jit.families import GDN, KDA, MAMBA2
from replayssm_jit.families.base import Family
from replayssm_jit.families.schema import bind
from replayssm_jit.launch.policy import FLAG_SPLIT
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.decode import (
    check_cursors,
    check_inputs,
    check_plan,
    check_slot_tensors,
    commit_args,
    output_buffer,
    reads_device_values,
    resolve_seed,
    resolve_workspace,
    torch_scalars,
)
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.torch_path import Pool, Rows

__all__ = [
    "commit_drafts",
    "commit_snapshots",
    "gdn_snapshot_verify",
    "gdn_verify",
    "kda_snapshot_verify",
    "kda_verify",
    "mamba2_snapshot_verify",
    "mamba2_verify",
]

# ---------------------------------------------------------------------------------------------
# Checks shared by the ops
# ---------------------------------------------------------------------------------------------

# The num_accepted each pool's last verify took (by its cursors): commit_drafts given that same
# tensor would commit the previous verify's counts a second time, to this verify's drafts.
FUSED_FORM = TensorTags()


def _check_speculative_plan(plan: object, family: Family | None, mode: str | None, op: str) -> int:
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


def _check_index(
    plan: DecodePlan, name: str, t: object, per_row: tuple[int, ...], *, required: bool = False
) -> torch.Tensor | None:
    """An int32 [batch, *per_row] contiguous tensor on the plan's device, or None where allowed."""
    if t is None and not required:
        return None
    return check_tensor(name, t, shape=(plan.batch_size, *per_row), dtype=torch.int32,
                        device=plan.device, contiguous=True)  # fmt: skip


def _live_rows(plan: DecodePlan, slot_indices: torch.Tensor) -> list[tuple[int, int]]:
    """(batch row, slot) of the rows that are not pad rows (reads the ids from the device)."""
    return [(b, s) for b, s in enumerate(slot_indices.tolist()) if s != plan.pad_slot_id]


def _draft_counts(
    plan: DecodePlan, live: list[tuple[int, int]], num_drafts: torch.Tensor | None
) -> dict[int, int]:
    """t per live row, each checked in [0, T]."""
    T = plan.layout.drafts
    if num_drafts is None:
        return {b: T for b, _ in live}
    values = num_drafts.tolist()
    for b, _ in live:
        if not 0 <= values[b] <= T:
            raise ValueError(
                f"num_drafts: expected values in [0, {T}] (the layout's drafts), got "
                f"{values[b]} in row {b}"
            )
    return {b: values[b] for b, _ in live}


def _cursor_words(cursors: torch.Tensor, live: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Each live row's cursor words (n, epoch, scratch, p), read from the device."""
    words = cursors[[s for _, s in live]].tolist() if live else []
    return {b: w for (b, _), w in zip(live, words)}


def _cursor_valid(plan: DecodePlan, words: list[int]) -> bool:
    """A cursor that no step leaves is faulted by the kernels (NaN outputs), not checked here."""
    n, p, T = words[CURSOR_HELD], words[CURSOR_PENDING], plan.layout.drafts
    return n >= 0 and 0 <= p <= T and n + p < plan.layout.capacity


def _check_accepted(
    plan: DecodePlan,
    num_accepted: torch.Tensor,
    words: dict[int, list[int]],
) -> dict[int, int]:
    """a per live row in [0, p], p the row's pending drafts (cursor word 3); rows whose cursors
    are corrupted are the kernels' to fault."""
    values = num_accepted.tolist()
    for b, w in words.items():
        if _cursor_valid(plan, w) and not 0 <= values[b] <= w[3]:
            raise ValueError(
                f"num_accepted: expected values in [0, {w[3]}] (the pending drafts of the last "
                f"verify, cursor word 3), got {values[b]} in row {b}"
            )
    return {b: values[b] for b in words}


# ---------------------------------------------------------------------------------------------
# Verify
# ---------------------------------------------------------------------------------------------


def _verify(
    plan: DecodePlan,
    tensors: dict[str, torch.Tensor],
    inputs: dict[str, object],
    *,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    num_drafts: object,
    parents: object,
    num_accepted: object,
    seed: object,
    workspace: torch.Tensor | None,
    torch_verify,
) -> torch.Tensor:
    """Check the slot tensors, ids, draft tensors, workspace and seed (and the device values
    where read), then launch."""
    T = plan.layout.drafts
    scratch = workspace if isinstance(workspace, torch.Tensor) else None  # (checked below)
    num_drafts = _check_index(plan, "num_drafts", num_drafts, ())
    parents = _check_index(plan, "parents", parents, (T,))
    num_accepted = _check_index(plan, "num_accepted", num_accepted, ())
    index = {"num_drafts": num_drafts, "parents": parents, "num_accepted": num_accepted}
    seed_arg = seed if isinstance(seed, torch.Tensor) else None
    check_slot_tensors(plan, tensors, slot_indices, written={"out": out, "workspace": scratch},
                       read={**inputs, **index, "seed": seed_arg})  # fmt: skip
    seed_value, seed_tensor = resolve_seed(plan, seed)
    # Only the split verify reads a workspace: the per-item one allocates none per call.
    if workspace is not None or plan.verify_kernel == "split":
        workspace = resolve_workspace(plan, workspace, verify=True)
    if reads_device_values(plan):
        check_cursors(plan, tensors["cursors"], slot_indices, step=False)
        live = _live_rows(plan, slot_indices)
        drafts = _draft_counts(plan, live, num_drafts)
        if parents is not None:
            given = parents.tolist()
            for b, _ in live:
                for j in range(drafts[b]):
                    if not -1 <= given[b][j] < j:
                        raise ValueError(
                            f"parents: expected parents[{b}, {j}] in [-1, {j}) (an earlier draft "
                            f"or -1, the committed prefix), got {given[b][j]}"
                        )
        if num_accepted is not None:
            _check_accepted(plan, num_accepted, _cursor_words(tensors["cursors"], live))
    if num_accepted is None:
        FUSED_FORM.discard(tensors["cursors"])
    else:
        FUSED_FORM.set(tensors["cursors"], weakref.ref(num_accepted))
    if plan.backend == "cpu":
        ring_args = {name: tensors[name] for name in plan.layout.ring_names}
        pool = Pool.named({"state": tensors["state"], **ring_args, "cursors": tensors["cursors"]})
        torch_verify(
            torch_scalars(plan, seed_value, seed_tensor),
            pool,
            inputs,
            Rows(slot_indices, out, **index),
        )
        return out
    values = {
        **tensors, **inputs, **index, "out": out, "slot_indices": slot_indices,
        "pad_slot_id": plan.pad_slot_id, "seed": seed_value, "seed_tensor": seed_tensor,
        "rows": plan.verify_rows_per_cta, "workspace": workspace,
        "flags": FLAG_SPLIT if plan.verify_kernel == "split" else 0,
    }  # fmt: skip
    plan.module.verify_step(*bind(plan.family, "verify_step", values))
    return out


# Verification is inference: the kernels ignore autograd, and so does the CPU path.
@torch.no_grad()
def mamba2_verify(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
    rec_x: torch.Tensor,
    rec_b: torch.Tensor,
    rec_dt: torch.Tensor,
    cursors: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slot_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_drafts: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify T Mamba-2 draft tokens per row; returns out [batch, T, H, P] (allocated when None).

    First the fused commit of the previous verify's num_accepted (its pending drafts are dropped
    without it), then an early flush where the committed records and this row's drafts would
    leave the ring no free row. out[b, j] is the output of draft j after the committed records
    and its root path; zero for j >= num_drafts[b]. The drafts' records stay pending until a
    commit (commit_drafts, or the next verify's num_accepted). seed: as in mamba2_decode.
    workspace: float32, at least plan.workspace_floats elements: scratch the split verify
    overwrites (allocated when None and plan.verify_kernel is "split"; the per-item verify
    reads none).
    """
    # The arguments by name: the family's schema picks and checks its inputs among them.
    return _verify_op(plan, MAMBA2, "mamba2_verify", torch_path.mamba2_verify, locals())


@torch.no_grad()
def gdn_verify(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
    rec_u: torch.Tensor,
    rec_k: torch.Tensor,
    rec_g: torch.Tensor,
    cursors: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_indices: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_drafts: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify T GDN draft tokens per row; returns out [batch, T, HV, V] (allocated when None).

    Gates as in gdn_decode, with the draft dim. The rest as in mamba2_verify; each draft's
    correction u is computed along its own root path, so a tree's accepted path commits exactly.
    """
    return _verify_op(plan, GDN, "gdn_verify", torch_path.gdn_verify, locals())


@torch.no_grad()
def kda_verify(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
    rec_u: torch.Tensor,
    rec_k: torch.Tensor,
    rec_g: torch.Tensor,
    cursors: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_indices: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_drafts: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify T KDA draft tokens per row; returns out [batch, T, HV, V] (allocated when None).

    As gdn_verify, with KDA's gates (ops/kda.py) and a draft dim: a or g [batch, T, HV, K]
    (unit stride in K), b or beta [batch, T, HV], dt_bias [HV * K]. KDA verifies with the
    per-item kernel only (it reads no workspace).
    """
    return _verify_op(plan, KDA, "kda_verify", torch_path.kda_verify, locals())


def _verify_op(plan, family, op, torch_verify, args) -> torch.Tensor:
    """The body of every family's verify op: `args` are its arguments by name."""
    T = _check_speculative_plan(plan, family, "replay", op)
    shape = plan.layout.shape
    inputs = check_inputs(plan, (plan.batch_size, T), args)
    out = output_buffer(plan, args.get("out"), (T, shape.value_heads, shape.value_dim))
    tensors = {"state": args["state"], **{n: args[n] for n in plan.layout.ring_names},
               "cursors": args["cursors"]}  # fmt: skip
    return _verify(
        plan, tensors, inputs, out=out, slot_indices=args["slot_indices"],
        num_drafts=args.get("num_drafts"), parents=args.get("parents"),
        num_accepted=args.get("num_accepted"), seed=args.get("seed"),
        workspace=args.get("workspace"), torch_verify=torch_verify,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Commit
# ---------------------------------------------------------------------------------------------


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
    rings by name (the checkpoint may be there too; it is not touched). A mapping as the second
    positional argument is still accepted, in place of the keywords. num_accepted [batch]: a in
    [0, p], p the row's pending drafts. Chain (no accepted_path): drafts 0..a-1 become
    committed records. Tree: accepted_path[b, :a] lists the accepted root-to-node path, strictly
    increasing within [0, p), and with `parents` (the verify's [batch, T]; pass them) checked
    against the tree: path[0]'s parent is -1, path[i]'s is path[i - 1]; its records are first
    moved to the rows right after the committed ones. Pad rows and rejected drafts change
    nothing; nothing flushes. num_accepted may not be the tensor the last verify took as its
    fused commit (that would commit those counts twice; a host-side check, graphs included).
    Values on the device (counts, paths, parents, cursors) are checked in eager mode only, as
    in the verify ops.
    """
    _check_speculative_plan(plan, None, "replay", "commit_drafts")
    if tensors is not None and pool:
        raise TypeError(
            f"tensors: expected the pool either as a mapping or as keyword tensors, got both "
            f"(a mapping and {sorted(pool)})"
        )
    tensors = pool if tensors is None else tensors
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors: expected a mapping of the layout's tensors by name, "
            f"got {type(tensors).__name__}"
        )
    for name in (*plan.layout.ring_names, "cursors"):
        if tensors.get(name) is None:
            raise ValueError(f"tensors: expected the layout's {name!r} tensor, got none")
    T = plan.layout.drafts
    num_accepted = _check_index(plan, "num_accepted", num_accepted, (), required=True)
    accepted_path = _check_index(plan, "accepted_path", accepted_path, (T,))
    parents = _check_index(plan, "parents", parents, (T,))
    index = {"num_accepted": num_accepted, "accepted_path": accepted_path, "parents": parents}
    check_slot_tensors(plan, tensors, slot_indices, optional=("state",), read=index)
    fused = FUSED_FORM.get(tensors["cursors"])
    fused = fused() if fused is not None else None  # (None once that tensor is freed)
    if fused is not None and _tensor_key(fused) == _tensor_key(num_accepted):
        raise ValueError(
            "num_accepted: expected the counts of the last verify's drafts, got the tensor that "
            "verify took as its fused num_accepted (the previous verify's counts: committing "
            "them again would commit twice; pass num_accepted to the next step instead)"
        )
    if reads_device_values(plan):
        rows = check_cursors(plan, tensors["cursors"], slot_indices, step=False)
        words = {b: w for b, _, w in rows}
        accepted = _check_accepted(plan, num_accepted, words)
        if accepted_path is not None:
            tree = None if parents is None else parents.tolist()
            _check_paths(accepted_path.tolist(), tree, accepted, words)
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


# ---------------------------------------------------------------------------------------------
# The conventional spec baseline
# ---------------------------------------------------------------------------------------------


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
    tensors = {"state": state}
    optional = (*plan.layout.ring_names, "cursors")
    read = {**inputs, "snapshot_slots": snapshot_slots, "num_drafts": num_drafts}
    num_slots = check_slot_tensors(plan, tensors, slot_indices, optional=optional,
                                   written={"out": out}, read=read)  # fmt: skip
    snapshot_slots = _check_index(plan, "snapshot_slots", snapshot_slots, (T,), required=True)
    num_drafts = _check_index(plan, "num_drafts", num_drafts, ())
    if reads_device_values(plan):
        live = _live_rows(plan, slot_indices)
        written = {b: range(t) for b, t in _draft_counts(plan, live, num_drafts).items()}
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


@torch.no_grad()
def gdn_snapshot_verify(
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
    """The conventional GDN spec baseline; see mamba2_snapshot_verify. Returns out
    [batch, T, HV, V]."""
    return _snapshot_op(plan, GDN, "gdn_snapshot_verify", torch_path.gdn_snapshot, locals())


@torch.no_grad()
def kda_snapshot_verify(
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
    """The conventional KDA spec baseline; see mamba2_snapshot_verify, gates as kda_verify's.
    Returns out [batch, T, HV, V]."""
    return _snapshot_op(plan, KDA, "kda_snapshot_verify", torch_path.kda_snapshot, locals())


def _snapshot_op(plan, family, op, torch_snapshot, args) -> torch.Tensor:
    """The body of every family's snapshot verify: `args` are its arguments by name."""
    T = _check_speculative_plan(plan, family, None, op)
    shape = plan.layout.shape
    inputs = check_inputs(plan, (plan.batch_size, T), args)
    out = output_buffer(plan, args.get("out"), (T, shape.value_heads, shape.value_dim))
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
    T = _check_speculative_plan(plan, None, None, "commit_snapshots")
    optional = (*plan.layout.ring_names, "cursors")
    read = {"snapshot_slots": snapshot_slots, "num_accepted": num_accepted}
    num_slots = check_slot_tensors(plan, {"state": state}, slot_indices, optional=optional,
                                   read=read)  # fmt: skip
    snapshot_slots = _check_index(plan, "snapshot_slots", snapshot_slots, (T,), required=True)
    num_accepted = _check_index(plan, "num_accepted", num_accepted, (), required=True)
    if reads_device_values(plan):
        live = _live_rows(plan, slot_indices)
        values = num_accepted.tolist()
        for b, _ in live:
            if not 0 <= values[b] <= T:
                raise ValueError(
                    f"num_accepted: expected values in [0, {T}] (the layout's drafts), got "
                    f"{values[b]} in row {b}"
                )
        read = {b: range(values[b] - 1, values[b]) if values[b] else range(0) for b, _ in live}
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
