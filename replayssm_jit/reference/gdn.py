"""Gated DeltaNet (GDN) float64 references: conventional step, pool step, ReplaySSM replay, fold,
speculative verify and a stateful per-sequence helper.

Per value head hv (key head hk = hv // (HV // H)), with q, k L2-normalised and q scaled:

    alpha_t = exp(g_t)
    u_t = beta_t (v_t - alpha_t S_{t-1} k_t)
    S_t = alpha_t S_{t-1} + u_t k_t^T
    o_t = S_t q_t

Shapes: state [batch, HV, V, K] (K contiguous), q, k [batch, H, K], v [batch, HV, V],
g, beta [batch, HV]. A record is (g [HV], beta [HV], u [HV, V], v [HV, V], k [H, K] normalised).

The delta-rule core below is shared with KDA (kda.py), whose decay g is per channel:
``per_channel=False`` takes g [..., HV] (GDN), ``per_channel=True`` takes g [..., HV, K] (KDA), where
``S_{t-1} alpha_t`` reads ``S_{t-1} Diag(alpha_t)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import (
    Records,
    ReplaySequence,
    cat_records,
    check_divides,
    check_tensor,
    expand_heads,
    f64,
    l2norm,
    parse_parents,
    pool_step,
    root_path,
    unrolled_apply,
    unrolled_fold,
)

__all__ = [
    "GDNRecords",
    "GDNSequence",
    "gdn_fold",
    "gdn_gates",
    "gdn_replay_output",
    "gdn_step",
    "gdn_step_pool",
    "gdn_verify",
]


@dataclass(frozen=True)
class DeltaRecords(Records):
    """n stacked delta-rule records (float64), oldest first."""

    g: torch.Tensor  # [n, HV] (GDN) or [n, HV, K] (KDA): log-decay
    beta: torch.Tensor  # [n, HV]
    u: torch.Tensor  # [n, HV, V]: the corrected value, what the replay and fold use
    v: torch.Tensor  # [n, HV, V]: raw value, kept so a flush can recompute u from an HP state
    k: torch.Tensor  # [n, H, K]: L2-normalised key (never scaled)


@dataclass(frozen=True)
class GDNRecords(DeltaRecords):
    """GDN records: g [n, HV]."""


def gdn_gates(A_log, a, dt_bias, b):
    """GDN gates from raw projections: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).

    A_log, dt_bias [HV]; a, b [..., HV]. Returns (g, beta) float64 [..., HV].
    """
    check_tensor("A_log", A_log, (None,))
    hv = A_log.shape[0]
    check_tensor("dt_bias", dt_bias, (hv,))
    if not isinstance(a, torch.Tensor) or a.dim() < 1:
        raise ValueError(f"a: expected a tensor of shape (..., {hv}), got {a!r}")
    check_tensor("a", a, (*a.shape[:-1], hv))
    check_tensor("b", b, tuple(a.shape))
    g = -torch.exp(f64(A_log)) * F.softplus(f64(a) + f64(dt_bias))
    return g, torch.sigmoid(f64(b))


# ---------------------------------------------------------------------------------------------
# Delta-rule core (GDN and KDA)
# ---------------------------------------------------------------------------------------------


def _check_delta(lead, H, HV, V, K, per_channel, *, q=None, k=None, v=None, g=None, beta=None):
    lead = tuple(lead)
    check_divides("k", H, HV, "key heads H")
    check_tensor("q", q, (*lead, H, K), optional=True)
    check_tensor("k", k, (*lead, H, K), optional=True)
    check_tensor("v", v, (*lead, HV, V), optional=True)
    check_tensor("g", g, (*lead, HV, K) if per_channel else (*lead, HV), optional=True)
    check_tensor("beta", beta, (*lead, HV), optional=True)


def _prep_qk(q, k, scale, use_qk_l2norm):
    """float64 (q * scale, k), L2-normalised first when use_qk_l2norm. Scale defaults to K^-1/2."""
    q, k = f64(q), f64(k)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _decay_state(state, g):
    """S Diag(alpha) (KDA, g [..., HV, K]) or alpha S (GDN, g [..., HV]), for state [..., HV, V, K]."""
    alpha = torch.exp(f64(g))
    return state * (alpha[..., None, :] if g.dim() == state.dim() - 1 else alpha[..., None, None])


def delta_step(state, q, k, v, g, beta, scale, use_qk_l2norm, per_channel):
    """Conventional delta-rule step -> (o [batch, HV, V], new_state [batch, HV, V, K]) float64."""
    check_tensor("state", state, (None, None, None, None))
    batch, HV, V, K = state.shape
    check_tensor("q", q, (batch, None, K))
    _check_delta((batch,), q.shape[1], HV, V, K, per_channel, q=q, k=k, v=v, g=g, beta=beta)
    q, k = _prep_qk(q, k, scale, use_qk_l2norm)
    qh, kh = expand_heads(q, HV, dim=1), expand_heads(k, HV, dim=1)  # [batch, HV, K]
    s = _decay_state(f64(state), g)  # alpha_t S_{t-1}
    u = f64(beta)[..., None] * (f64(v) - torch.einsum("bhvk,bhk->bhv", s, kh))
    new_state = s + u[..., None] * kh[..., None, :]
    return torch.einsum("bhvk,bhk->bhv", new_state, qh), new_state


def delta_step_pool(
    state_pool, slot_indices, q, k, v, g, beta, scale, use_qk_l2norm, pad_slot_id, per_channel
):
    """Conventional delta-rule step on a pool [num_slots, HV, V, K]; see ``gdn_step_pool``."""
    check_tensor("state_pool", state_pool, (None, None, None, None))
    _, HV, V, K = state_pool.shape
    check_tensor("q", q, (None, None, K))
    batch = q.shape[0]
    _check_delta((batch,), q.shape[1], HV, V, K, per_channel, q=q, k=k, v=v, g=g, beta=beta)

    def step(s, q, k, v, g, beta):
        return delta_step(s, q, k, v, g, beta, scale, use_qk_l2norm, per_channel)

    rows = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    return pool_step(state_pool, slot_indices, pad_slot_id, step, rows, (batch, HV, V))


def _check_records(records, cls, H, HV, V, K, per_channel):
    if not isinstance(records, cls):
        raise ValueError(f"records: expected {cls.__name__}, got {type(records).__name__}")
    n = records.n
    check_tensor("records.g", records.g, (n, HV, K) if per_channel else (n, HV))
    check_tensor("records.beta", records.beta, (n, HV))
    check_tensor("records.u", records.u, (n, HV, V))
    check_tensor("records.v", records.v, (n, HV, V))
    check_tensor("records.k", records.k, (n, H, K))


def _apply(checkpoint, records, query):
    """S_n query (query [HV, K]) from checkpoint + records via the unrolled formula."""
    if records is None:
        return torch.einsum("hvk,hk->hv", f64(checkpoint), query)
    keys = expand_heads(records.k, checkpoint.shape[0], dim=1)  # [n, HV, K]
    return unrolled_apply(checkpoint, records.g, records.u, keys, query)


def delta_replay_output(
    checkpoint, records, q, k, v, g, beta, scale, use_qk_l2norm, per_channel, cls
):
    """Replay one token; see ``gdn_replay_output``. Returns (o [HV, V], record with n == 1)."""
    check_tensor("checkpoint", checkpoint, (None, None, None))
    HV, V, K = checkpoint.shape
    check_tensor("q", q, (None, K))
    H = q.shape[0]
    _check_delta((), H, HV, V, K, per_channel, q=q, k=k, v=v, g=g, beta=beta)
    if records is not None:
        _check_records(records, cls, H, HV, V, K, per_channel)
    q, k = _prep_qk(q, k, scale, use_qk_l2norm)
    qh, kh = expand_heads(q, HV, dim=0), expand_heads(k, HV, dim=0)  # [HV, K]
    alpha = torch.exp(f64(g))
    # S_{j-1} alpha_j k_j, with S_{j-1} k = a(1:j-1)(S_c k) + sum_{i<j} a(i+1:j-1)(k_i . k) u_i
    if per_channel:
        sk = _apply(checkpoint, records, alpha * kh)  # S_{j-1} Diag(alpha_j) k_j
    else:
        sk = alpha[:, None] * _apply(checkpoint, records, kh)  # alpha_j S_{j-1} k_j
    u = f64(beta)[:, None] * (f64(v) - sk)
    rec = cls(
        f64(g, copy=True)[None],
        f64(beta, copy=True)[None],
        u[None],
        f64(v, copy=True)[None],
        k.clone()[None],
    )
    # o_j = a(1:j)(S_c q_j) + sum_{i<=j} a(i+1:j)(k_i . q_j) u_i
    return _apply(checkpoint, cat_records(records, rec), qh), rec


def delta_fold(checkpoint, records, per_channel, cls):
    """Flush: S_c decayed by a(1:n) plus sum_i a(i+1:n)-decayed u_i k_i^T -> [HV, V, K] float64."""
    check_tensor("checkpoint", checkpoint, (None, None, None))
    if records is None:
        return f64(checkpoint, copy=True)
    HV, V, K = checkpoint.shape
    _check_records(records, cls, records.k.shape[1], HV, V, K, per_channel)
    keys = expand_heads(records.k, HV, dim=1)
    return unrolled_fold(checkpoint, records.g, records.u, keys)


def delta_verify(
    checkpoint, committed_records, q, k, v, g, beta, scale, use_qk_l2norm, parents, per_channel, cls
):
    """Verify T drafts; see ``gdn_verify``. Returns (o [T, HV, V], draft records [T])."""
    check_tensor("checkpoint", checkpoint, (None, None, None))
    HV, V, K = checkpoint.shape
    check_tensor("q", q, (None, None, K))
    t = q.shape[0]
    _check_delta((t,), q.shape[1], HV, V, K, per_channel, q=q, k=k, v=v, g=g, beta=beta)
    plist = parse_parents(parents, t)
    outs, recs = [], []
    for j in range(t):
        # the u of draft j depends on its ancestors only; they have smaller indices, so are done
        window = cat_records(committed_records, *(recs[i] for i in root_path(plist, j)[:-1]))
        o, rec = delta_replay_output(
            checkpoint,
            window,
            q[j],
            k[j],
            v[j],
            g[j],
            beta[j],
            scale,
            use_qk_l2norm,
            per_channel,
            cls,
        )
        outs.append(o)
        recs.append(rec)
    return torch.stack(outs), cls.stack(recs)


class DeltaSequence(ReplaySequence):
    """One delta-rule sequence under ReplaySSM (policy: see ``ReplaySequence``).

    Token inputs: ``step(q=[H,K], k=[H,K], v=[HV,V], g=..., beta=[HV])``; drafts: the same with a
    leading [T] dim, ``verify(parents=None, q=..., k=..., v=..., g=..., beta=...)``.
    """

    per_channel = False
    records_cls = DeltaRecords

    def __init__(self, checkpoint, scale=None, use_qk_l2norm=True, L=16, T=4):
        super().__init__(checkpoint, L=L, T=T)
        self.scale, self.use_qk_l2norm = scale, use_qk_l2norm

    def _token(self, held, q, k, v, g, beta):
        return delta_replay_output(
            self.checkpoint,
            held,
            q,
            k,
            v,
            g,
            beta,
            self.scale,
            self.use_qk_l2norm,
            self.per_channel,
            self.records_cls,
        )

    def _drafts(self, held, parents, q, k, v, g, beta):
        return delta_verify(
            self.checkpoint,
            held,
            q,
            k,
            v,
            g,
            beta,
            self.scale,
            self.use_qk_l2norm,
            parents,
            self.per_channel,
            self.records_cls,
        )

    def _fold(self, checkpoint, records):
        return delta_fold(checkpoint, records, self.per_channel, self.records_cls)


# ---------------------------------------------------------------------------------------------
# GDN public API
# ---------------------------------------------------------------------------------------------


def gdn_step(state, q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """One conventional GDN decode step.

    state [batch, HV, V, K]; q, k [batch, H, K]; v [batch, HV, V]; g (log-decay), beta [batch, HV].
    Returns (o [batch, HV, V], new_state [batch, HV, V, K]) float64; nothing is mutated.
    """
    return delta_step(state, q, k, v, g, beta, scale, use_qk_l2norm, per_channel=False)


def gdn_step_pool(
    state_pool, slot_indices, q, k, v, g, beta, scale=None, use_qk_l2norm=True, pad_slot_id=-1
):
    """Conventional GDN step on a pool [num_slots, HV, V, K] (any dtype), updated in place.

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
        per_channel=False,
    )


def gdn_replay_output(checkpoint, records, q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """Output of the current token by replay, never forming a state.

    checkpoint [HV, V, K]; records: the n HELD records (GDNRecords, or None when n == 0), NOT
    including the current token; q, k [H, K]; v [HV, V]; g, beta [HV] of the current token.
    Returns (o [HV, V] float64, the current token's record (n == 1)):

        S_{j-1} k_j = a(1:j-1)(S_c k_j) + sum_{i<j} a(i+1:j-1)(k_i . k_j) u_i
        u_j = beta_j (v_j - alpha_j S_{j-1} k_j)
        o_j = a(1:j)(S_c q_j) + sum_{i<=j} a(i+1:j)(k_i . q_j) u_i
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
        per_channel=False,
        cls=GDNRecords,
    )


def gdn_fold(checkpoint, records):
    """Flush: a(1:n) S_c + sum_i a(i+1:n) u_i k_i^T -> new checkpoint [HV, V, K] float64."""
    return delta_fold(checkpoint, records, per_channel=False, cls=GDNRecords)


def gdn_verify(
    checkpoint, committed_records, q, k, v, g, beta, scale=None, use_qk_l2norm=True, parents=None
):
    """Outputs of T draft tokens (output only).

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]. parents: None (chain) or length-T ints with
    parents[j] in [-1, j). Draft j replays the committed records, then its ancestors root first,
    computing each u in order. Returns (o [T, HV, V], GDNRecords of the T drafts, each u computed
    along that draft's own root path).
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
        per_channel=False,
        cls=GDNRecords,
    )


class GDNSequence(DeltaSequence):
    """One GDN sequence under ReplaySSM: ``GDNSequence(checkpoint [HV,V,K], scale=None,
    use_qk_l2norm=True, L=16, T=4)``; see ``DeltaSequence`` and ``ReplaySequence``."""

    per_channel = False
    records_cls = GDNRecords
