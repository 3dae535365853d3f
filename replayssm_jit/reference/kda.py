"""Kimi Delta Attention (KDA) float64 references: GDN with a per-channel decay.

Per value head hv (key head hk = hv // (HV // H)), with q, k L2-normalised and q scaled:

    alpha_t = exp(g_t)                       (g_t [K]: a log-decay per key channel)
    u_t = beta_t (v_t - S_{t-1} Diag(alpha_t) k_t)
    S_t = S_{t-1} Diag(alpha_t) + u_t k_t^T
    o_t = S_t q_t
    unrolled: S_j = S_c Diag(a(1:j)) + sum_i u_i (k_i * a(i+1:j))^T

Shapes: state [batch, HV, V, K] (K contiguous), q, k [batch, H, K], v [batch, HV, V],
g [batch, HV, K], beta [batch, HV]. Gates come precomputed (kda_gates forms them from raw
projections). A record is (g [HV, K], beta [HV],
u [HV, V], v [HV, V], k [H, K] normalised). The code is the delta-rule core in gdn.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import check_tensor, f64
from .gdn import (
    DeltaRecords,
    DeltaSequence,
    delta_fold,
    delta_replay_output,
    delta_step,
    delta_step_pool,
    delta_verify,
)

__all__ = [
    "KDARecords",
    "KDASequence",
    "kda_fold",
    "kda_gates",
    "kda_replay_output",
    "kda_step",
    "kda_step_pool",
    "kda_verify",
]


def kda_gates(A_log, a, dt_bias, b, lower_bound=None):
    """KDA gates from raw projections, per key channel: g = -exp(A_log) softplus(a + dt_bias)
    (fla's gate), or g = lower_bound sigmoid(exp(A_log) (a + dt_bias)) (the "safe" gate, for a
    negative lower_bound); beta = sigmoid(b).

    A_log [HV]; dt_bias [HV * K]; a [..., HV, K]; b [..., HV]. Returns (g [..., HV, K], beta
    [..., HV]) float64.
    """
    check_tensor("A_log", A_log, (None,))
    hv = A_log.shape[0]
    if not isinstance(a, torch.Tensor) or a.dim() < 2:
        raise ValueError(f"a: expected a tensor of shape (..., {hv}, K), got {a!r}")
    check_tensor("a", a, (*a.shape[:-2], hv, None))
    check_tensor("dt_bias", dt_bias, (hv * a.shape[-1],))
    check_tensor("b", b, tuple(a.shape[:-1]))
    x = f64(a) + f64(dt_bias).view(hv, a.shape[-1])
    rate = torch.exp(f64(A_log))[:, None]
    if lower_bound is None:
        g = -rate * F.softplus(x)
    else:
        g = float(lower_bound) * torch.sigmoid(rate * x)
    return g, torch.sigmoid(f64(b))


@dataclass(frozen=True)
class KDARecords(DeltaRecords):
    """KDA records: g [n, HV, K]."""


def kda_step(state, q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """One conventional KDA decode step.

    state [batch, HV, V, K]; q, k [batch, H, K]; v [batch, HV, V]; g [batch, HV, K]; beta [batch, HV].
    Returns (o [batch, HV, V], new_state [batch, HV, V, K]) float64; nothing is mutated.
    """
    return delta_step(state, q, k, v, g, beta, scale, use_qk_l2norm, per_channel=True)


def kda_step_pool(
    state_pool, slot_indices, q, k, v, g, beta, scale=None, use_qk_l2norm=True, pad_slot_id=-1
):
    """Conventional KDA step on a pool [num_slots, HV, V, K] (any dtype), updated in place.

    Rows with ``slot_indices[b] == pad_slot_id`` get o = 0 and write nothing. Returns o
    [batch, HV, V] float64.
    """
    return delta_step_pool(
        state_pool,
        slot_indices,
        q,
        k,
        v,
        g,
        beta,
        scale,
        use_qk_l2norm,
        pad_slot_id,
        per_channel=True,
    )


def kda_replay_output(checkpoint, records, q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """Output of the current token by replay, never forming a state.

    checkpoint [HV, V, K]; records: the n HELD KDARecords (or None), NOT including the current
    token; q, k [H, K]; v [HV, V]; g [HV, K]; beta [HV]. Returns (o [HV, V] float64, the current
    token's record (n == 1)):

        S_{j-1} Diag(alpha_j) k_j = S_c (a(1:j) * k_j) + sum_{i<j} ((k_i * a(i+1:j)) . k_j) u_i
        u_j = beta_j (v_j - S_{j-1} Diag(alpha_j) k_j)
        o_j = S_c (a(1:j) * q_j) + sum_{i<=j} ((k_i * a(i+1:j)) . q_j) u_i
    """
    return delta_replay_output(
        checkpoint,
        records,
        q,
        k,
        v,
        g,
        beta,
        scale,
        use_qk_l2norm,
        per_channel=True,
        cls=KDARecords,
    )


def kda_fold(checkpoint, records):
    """Flush: S_c Diag(a(1:n)) + sum_i u_i (k_i * a(i+1:n))^T -> new checkpoint [HV, V, K]."""
    return delta_fold(checkpoint, records, per_channel=True, cls=KDARecords)


def kda_verify(
    checkpoint, committed_records, q, k, v, g, beta, scale=None, use_qk_l2norm=True, parents=None
):
    """Outputs of T draft tokens (output only); as ``gdn_verify`` with g [T, HV, K].

    Returns (o [T, HV, V], KDARecords of the T drafts, each u along that draft's root path).
    """
    return delta_verify(
        checkpoint,
        committed_records,
        q,
        k,
        v,
        g,
        beta,
        scale,
        use_qk_l2norm,
        parents,
        per_channel=True,
        cls=KDARecords,
    )


class KDASequence(DeltaSequence):
    """One KDA sequence under ReplaySSM: ``KDASequence(checkpoint [HV,V,K], scale=None,
    use_qk_l2norm=True, L=16, T=4)``; token g is [HV, K]. See ``ReplaySequence`` for the policy."""

    per_channel = True
    records_cls = KDARecords
