"""Gated DeltaNet (GDN) decode step on caller-owned tensors.

Shapes (H key heads, HV value heads, HV % H == 0, value head hv reads key head hv // (HV // H);
K head_k_dim, V head_v_dim; CAP = L + T ring rows):
    state        [slots, HV, V, K]  checkpoint dtype, each slot's block contiguous ([slots, HV,
                                    V, K / 2] float4_e2m1fn_x2 for nvfp4)
    state_scale  [slots, HV, V]     float32 row scales where state is e4m3
                 [slots, HV]        float32 head scales where state is nvfp4
    state_block_scale [slots, HV, V, K / 16]  float8_e4m3fn block scales where state is nvfp4
    rec_u        [slots, HV, CAP, V] float32 (computed corrections u)  } ReplaySSM records
    rec_k        [slots, H, CAP, K] act dtype (raw k)                  } (families.layout.
    rec_g        [slots, HV, CAP]   float32 (log-decay g)              }  gdn_layout)
    rec_v        [slots, HV, CAP, V] act dtype (raw v)   } separate mode only: a flush
    rec_beta     [slots, HV, CAP]   float32 (beta)       } recomputes each held u from state
    read_state   [slots, HV, V, K]  separate mode's read copy (layout.read_dtype: bf16, f16,
                                    e4m3 or nvfp4), with read_scale and read_block_scale as
                                    state's
    cursors      [slots, 4]         int32
    q, k         [batch, H, K]      act dtype, unit stride in K, 16-byte aligned rows
    v            [batch, HV, V]     act dtype, unit stride in V, 16-byte aligned rows
    a, b         [batch, HV]        float32, any strides: raw gates (plan gates_in_kernel=True),
                                    with A_log, dt_bias [HV] float32 contiguous; the kernel forms
                                    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    g, beta      [batch, HV]        float32: precomputed gates (gates_in_kernel=False)
    out          [batch, HV, V]     act dtype, contiguous
    slot_indices [batch]            int32; pad_slot_id rows get out = 0 and write nothing
With use_qk_l2norm, q and k are normalised in the kernel (x * rsqrt(sum(x^2) + 1e-6)); q is then
multiplied by the plan's scale (default K**-0.5) either way.
"""

from __future__ import annotations

import torch

from replayssm_jit.families import GDN
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.decode import run_decode
from replayssm_jit.ops.mamba2 import held_records
from replayssm_jit.ops.plan import DecodePlan


# A decode step is inference: the kernels ignore autograd, and so does the CPU path (an
# input that requires grad would otherwise pull the cache's tensors into its graph).
@torch.no_grad()
def gdn_decode(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_indices: torch.Tensor,
    state_scale: torch.Tensor | None = None,
    read_state: torch.Tensor | None = None,
    read_scale: torch.Tensor | None = None,
    state_block_scale: torch.Tensor | None = None,
    read_block_scale: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    rec_u: torch.Tensor | None = None,
    rec_k: torch.Tensor | None = None,
    rec_g: torch.Tensor | None = None,
    rec_v: torch.Tensor | None = None,
    rec_beta: torch.Tensor | None = None,
    cursors: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
    flush_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GDN decode step; returns out [batch, HV, V] (allocated when None).

    Gates: a, b with A_log, dt_bias where the plan has gates_in_kernel=True, else g, beta. The
    rings and cursors are required in replay mode; state_scale where the layout's state is e4m3
    or nvfp4, state_block_scale where it is nvfp4 (shapes above). Separate mode (a layout with
    read_dtype): read_state (and read_scale, read_block_scale), rec_v and rec_beta too;
    non-flush steps read the read copy, a flush recomputes the held u from state, folds in FP32
    and stores both copies. workspace (scratch the step overwrites), seed, num_accepted (the
    fused commit of the last verify) and flush_mask (rows that flush now) as in mamba2_decode.
    Everything is checked before the launch; a failed call changes nothing.
    """
    # The arguments by name: the family's schema picks and checks its inputs among them.
    return run_decode(plan, GDN, torch_path.gdn_step, locals())


def delta_fold_held(plan: DecodePlan, tensors, slot: int, held: int, params) -> torch.Tensor:
    """materialize_slots' state of `slot` for GDN and KDA (the decay's width comes with the
    rec_g ring): its checkpoint with its `held` records folded in."""
    state = torch_path.checkpoint_values(tensors, slice(slot, slot + 1))
    if held == 0:
        return state
    shape = plan.layout.shape
    ring = {n: tensors[n][slot : slot + 1, :, :held].to(torch.float32)
            for n in plan.layout.ring_names}  # fmt: skip
    l2norm, per_key = "qk_l2norm" in plan.spec.flags, shape.value_heads // shape.key_heads
    us = ring["rec_u"]
    if plan.layout.read_dtype is not None:  # the held u's of the carried copy, not the read copy's
        us = torch_path.recompute_held_u(state, ring["rec_k"], ring["rec_g"], ring["rec_v"],
                                         ring["rec_beta"], l2norm, per_key)  # fmt: skip
    return torch_path.delta_fold(state, us, ring["rec_k"], ring["rec_g"], l2norm, per_key)


def delta_fold_rows(plan: DecodePlan, tensors, rows: torch.Tensor, held: torch.Tensor,
                    params) -> torch.Tensor:  # fmt: skip
    """materialize_states' fold for GDN and KDA: the checkpoints of `rows` ([n] int64 slot ids on
    the state's device) with their held[r] records folded in, as delta_fold_held folds one (CAP-1
    positions, those past a row's count zeroed: exact zeros added after its real records)."""
    state = torch_path.checkpoint_values(tensors, rows)
    shape = plan.layout.shape
    positions = plan.layout.capacity - 1
    ring = {n: held_records(tensors[n], rows, held, positions) for n in plan.layout.ring_names}
    l2norm, per_key = "qk_l2norm" in plan.spec.flags, shape.value_heads // shape.key_heads
    us = ring["rec_u"]
    if plan.layout.read_dtype is not None:  # the carried copy's u's, as delta_fold_held's
        us = torch_path.recompute_held_u(state, ring["rec_k"], ring["rec_g"], ring["rec_v"],
                                         ring["rec_beta"], l2norm, per_key)  # fmt: skip
    return torch_path.delta_fold(state, us, ring["rec_k"], ring["rec_g"], l2norm, per_key)
