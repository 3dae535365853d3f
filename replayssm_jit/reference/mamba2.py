"""Mamba-2 (tied head dim) float64 references: conventional step, pool step, ReplaySSM replay,
fold, speculative verify and a stateful per-sequence helper.

Per head h (group g = h // (H // G)):

    dt_eff    = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
    log_alpha = dt_eff * A,  v = dt_eff * x,  k = B[g],  q = C[g]
    S_t = exp(log_alpha_t) S_{t-1} + v_t k_t^T
    y_t = S_t q_t + D x_t,   then y_t *= silu(z_t) when z is given

Shapes: state [batch, H, P, N] (N contiguous), x, z [batch, H, P], dt [batch, H], A, D, dt_bias [H],
B, C [batch, G, N]. A record is (dt_eff [H], log_alpha [H], x [H, P], B [G, N]); it does not depend
on the state.
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
    parse_parents,
    pool_step,
    root_path,
    unrolled_apply,
    unrolled_fold,
)

__all__ = [
    "Mamba2Records",
    "Mamba2Sequence",
    "mamba2_fold",
    "mamba2_make_record",
    "mamba2_replay_output",
    "mamba2_step",
    "mamba2_step_pool",
    "mamba2_verify",
]


@dataclass(frozen=True)
class Mamba2Records(Records):
    """n stacked Mamba-2 records (float64), oldest first."""

    dt_eff: torch.Tensor  # [n, H]
    log_alpha: torch.Tensor  # [n, H]   = dt_eff * A
    x: torch.Tensor  # [n, H, P]  (v = dt_eff * x)
    B: torch.Tensor  # [n, G, N]  (k of head h = B[group(h)])


def _check_inputs(
    lead, H, P, N, G, *, x=None, dt=None, A=None, B=None, C=None, D=None, z=None, dt_bias=None
):
    """Shape checks; ``lead`` is () for one token, (batch,) or (T,) otherwise."""
    lead = tuple(lead)
    check_tensor("x", x, (*lead, H, P), optional=True)
    check_tensor("z", z, (*lead, H, P), optional=True)
    check_tensor("dt", dt, (*lead, H), optional=True)
    check_tensor("B", B, (*lead, G, N), optional=True)
    check_tensor("C", C, (*lead, G, N), optional=True)
    check_tensor("A", A, (H,), optional=True)
    check_tensor("D", D, (H,), optional=True)
    check_tensor("dt_bias", dt_bias, (H,), optional=True)
    check_divides("B", G, H, "ngroups G")


def _gates(dt, A, dt_bias, dt_softplus):
    """(dt_eff, log_alpha), float64, same shape as dt."""
    dt = f64(dt) if dt_bias is None else f64(dt) + f64(dt_bias)
    dt_eff = F.softplus(dt) if dt_softplus else dt
    return dt_eff, dt_eff * f64(A)


def _skip_and_gate(y, x, D, z):
    """y + D x, then * silu(z) (float64). x, z [..., H, P], D [H]."""
    if D is not None:
        y = y + f64(D)[:, None] * f64(x)
    if z is not None:
        y = y * F.silu(f64(z))
    return y


# ---------------------------------------------------------------------------------------------
# Conventional
# ---------------------------------------------------------------------------------------------


def mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One conventional decode step. Returns (y [batch, H, P], new_state [batch, H, P, N]), both
    float64; nothing is mutated."""
    check_tensor("state", state, (None, None, None, None))
    batch, H, P, N = state.shape
    check_tensor("B", B, (batch, None, N))
    _check_inputs(
        (batch,), H, P, N, B.shape[1], x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias
    )
    dt_eff, log_alpha = _gates(dt, A, dt_bias, dt_softplus)  # [batch, H]
    k = expand_heads(f64(B), H, dim=1)  # [batch, H, N]
    q = expand_heads(f64(C), H, dim=1)
    v = dt_eff[..., None] * f64(x)  # [batch, H, P]
    new_state = torch.exp(log_alpha)[..., None, None] * f64(state) + v[..., None] * k[..., None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, q)
    return _skip_and_gate(y, x, D, z), new_state


def mamba2_step_pool(
    state_pool,
    slot_indices,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    pad_slot_id=-1,
):
    """Conventional step on a state pool [num_slots, H, P, N] (any dtype), updated in place.

    Row b uses ``state_pool[slot_indices[b]]``; rows with ``slot == pad_slot_id`` get y = 0 and
    write nothing. Returns y [batch, H, P] float64.
    """
    check_tensor("state_pool", state_pool, (None, None, None, None))
    _, H, P, N = state_pool.shape
    check_tensor("x", x, (None, H, P))
    batch = x.shape[0]
    check_tensor("B", B, (batch, None, N))
    _check_inputs(
        (batch,), H, P, N, B.shape[1], x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias
    )

    def step(s, x, dt, B, C, z):
        return mamba2_step(s, x, dt, A, B, C, D, z, dt_bias, dt_softplus)

    rows = {"x": x, "dt": dt, "B": B, "C": C, "z": z}
    return pool_step(state_pool, slot_indices, pad_slot_id, step, rows, (batch, H, P))


# ---------------------------------------------------------------------------------------------
# ReplaySSM
# ---------------------------------------------------------------------------------------------


def mamba2_make_record(x, dt, A, B, dt_bias=None, dt_softplus=False) -> Mamba2Records:
    """The record of one token (x [H, P], dt [H], B [G, N]) -> Mamba2Records with n == 1.

    A stacked [n, ...] input is accepted too and gives n records.
    """
    if x is not None and x.dim() == 2:
        return mamba2_make_record(x[None], dt[None], A, B[None], dt_bias, dt_softplus)
    check_tensor("x", x, (None, None, None))
    n, H, P = x.shape
    check_tensor("B", B, (n, None, None))
    _check_inputs((n,), H, P, B.shape[2], B.shape[1], x=x, dt=dt, A=A, B=B, dt_bias=dt_bias)
    dt_eff, log_alpha = _gates(dt, A, dt_bias, dt_softplus)
    return Mamba2Records(dt_eff, log_alpha, f64(x, copy=True), f64(B, copy=True))


def _check_records(records: Mamba2Records, H, P, N):
    if not isinstance(records, Mamba2Records):
        raise ValueError(f"records: expected Mamba2Records, got {type(records).__name__}")
    n, G = records.n, records.B.shape[1]
    check_tensor("records.dt_eff", records.dt_eff, (n, H))
    check_tensor("records.log_alpha", records.log_alpha, (n, H))
    check_tensor("records.x", records.x, (n, H, P))
    check_tensor("records.B", records.B, (n, G, N))
    check_divides("records.B", G, H, "ngroups G")


def mamba2_replay_output(checkpoint, records: Mamba2Records, C, x, D=None, z=None):
    """Output of the current token from the checkpoint and the window, never forming S_j.

    checkpoint [H, P, N]; records: n >= 1 records, the LAST one being the current token's;
    C [G, N], x [H, P] (current token), D [H], z [H, P]. Returns y [H, P] float64:

        y_j = a(1:j) (S_c q_j) + sum_{i<=j} a(i+1:j) (k_i . q_j) v_i + D x_j   (j = n)
    """
    check_tensor("checkpoint", checkpoint, (None, None, None))
    H, P, N = checkpoint.shape
    _check_records(records, H, P, N)
    if records.n < 1:
        raise ValueError("records: must hold at least the current token's record")
    _check_inputs((), H, P, N, records.B.shape[1], x=x, C=C, D=D, z=z)
    v = records.dt_eff[..., None] * records.x  # [n, H, P]
    k = expand_heads(records.B, H, dim=1)  # [n, H, N]
    q = expand_heads(f64(C), H, dim=0)  # [H, N]
    y = unrolled_apply(checkpoint, records.log_alpha, v, k, q)
    return _skip_and_gate(y, x, D, z)


def mamba2_fold(checkpoint, records: Mamba2Records | None):
    """Flush: a(1:n) S_c + sum_i a(i+1:n) v_i k_i^T -> new checkpoint [H, P, N] float64."""
    check_tensor("checkpoint", checkpoint, (None, None, None))
    if records is None:
        return f64(checkpoint, copy=True)
    H, P, N = checkpoint.shape
    _check_records(records, H, P, N)
    v = records.dt_eff[..., None] * records.x
    k = expand_heads(records.B, H, dim=1)
    return unrolled_fold(checkpoint, records.log_alpha, v, k)


def mamba2_verify(checkpoint, committed_records, draft_records, C, x, D=None, z=None, parents=None):
    """Outputs of T draft tokens (output only, no state is formed or kept).

    checkpoint [H, P, N]; committed_records: n records or None; draft_records: T records;
    C [T, G, N], x, z [T, H, P]. parents: None (chain: draft j follows draft j-1) or length-T ints
    with parents[j] in [-1, j) (-1 = attached to the committed prefix). Draft j replays the
    committed records, then its ancestors root first, then itself. Returns y [T, H, P] float64.
    """
    if not isinstance(draft_records, Mamba2Records):
        raise ValueError(
            f"draft_records: expected Mamba2Records, got {type(draft_records).__name__}"
        )
    t = draft_records.n
    check_tensor("checkpoint", checkpoint, (None, None, None))
    H, P, N = checkpoint.shape
    _check_inputs((t,), H, P, N, draft_records.B.shape[1], x=x, C=C, D=D, z=z)
    plist = parse_parents(parents, t)
    ys = []
    for j in range(t):
        window = cat_records(committed_records, draft_records[root_path(plist, j)])
        ys.append(
            mamba2_replay_output(checkpoint, window, C[j], x[j], D, None if z is None else z[j])
        )
    return torch.stack(ys)


class Mamba2Sequence(ReplaySequence):
    """One Mamba-2 sequence under ReplaySSM (policy: see ``ReplaySequence``).

    Token inputs: ``step(x=[H,P], dt=[H], B=[G,N], C=[G,N], z=None)``; drafts: the same with a
    leading [T] dim, ``verify(parents=None, x=..., dt=..., B=..., C=..., z=None)``.
    """

    def __init__(self, checkpoint, A, D=None, dt_bias=None, dt_softplus=False, L=16, T=4):
        super().__init__(checkpoint, L=L, T=T)
        self.A, self.D, self.dt_bias, self.dt_softplus = A, D, dt_bias, dt_softplus

    def _token(self, held, x, dt, B, C, z=None):
        rec = mamba2_make_record(x, dt, self.A, B, self.dt_bias, self.dt_softplus)
        y = mamba2_replay_output(self.checkpoint, cat_records(held, rec), C, x, self.D, z)
        return y, rec

    def _drafts(self, held, parents, x, dt, B, C, z=None):
        recs = mamba2_make_record(x, dt, self.A, B, self.dt_bias, self.dt_softplus)
        return mamba2_verify(self.checkpoint, held, recs, C, x, self.D, z, parents), recs

    def _fold(self, checkpoint, records):
        return mamba2_fold(checkpoint, records)
