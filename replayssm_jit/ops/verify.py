"""Speculative decoding on caller-owned tensors: verify draft tokens, commit the accepted ones,
and the conventional snapshot baseline to measure against. The contract: docs/speculative.md.
This module holds the verify ops; ops/commit.py commit_drafts, ops/snapshot.py the baseline, and
it re-exports both, so that the speculative ops keep one import path.

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
from collections.abc import Callable

import torch

from replayssm_jit.families import GDN, KDA, MAMBA2, Family
from replayssm_jit.families.schema import CHECKPOINT_NAMES, bind
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.commit import commit_drafts
from replayssm_jit.ops.decode import (
    check_cursors,
    check_slot_tensors,
    reads_device_values,
    resolve_seed,
    resolve_workspace,
    slot_tensors,
    torch_scalars,
)
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.snapshot import (
    commit_snapshots,
    gdn_snapshot_verify,
    kda_snapshot_verify,
    mamba2_snapshot_verify,
)
from replayssm_jit.ops.speculative import (
    FUSED_FORM,
    chain_prefix,
    check_accepted,
    check_chain_commit,
    check_draft_op,
    check_index,
    draft_counts,
    note_pending_trees,
)
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
    num_drafts = check_index(plan, "num_drafts", num_drafts, ())
    parents = check_index(plan, "parents", parents, (T,))
    num_accepted = check_index(plan, "num_accepted", num_accepted, ())
    index = {"num_drafts": num_drafts, "parents": parents, "num_accepted": num_accepted}
    seed_arg = seed if isinstance(seed, torch.Tensor) else None
    check_slot_tensors(plan, tensors, slot_indices, written={"out": out, "workspace": scratch},
                       read={**inputs, **index, "seed": seed_arg})  # fmt: skip
    seed_value, seed_tensor = resolve_seed(plan, seed)
    # Only the split verify reads a workspace: the per-item one allocates none per call.
    if workspace is not None or plan.verify_kernel == "split":
        workspace = resolve_workspace(plan, workspace, verify=True)
    trees = None  # {slot: chain prefix of its tree, None for a chain}, where the ids are read
    if reads_device_values(plan):
        rows = check_cursors(plan, tensors["cursors"], slot_indices, step=False)
        live = [(b, slot) for b, slot, _ in rows]  # (one read of the ids and cursors)
        drafts = draft_counts(plan, live, num_drafts)
        trees = {slot: None for _, slot in live}
        if parents is not None:
            given = parents.tolist()
            for b, slot in live:
                for j in range(drafts[b]):
                    if not -1 <= given[b][j] < j:
                        raise ValueError(
                            f"parents: expected parents[{b}, {j}] in [-1, {j}) (an earlier draft "
                            f"or -1, the committed prefix), got {given[b][j]}"
                        )
                prefix = chain_prefix(given[b], drafts[b])
                trees[slot] = prefix if prefix < drafts[b] else None
        if num_accepted is not None:  # (a fused commit is a chain commit)
            fused = check_accepted(plan, num_accepted, {b: w for b, _, w in rows})
            check_chain_commit(tensors["cursors"], fused, dict(live), "num_accepted")
    note_pending_trees(tensors["cursors"], trees)
    if num_accepted is None:
        FUSED_FORM.discard(tensors["cursors"])
    else:
        FUSED_FORM.set(tensors["cursors"], weakref.ref(num_accepted))
    if plan.backend == "cpu":
        pool = Pool.named(tensors)  # (the checkpoint copies, every ring and the cursors)
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
        "flags": plan.verify_flag_bits,
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
    state_scale: torch.Tensor | None = None,
    read_state: torch.Tensor | None = None,
    read_scale: torch.Tensor | None = None,
    state_block_scale: torch.Tensor | None = None,
    read_block_scale: torch.Tensor | None = None,
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
    reads none). The checkpoint as in mamba2_decode: state_scale, state_block_scale, read_state,
    read_scale and read_block_scale where the layout has them (layout.checkpoint_names). A row
    that does not flush reads the read copy in separate mode (else the checkpoint), as a
    non-flush step does; an early flush folds into the carried copy in its format and rewrites
    the read copy. e4m3/NVFP4 checkpoints and read copies verify on the torch path (CPU plans)
    only: plan_decode refuses their CUDA modules with drafts (not built yet).
    """
    # The arguments by name: the family's schema picks and checks its inputs among them.
    return _verify_op(plan, MAMBA2, "mamba2_verify", torch_path.mamba2_verify, locals())


def _delta_verify(family: Family, torch_verify: Callable[..., None], doc: str):
    """The verify op of a delta-rule family (GDN, KDA): both take the same arguments by name;
    the family's schema checks its gates' shapes."""
    name = f"{family.name}_verify"

    @torch.no_grad()
    def verify(
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
        state_scale: torch.Tensor | None = None,
        read_state: torch.Tensor | None = None,
        read_scale: torch.Tensor | None = None,
        state_block_scale: torch.Tensor | None = None,
        read_block_scale: torch.Tensor | None = None,
        rec_v: torch.Tensor | None = None,
        rec_beta: torch.Tensor | None = None,
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
        # The arguments by name (locals() also lists the closure's names, none an argument's).
        return _verify_op(plan, family, name, torch_verify, locals())

    verify.__name__ = verify.__qualname__ = name
    verify.__doc__ = doc
    return verify


gdn_verify = _delta_verify(
    GDN,
    torch_path.gdn_verify,
    """Verify T GDN draft tokens per row; returns out [batch, T, HV, V] (allocated when None).

    Gates as in gdn_decode, with the draft dim. The rest as in mamba2_verify; each draft's
    correction u is computed along its own root path, so a tree's accepted path commits exactly.
    Separate mode also takes rec_v and rec_beta (the drafts' v and beta are recorded there), and
    an early flush recomputes the committed u's from the carried copy, as a step's flush does.
    """,
)
kda_verify = _delta_verify(
    KDA,
    torch_path.kda_verify,
    """Verify T KDA draft tokens per row; returns out [batch, T, HV, V] (allocated when None).

    As gdn_verify, with KDA's gates (ops/kda.py) and a draft dim: a or g [batch, T, HV, K]
    (unit stride in K), b or beta [batch, T, HV], dt_bias [HV * K]. KDA verifies with the
    per-item kernel only (it reads no workspace).
    """,
)


def _verify_op(plan, family, op, torch_verify, args) -> torch.Tensor:
    """The body of every family's verify op: `args` are its arguments by name."""
    inputs, out = check_draft_op(plan, family, "replay", op, args)
    tensors = slot_tensors(family, args, (*CHECKPOINT_NAMES, "cursors"))
    return _verify(
        plan, tensors, inputs, out=out, slot_indices=args["slot_indices"],
        num_drafts=args.get("num_drafts"), parents=args.get("parents"),
        num_accepted=args.get("num_accepted"), seed=args.get("seed"),
        workspace=args.get("workspace"), torch_verify=torch_verify,
    )  # fmt: skip
