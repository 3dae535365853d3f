"""Mamba-2's maths on the torch path: what the protocol (protocol.py) calls per group of rows. A
record is (x, B, dt after its bias and softplus); a step stages it, replays the held records
into the output or folds them into the checkpoint; a verify replays each draft's window.

Arithmetic is FP32 throughout (inputs widened exactly, results rounded once to the tensors' own
dtypes); the order of FP32 additions differs from the kernels', so results agree with them to
FP32 rounding, not bit for bit. Decays are exp of suffix sums of log-decays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from replayssm_jit.ops.torch_path import checkpoint, protocol
from replayssm_jit.ops.torch_path.protocol import (
    Group,
    Pool,
    Rows,
    StepScalars,
    draft_inputs,
    held_rows,
    live_drafts,
    suffix_decays,
    verify_states,
    window_mask,
    write_draft_records,
)

__all__ = ["Mamba2Tokens", "mamba2_fold", "mamba2_snapshot", "mamba2_step", "mamba2_verify"]

_F32 = torch.float32


@dataclass(frozen=True)
class Mamba2Tokens:
    """A step's token inputs as the bindings take them: x, z [batch, H, P]; dt [batch, H] f32 raw;
    A, D, dt_bias [H] f32; B, C [batch, G, N] (a verify's with a draft dim after batch)."""

    x: torch.Tensor
    z: torch.Tensor | None
    dt: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor | None
    dt_bias: torch.Tensor | None
    B: torch.Tensor
    C: torch.Tensor

    @classmethod
    def of(cls, inputs: Mamba2Tokens | Mapping[str, object]) -> Mamba2Tokens:
        """The inputs themselves, or the ones a mapping names (the ops' checked inputs)."""
        return inputs if isinstance(inputs, cls) else cls(**inputs)


def _gates(dt: torch.Tensor, tokens: Mamba2Tokens, flags: frozenset[str]) -> torch.Tensor:
    """dt after the bias and the softplus (as flagged), FP32."""
    if "dt_bias" in flags:
        dt = dt + tokens.dt_bias.to(_F32)
    return protocol.softplus(dt) if "dt_softplus" in flags else dt


def _gate_output(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y * silu(z), z as FP32."""
    return y * (z / (1.0 + torch.exp(-z)))


def mamba2_fold(s, xs, bs, dts, a, per_group) -> torch.Tensor:
    """S <- a(1:n) S + sum_i a(i+1:n) dt_i x_i B_i^T over n records (xs [b, H, n, P], bs [b, G,
    n, N], dts [b, H, n]), in FP32."""
    decay, total = suffix_decays(dts * a[:, None])
    vals = xs * (decay * dts)[..., None]
    keys = bs.repeat_interleave(per_group, dim=1)
    return s * total[..., None, None] + vals.transpose(-1, -2) @ keys


def mamba2_step(setup: StepScalars, pool: Pool, inputs, rows: Rows) -> None:
    """One Mamba-2 decode step (conventional or ReplaySSM), as the module's bindings take it.

    pool: state [slots, H, P, N] in its format, separate mode's read copy (non-flush steps read
    it, flushes rewrite it from the new state), rings rec_x [slots, H, CAP, P] act, rec_b
    [slots, G, CAP, N] act, rec_dt [slots, H, CAP] f32 (None when conventional), cursors
    [slots, 4] int32. inputs: Mamba2Tokens (or its names). rows.out [batch, H, P]. With j
    records (held ones, then this token's), per head h of group g:
        dt_i = softplus(dt + dt_bias) (as flagged), dec_i = exp(sum_{m>i} dt_m A), tot = a(1:j)
        flush:  S <- tot S + sum_i dec_i dt_i x_i B_i^T, y = S C + D x
        else:   y = tot (S C) + sum_i dec_i dt_i (B_i . C) x_i + D x
    then y *= silu(z) with "z".
    """
    tokens, flags = Mamba2Tokens.of(inputs), setup.flags
    per_group = tokens.x.shape[1] // tokens.B.shape[1]
    a = tokens.A.to(_F32)
    rec_x, rec_b, rec_dt = (pool.rings.get(n) for n in ("rec_x", "rec_b", "rec_dt"))
    out = rows.out

    def compute(group: Group) -> None:
        r, slots, held, flush = group.rows, group.slots, group.held, group.flush
        x_j = tokens.x[r].to(_F32)  # [b, H, P]
        c = tokens.C[r].to(_F32)  # [b, G, N]
        dt_j = _gates(tokens.dt[r].to(_F32), tokens, flags)  # [b, H]
        xs = protocol.with_current(rec_x, slots, held, x_j)  # [b, H, j, P]
        bs = protocol.with_current(rec_b, slots, held, tokens.B[r])  # [b, G, j, N]
        dts = protocol.with_current(rec_dt, slots, held, dt_j)  # [b, H, j]
        decay, total = suffix_decays(dts * a[:, None])  # [b, H, j], [b, H]
        weight = decay * dts  # a(i+1:j) dt_i
        q = c.repeat_interleave(per_group, dim=1)  # [b, H, N]
        reads = pool.read is not None and not flush
        s = checkpoint.load_state(pool.read if reads else pool.state, slots)
        has_d = "d" in flags
        extra = tokens.D.to(_F32)[:, None] * x_j if has_d else torch.zeros_like(x_j)
        if flush:
            keys = bs.repeat_interleave(per_group, dim=1)  # [b, H, j, N]
            vals = xs * weight[..., None]  # [b, H, j, P]
            s = s * total[..., None, None] + vals.transpose(-1, -2) @ keys
            y = (s @ q[..., None]).squeeze(-1) + extra
            checkpoint.store_flush(pool.state, pool.read, slots, s, setup.rounding(group.epochs),
                                   "read_rn" in flags)  # fmt: skip
        else:
            dots = (bs @ c[..., None]).squeeze(-1).repeat_interleave(per_group, dim=1)  # [b,H,j]
            replayed = ((weight * dots)[..., None] * xs).sum(dim=2)  # [b, H, P]
            y = total[..., None] * (s @ q[..., None]).squeeze(-1) + (extra + replayed)
        if "z" in flags:
            y = _gate_output(y, tokens.z[r].to(_F32))
        out[r] = y.to(out.dtype)
        if not flush:  # this token's record at ring row `held` (x, B exact; dt in FP32)
            rec_x[slots, :, held] = tokens.x[r].to(rec_x.dtype)
            rec_b[slots, :, held] = tokens.B[r].to(rec_b.dtype)
            rec_dt[slots, :, held] = dt_j.to(rec_dt.dtype)

    protocol.run_step(setup, pool, rows, compute)


def mamba2_verify(setup: StepScalars, pool: Pool, inputs, rows: Rows) -> None:
    """Verify T Mamba-2 drafts per row, as the module's verify_step binding takes them.

    Tensors as in mamba2_step with a draft dim: x, z [batch, T, H, P]; dt [batch, T, H] raw; B,
    C [batch, T, G, N]; rows.out [batch, T, H, P]; rows.num_drafts, rows.num_accepted [batch]
    and rows.parents [batch, T] int (or None). Draft j with window W_j (the committed records,
    then its root path) has y_j = a(W_j) (S C_j) + sum_{i in W_j} a(i+1:end of W_j) dt_i (B_i .
    C_j) x_i + D x_j, then y_j *= silu(z_j) with "z". Rows, flush and cursors: protocol.py.
    """
    tokens, flags, T = Mamba2Tokens.of(inputs), setup.flags, setup.drafts
    per_group = tokens.x.shape[2] // tokens.B.shape[2]
    a = tokens.A.to(_F32)
    rec_x, rec_b, rec_dt = (pool.rings[n] for n in ("rec_x", "rec_b", "rec_dt"))
    out = rows.out

    def fold(s, slots, n):  # an early flush: the committed records (inputs, exact in any mode)
        rings = (held_rows(ring, slots, n) for ring in (rec_x, rec_b, rec_dt))
        return mamba2_fold(s, *rings, a, per_group)

    def compute(group: Group) -> None:
        r, slots, held = group.rows, group.slots, group.held
        live = live_drafts(group.drafts, T)
        x_d = draft_inputs(tokens.x, r, live)  # [r, T, H, P]
        dt_d = _gates(draft_inputs(tokens.dt, r, live), tokens, flags)
        dt_d = torch.where(live[..., None], dt_d, 0.0)  # [r, T, H]
        b_d = draft_inputs(tokens.B, r, live)  # [r, T, G, N]
        c_d = draft_inputs(tokens.C, r, live)
        s, held = verify_states(setup, pool, group, fold)
        xs = torch.cat([held_rows(rec_x, slots, held), x_d.transpose(1, 2)], 2)  # [r,H,M,P]
        bs = torch.cat([held_rows(rec_b, slots, held), b_d.transpose(1, 2)], 2)  # [r,G,M,N]
        dts = torch.cat([held_rows(rec_dt, slots, held), dt_d.transpose(1, 2)], 2)  # [r,H,M]
        window = window_mask(held, group.ancestors)[:, None]  # [r, 1, T, M]
        log_decay = torch.where(window, (dts * a[:, None])[:, :, None], 0.0)  # [r, H, T, M]
        decay, total = suffix_decays(log_decay)  # [r, H, T, M], [r, H, T]
        weight = torch.where(window, decay * dts[:, :, None], 0.0)
        c_heads = c_d.transpose(1, 2)  # [r, G, T, N]
        dots = (c_heads @ bs.transpose(-1, -2)).repeat_interleave(per_group, dim=1)  # B_i . C_j
        q = c_heads.repeat_interleave(per_group, dim=1)  # [r, H, T, N]
        # A select, not a zero weight: a NaN draft outside j's window stays out (0 * NaN = NaN).
        terms = torch.where(window[..., None], (weight * dots)[..., None] * xs[:, :, None], 0.0)
        y = total[..., None] * (q @ s.transpose(-1, -2)) + terms.sum(3)  # [r, H, T, P]
        y = y.transpose(1, 2)  # [r, T, H, P]
        if "d" in flags:
            y = y + tokens.D.to(_F32)[:, None] * x_d
        if "z" in flags:
            y = _gate_output(y, draft_inputs(tokens.z, r, live))
        out[r] = torch.where(live[..., None, None], y, 0.0).to(out.dtype)
        write_draft_records(slots, held, live, [(rec_x, tokens.x[r]), (rec_b, tokens.B[r]),
                                                (rec_dt, dt_d)])  # fmt: skip

    protocol.run_verify(setup, pool, rows, compute)


def mamba2_snapshot(setup: StepScalars, state: torch.Tensor, inputs, rows: Rows) -> None:
    """The conventional Mamba-2 spec baseline, as the module's snapshot_step binding takes it:
    inputs as mamba2_verify's, rows.snapshot_slots [batch, T] int. Draft j of a row is a
    conventional step of the state after draft j - 1 (S <- exp(dt A) S + dt x B^T, y = S C + D
    x, y *= silu(z)); the state slot_indices[b] is read, never written."""
    tokens, flags = Mamba2Tokens.of(inputs), setup.flags
    per_group = tokens.x.shape[2] // tokens.B.shape[2]
    a = tokens.A.to(_F32)

    def token(s, r, j, live):
        x_j = draft_inputs(tokens.x, r, live)[:, j]  # [r, H, P]
        dt_j = _gates(draft_inputs(tokens.dt, r, live)[:, j], tokens, flags)
        keys = draft_inputs(tokens.B, r, live)[:, j].repeat_interleave(per_group, dim=1)
        q = draft_inputs(tokens.C, r, live)[:, j].repeat_interleave(per_group, dim=1)
        vals = (dt_j[..., None] * x_j)[..., None]  # [r, H, P, 1]
        s = torch.exp(dt_j * a)[..., None, None] * s + vals * keys[:, :, None]
        y = (s @ q[..., None]).squeeze(-1)
        if "d" in flags:
            y = y + tokens.D.to(_F32)[:, None] * x_j
        if "z" in flags:
            y = _gate_output(y, draft_inputs(tokens.z, r, live)[:, j])
        return y, s

    protocol.run_snapshot(setup, state, rows, token)
