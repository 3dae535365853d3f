"""Kimi Delta Attention (KDA) decode step on caller-owned tensors: GDN's step (ops/gdn.py) with a
decay per key channel.

Shapes (as gdn_decode's, except where noted; CAP = L + T ring rows, T the layout's drafts; a
layout with drafts is verified by ops/verify.py's kda_verify and committed by ops/commit.py's
commit_drafts):
    state        [slots, HV, V, K]  checkpoint dtype, each slot's block contiguous
    rec_u        [slots, HV, CAP, V] float32 (computed corrections u)   } ReplaySSM records
    rec_k        [slots, H, CAP, K] act dtype (raw k)                   } (families.layout.
    rec_g        [slots, HV, CAP, K] float32 (log-decay per channel)    }  kda_layout)
    rec_v, rec_beta, read_state (with read_scale, read_block_scale): separate mode's, as
                                    gdn_decode's (torch path only: the CUDA modules refuse a
                                    read copy for KDA)
    cursors      [slots, 4]         int32
    q, k         [batch, H, K]      act dtype, unit stride in K, 16-byte aligned rows
    v            [batch, HV, V]     act dtype, unit stride in V, 16-byte aligned rows
    a            [batch, HV, K]     float32, unit stride in K  } raw gates (gates_in_kernel=True),
    b            [batch, HV]        float32                    } with A_log [HV] and dt_bias
                                    [HV * K] float32 contiguous: g = -exp(A_log) softplus(a +
                                    dt_bias), or with the plan's lower_bound the "safe" gate
                                    g = lower_bound sigmoid(exp(A_log) (a + dt_bias));
                                    beta = sigmoid(b)
    g            [batch, HV, K]     float32, unit stride in K  } precomputed gates
    beta         [batch, HV]        float32                    } (gates_in_kernel=False)
    out          [batch, HV, V]     act dtype, contiguous
    slot_indices [batch]            int32; pad_slot_id rows get out = 0 and write nothing
Per value head: S <- S Diag(exp(g)); u = beta (v - S k^); S <- S + u k^T; o = S q^, with
k^, q^ L2-normalised in the kernel under use_qk_l2norm and q^ scaled by the plan's scale.
"""

from __future__ import annotations

import torch

from replayssm_jit.families import KDA
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.decode import run_decode
from replayssm_jit.ops.plan import DecodePlan


@torch.no_grad()
def kda_decode(
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
    """One KDA decode step; returns out [batch, HV, V] (allocated when None).

    Gates: a, b with A_log, dt_bias where the plan has gates_in_kernel=True, else g, beta. The
    rings and cursors are required in replay mode; state_scale, state_block_scale, separate
    mode's read copy and rings (torch path), workspace, seed, num_accepted and flush_mask as in
    gdn_decode.
    Everything is checked before the launch; a failed call changes nothing.
    """
    # The arguments by name: the family's schema picks and checks its inputs among them.
    return run_decode(plan, KDA, torch_path.kda_step, locals())
