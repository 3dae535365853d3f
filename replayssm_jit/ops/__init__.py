"""Functional ops on caller-owned tensors: the only place a kernel is launched.

    plan = plan_decode(layout, batch_size, device=..., mode="replay", config=LaunchConfig())
    mamba2_decode(plan, state=..., rec_x=..., rec_b=..., rec_dt=..., cursors=..., x=..., ...)
    gdn_decode(plan, state=..., rec_u=..., rec_k=..., rec_g=..., cursors=..., q=..., ...)
    kda_decode(plan, ...)                  as gdn_decode, with a decay per key channel
    reset_slots(layout, tensors, slots, initial_state=None)   start sequences in slots
    copy_slots(layout, tensors, src, dst)                     fork slots (prefix sharing)
    materialize_slots(plan, tensors, slots, A=...)            a slot's FP32 state at any position
    materialize_states(plans, pools, slot_table, out, params) the same over [layers, batch] ids
    mamba2_verify / gdn_verify / kda_verify(plan, ..., num_drafts=, parents=, num_accepted=)
                                           verify draft tokens (docs/speculative.md)
    commit_drafts(plan, tensors, num_accepted=, slot_indices=, accepted_path=None)
    mamba2_ / gdn_ / kda_snapshot_verify, commit_snapshots
                                           the conventional spec baseline (state snapshots)
    plan_handle(plan) -> int, then torch.ops.replayssm.<op>(handle, ..., out=out)
                                           the same ops as torch.library custom ops (ops/library.py)

Tensors come from the layout (families.layout.mamba2_layout / gdn_layout /
kda_layout). On CPU tensors the
same calls run a PyTorch implementation of the same cursor, ring and flush semantics.
"""

from replayssm_jit.ops.commit import commit_drafts
from replayssm_jit.ops.gdn import gdn_decode
from replayssm_jit.ops.kda import kda_decode
from replayssm_jit.ops.library import lookup_plan, plan_handle, release_plan
from replayssm_jit.ops.lifecycle import copy_slots, reset_slots
from replayssm_jit.ops.mamba2 import mamba2_decode
from replayssm_jit.ops.plan import DecodePlan, plan_decode
from replayssm_jit.ops.prefix import materialize_slots, materialize_states
from replayssm_jit.ops.snapshot import (
    commit_snapshots,
    gdn_snapshot_verify,
    kda_snapshot_verify,
    mamba2_snapshot_verify,
)
from replayssm_jit.ops.verify import gdn_verify, kda_verify, mamba2_verify

__all__ = [
    "DecodePlan",
    "commit_drafts",
    "commit_snapshots",
    "copy_slots",
    "gdn_decode",
    "gdn_snapshot_verify",
    "gdn_verify",
    "kda_decode",
    "kda_snapshot_verify",
    "kda_verify",
    "lookup_plan",
    "mamba2_decode",
    "mamba2_snapshot_verify",
    "mamba2_verify",
    "materialize_slots",
    "materialize_states",
    "plan_decode",
    "plan_handle",
    "release_plan",
    "reset_slots",
]
