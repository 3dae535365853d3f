"""Mamba-2 decode step on caller-owned tensors.

Shapes (tied head dim; G groups, H heads, P headdim, N dstate, CAP = L + T ring rows):
    state        [slots, H, P, N]   checkpoint dtype, each slot's block contiguous
                                    ([slots, H, P, N / 2] float4_e2m1fn_x2 for nvfp4)
    state_scale  [slots, H, P]      float32 row scales where state is float8_e4m3fn
                 [slots, H]         float32 head scales where state is nvfp4
    state_block_scale [slots, H, P, N / 16]  float8_e4m3fn block scales where state is nvfp4
    read_state, read_scale, read_block_scale  separate mode's read copy (layout.read_dtype), alike
    rec_x        [slots, H, CAP, P] act dtype        } ReplaySSM records
    rec_b        [slots, G, CAP, N] act dtype        } (families.layout.mamba2_layout)
    rec_dt       [slots, H, CAP]    float32          }
    cursors      [slots, 4]         int32
    x, z         [batch, H, P]      act dtype, unit stride in P, 16-byte aligned rows
    dt           [batch, H]         float32 (raw; bias and softplus applied in the kernel)
    A, D, dt_bias [H]               float32, contiguous
    B, C         [batch, G, N]      act dtype, unit stride in N, 16-byte aligned rows
    out          [batch, H, P]      act dtype, contiguous
    slot_indices [batch]            int32; pad_slot_id rows get out = 0 and write nothing
"""

from __future__ import annotations

import torch

from replayssm_jit.core.checks import check_tensor
from replayssm_jit.families import MAMBA2
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.decode import run_decode
from replayssm_jit.ops.plan import DecodePlan


# A decode step is inference: the kernels ignore autograd, and so does the CPU path (an
# input that requires grad would otherwise pull the cache's tensors into its graph).
@torch.no_grad()
def mamba2_decode(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
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
    rec_x: torch.Tensor | None = None,
    rec_b: torch.Tensor | None = None,
    rec_dt: torch.Tensor | None = None,
    cursors: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
    flush_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Mamba-2 decode step; returns out [batch, H, P] (allocated when None).

    The rings and cursors are required in replay mode; state_scale, state_block_scale,
    read_state, read_scale and read_block_scale where the plan's layout has them
    (layout.checkpoint_names). workspace: float32, at least
    plan.workspace_floats elements (allocated when None): scratch that the step overwrites (the
    split kernel hands its per-row values over in it), its contents afterwards unspecified; a
    call that raises leaves it unchanged. seed: overrides the plan's
    stochastic-rounding seed; an int64 device tensor of one element is read on the device.
    num_accepted [batch] int32: commits the last verify's drafts first, as the verifies' fused
    commit does (a layout with drafts); a step never drops pending drafts silently: in eager
    mode (CPU, or check_slot_values outside a graph capture) a row with pending drafts and no
    num_accepted raises (pass 0 to reject them); inside a CUDA graph the kernels drop them.
    flush_mask [batch] bool or uint8 (a plan with flush_mask=True; None forces nothing): a row
    whose value is nonzero flushes at this step whatever its record count, so its checkpoint
    is then its whole state after this token (0 records held, epoch + 1), as SGLang's prefix
    tracking copies it; read on the device (no sync). A plan without the flag refuses a mask.
    out (and workspace) may share no memory with an input. Everything is checked before the
    launch; a failed call changes nothing.
    """
    # The arguments by name: the family's schema picks and checks its inputs among them.
    return run_decode(plan, MAMBA2, torch_path.mamba2_step, locals())


def check_mamba2_fold_params(plan: DecodePlan, tensors, params) -> None:
    """materialize_slots' A [H] float32 on the state's device (the records hold dt, not A dt)."""
    heads = plan.layout.shape.value_heads
    check_tensor("A", params["A"], shape=(heads,), dtype=torch.float32,
                 device=tensors["state"].device)  # fmt: skip


def mamba2_fold_held(plan: DecodePlan, tensors, slot: int, held: int, params) -> torch.Tensor:
    """materialize_slots' state of `slot`: its checkpoint with its `held` records folded in."""
    state = torch_path.checkpoint_values(tensors, slice(slot, slot + 1))
    if held == 0:
        return state
    heads = plan.layout.shape.value_heads
    per_group = heads // plan.layout.shape.key_heads
    rings = [tensors[name][slot : slot + 1, :, :held].to(torch.float32)
             for name in plan.layout.ring_names]  # fmt: skip
    return torch_path.mamba2_fold(state, *rings, params["A"], per_group)


def mamba2_fold_rows(plan: DecodePlan, tensors, rows: torch.Tensor, held: torch.Tensor,
                     params) -> torch.Tensor:  # fmt: skip
    """materialize_states' fold: the checkpoints of `rows` ([n] int64 slot ids on the state's
    device) with their held[r] records folded in, as mamba2_fold_held folds one: every row
    folds CAP-1 positions, those past its count zeroed (a zero record adds exact zeros after
    the real ones, so the bits are mamba2_fold_held's)."""
    state = torch_path.checkpoint_values(tensors, rows)
    heads = plan.layout.shape.value_heads
    per_group = heads // plan.layout.shape.key_heads
    rings = [held_records(tensors[name], rows, held, plan.layout.capacity - 1)
             for name in plan.layout.ring_names]  # fmt: skip
    return torch_path.mamba2_fold(state, *rings, params["A"], per_group)


def held_records(ring: torch.Tensor, rows: torch.Tensor, held: torch.Tensor,
                 positions: int) -> torch.Tensor:  # fmt: skip
    """ring[rows, :, :positions] as FP32 with each row's records past held[r] zeroed (stale rows
    may hold anything, NaN included, so they are selected away rather than multiplied by 0)."""
    values = ring[rows, :, :positions].to(torch.float32)
    position = torch.arange(positions, device=ring.device)
    live = (position < held[:, None]).view(len(rows), 1, positions, *[1] * (values.dim() - 3))
    return torch.where(live, values, torch.zeros((), dtype=torch.float32, device=ring.device))
