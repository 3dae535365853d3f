"""The delta rule's maths on the torch path, for Gated DeltaNet and KDA: what the protocol
(protocol.py) calls per group of rows. The two differ only in the decay, a parameter here: one
log-decay per value head (GDN) or one per key channel (KDA); a per-head decay is the per-channel
one with the same decay on every channel. A record is (u, raw k, g), and in separate mode
(v, beta) too, so a flush can recompute each u from the carried copy.

Arithmetic is FP32 throughout; results agree with the kernels' to FP32 rounding (the order of
additions differs). k^ = k rk (rk = rsqrt(|k|^2 + 1e-6) with "qk_l2norm", else 1) and q^ = q rq
(rq = scale rsqrt(|q|^2 + 1e-6), or scale).
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
    sigmoid,
    softplus,
    suffix_decays,
    verify_states,
    window_mask,
    write_draft_records,
)

__all__ = [
    "DeltaTokens",
    "delta_fold",
    "gdn_snapshot",
    "gdn_step",
    "gdn_verify",
    "kda_snapshot",
    "kda_step",
    "kda_verify",
    "recompute_held_u",
]

NORM_EPS = 1e-6  # GDN's L2 norm: x * rsqrt(sum x^2 + eps)
_F32 = torch.float32


@dataclass(frozen=True)
class DeltaTokens:
    """A step's token inputs as the bindings take them: q, k [batch, H, K]; v [batch, HV, V];
    gate_a [batch, HV] (KDA: [batch, HV, K]) and gate_b [batch, HV] f32: a, b with
    "gates_in_kernel", else g and beta; A_log [HV]; dt_bias [HV] (KDA: [HV * K]); the query
    scale; KDA's lower_bound (< 0: the safe gate; 0: fla's). A verify's with a draft dim."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate_a: torch.Tensor
    gate_b: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    scale: float
    lower_bound: float = 0.0

    @classmethod
    def of(cls, inputs: DeltaTokens | Mapping[str, object]) -> DeltaTokens:
        """The inputs themselves, or the ones a mapping names (the ops' checked inputs)."""
        return inputs if isinstance(inputs, cls) else cls(**inputs)


@dataclass(frozen=True)
class Decay:
    """Which delta rule: whether its decay is per key channel (KDA) or per value head (GDN)."""

    per_channel: bool

    def gates(self, tokens: DeltaTokens, a: torch.Tensor, b: torch.Tensor, flags):
        """(g, beta) FP32 of gate inputs a, b [n, HV] (KDA: a [n, HV, K]): with
        "gates_in_kernel" GDN's g = -exp(A_log) softplus(a + dt_bias), KDA's the same per
        channel (or the safe gate lower_bound sigmoid(exp(A_log) (a + dt_bias))), beta =
        sigmoid(b); else a and b are g and beta."""
        g, beta = a.to(_F32), b.to(_F32)
        if "gates_in_kernel" not in flags:
            return g, beta
        if self.per_channel:
            x = g + tokens.dt_bias.to(_F32).view(g.shape[1], g.shape[2])
            rate = torch.exp(tokens.A_log.to(_F32))[:, None]
            bound = tokens.lower_bound
            g = bound * sigmoid(rate * x) if bound < 0 else -rate * softplus(x)
        else:
            g = -torch.exp(tokens.A_log.to(_F32)) * softplus(g + tokens.dt_bias.to(_F32))
        return g, sigmoid(beta)

    def draft_gates(self, tokens: DeltaTokens, a: torch.Tensor, b: torch.Tensor, flags):
        """gates of [rows, T, ...] draft inputs (KDA's per-channel gates on rows and drafts
        flattened together)."""
        if not self.per_channel:
            return self.gates(tokens, a, b, flags)
        g, beta = self.gates(tokens, a.flatten(0, 1), b.flatten(0, 1), flags)
        return g.view(a.shape), beta.view(b.shape)


GDN = Decay(per_channel=False)
KDA = Decay(per_channel=True)


def _key_norms(ks: torch.Tensor, l2norm: bool, per_key: int) -> torch.Tensor:
    """rk [b, HV, M] of raw keys ks [b, H, M, K]: rsqrt(|k|^2 + eps) with "qk_l2norm", else 1."""
    if not l2norm:
        return torch.ones(ks.shape[:-1], dtype=_F32, device=ks.device).repeat_interleave(
            per_key, dim=1
        )
    return torch.rsqrt((ks * ks).sum(-1) + NORM_EPS).repeat_interleave(per_key, dim=1)


def _query_scale(q: torch.Tensor, l2norm: bool, per_key: int, scale: float) -> torch.Tensor:
    """rq [b, HV] of raw queries q [b, H, K]: scale rsqrt(|q|^2 + eps), or scale."""
    if not l2norm:
        return torch.full((q.shape[0], q.shape[1] * per_key), scale, dtype=_F32, device=q.device)
    return torch.rsqrt((q * q).sum(-1) + NORM_EPS).repeat_interleave(per_key, dim=1) * scale


def _per_channel(gs: torch.Tensor, channels: int) -> torch.Tensor:
    """Log-decays per key channel: a per-head gs [b, HV, M] repeated over the K channels."""
    return gs[..., None].expand(*gs.shape, channels) if gs.dim() == 3 else gs


def _replay(s, ks, gs, us, query, l2norm: bool, per_key: int):
    """The last of j records' terms from checkpoint values s [b, HV, V, K] and the held u's us
    [b, HV, j - 1, V] (None for none): total S_c k^_j + pred (alpha_j S_{j-1} k^_j), and the
    total decay, the decayed raw keys, their dots with `query` and the key norms."""
    held = ks.shape[2] - 1
    gs = _per_channel(gs, ks.shape[-1])
    decay, total = suffix_decays(gs.transpose(-1, -2))  # [b, HV, K, j], [b, HV, K]
    keys = ks.repeat_interleave(per_key, dim=1)  # [b, HV, j, K] raw
    decayed = keys * decay.transpose(-1, -2)  # k_i * a(i+1:j)
    kk = (decayed @ keys[:, :, held, :, None]).squeeze(-1)  # [b, HV, j]
    rk = _key_norms(ks, l2norm, per_key)  # [b, HV, j]
    rk_j = rk[..., held]
    predicted = (s @ (total * keys[:, :, held])[..., None]).squeeze(-1) * rk_j[..., None]
    if held:
        base = kk[..., :held] * rk[..., :held] * rk_j[..., None]
        predicted = predicted + (base[..., None] * us).sum(dim=2)
    kq = (decayed @ query[..., None]).squeeze(-1)
    return predicted, total, decayed, kq, rk


def recompute_held_u(s, ks, gs, vs, betas, l2norm: bool, per_key: int) -> torch.Tensor:
    """Separate mode: the n held corrections u_i = beta_i (v_i - alpha_i S_{i-1} k^_i) from
    checkpoint values s [b, HV, V, K], in record order (ks [b, H, n, K] raw, gs [b, HV, n]
    (or [b, HV, n, K]), vs [b, HV, n, V], betas [b, HV, n]); returns [b, HV, n, V] FP32."""
    us = torch.empty_like(vs)
    for i in range(vs.shape[2]):
        predicted = _replay(s, ks[:, :, : i + 1], gs[:, :, : i + 1], us[:, :, :i],
                            ks[:, :, i].repeat_interleave(per_key, dim=1), l2norm,
                            per_key)[0]  # fmt: skip
        us[:, :, i] = betas[:, :, i, None] * (vs[:, :, i] - predicted)
    return us


def delta_fold(s, us, ks, gs, l2norm: bool, per_key: int) -> torch.Tensor:
    """S <- S Diag(a(1:n)) + sum_i u_i (a(i+1:n) * k^_i)^T over n records (us [b, HV, n, V],
    raw ks [b, H, n, K], gs [b, HV, n] log-decays per head, or [b, HV, n, K] per key channel),
    in FP32."""
    gs = _per_channel(gs, ks.shape[-1])
    decay, total = suffix_decays(gs.transpose(-1, -2))  # [b, HV, K, n], [b, HV, K]
    decayed = ks.repeat_interleave(per_key, dim=1) * decay.transpose(-1, -2)
    vals = _key_norms(ks, l2norm, per_key)[..., None] * us
    return s * total[..., None, :] + vals.transpose(-1, -2) @ decayed


def _step(setup: StepScalars, decay: Decay, pool: Pool, inputs, rows: Rows) -> None:
    """The delta-rule step of gdn_step and kda_step. Separate mode (pool.read): non-flush steps
    read the read copy and append (v, beta) to rec_v, rec_beta too; a flush recomputes each held
    u from the carried copy, in record order, as the non-flush steps of a one-copy run of its
    format did, then stores both copies."""
    tokens, flags = DeltaTokens.of(inputs), setup.flags
    q, k, v = tokens.q, tokens.k, tokens.v
    per_key = v.shape[1] // q.shape[1]
    l2norm = "qk_l2norm" in flags
    rec_u, rec_k, rec_g, rec_v, rec_beta = (pool.rings.get(n) for n in
                                            ("rec_u", "rec_k", "rec_g", "rec_v", "rec_beta"))  # fmt: skip
    separate, out = pool.read is not None, rows.out

    def compute(group: Group) -> None:
        r, slots, held, flush = group.rows, group.slots, group.held, group.flush
        q_j = q[r].to(_F32)  # [b, H, K]
        k_j = k[r].to(_F32)
        v_j = v[r].to(_F32)  # [b, HV, V]
        g_j, beta = decay.gates(tokens, tokens.gate_a[r], tokens.gate_b[r], flags)
        ks = protocol.with_current(rec_k, slots, held, k_j)  # [b, H, j, K]
        gs = protocol.with_current(rec_g, slots, held, g_j)  # [b, HV, j] or [b, HV, j, K]
        query = q_j.repeat_interleave(per_key, dim=1)  # [b, HV, K] raw
        rq = _query_scale(q_j, l2norm, per_key, tokens.scale)  # [b, HV]
        s = checkpoint.load_state(pool.read if separate and not flush else pool.state, slots)
        us = None  # the held u [b, HV, n, V]: a separate-mode flush's again from state
        if held and separate and flush:
            vs, betas = held_rows(rec_v, slots, held), held_rows(rec_beta, slots, held)
            us = recompute_held_u(s, ks[:, :, :held], gs[:, :, :held], vs, betas, l2norm, per_key)
        elif held:
            us = held_rows(rec_u, slots, held)
        predicted, total, decayed, kq, rk = _replay(s, ks, gs, us, query, l2norm, per_key)
        rk_j = rk[..., held]
        u_j = beta[..., None] * (v_j - predicted)  # [b, HV, V]
        if flush:  # weights of the decayed raw keys: rk_i u_i, and rk_j u_j for this token
            vals = (rk_j[..., None] * u_j)[:, :, None]
            if held:
                vals = torch.cat([rk[..., :held, None] * us, vals], 2)
            s = s * total[..., None, :] + vals.transpose(-1, -2) @ decayed
            o = (s @ query[..., None]).squeeze(-1) * rq[..., None]
            checkpoint.store_flush(pool.state, pool.read, slots, s, setup.rounding(group.epochs),
                                   "read_rn" in flags)  # fmt: skip
        else:
            o = (s @ (total * query)[..., None]).squeeze(-1) * rq[..., None]
            if held:
                o = o + ((kq[..., :held] * rk[..., :held] * rq[..., None])[..., None] * us).sum(2)
            o = o + (kq[..., held] * rk_j * rq)[..., None] * u_j  # dec_j = 1
        out[r] = o.to(out.dtype)
        if not flush:  # this token's record at ring row `held` (u, g in FP32; raw k exact)
            rec_u[slots, :, held] = u_j.to(rec_u.dtype)
            rec_g[slots, :, held] = g_j.to(rec_g.dtype)
            rec_k[slots, :, held] = k[r].to(rec_k.dtype)
            if separate:
                rec_v[slots, :, held] = v[r].to(rec_v.dtype)
                rec_beta[slots, :, held] = beta.to(rec_beta.dtype)

    protocol.run_step(setup, pool, rows, compute)


def _verify(setup: StepScalars, decay: Decay, pool: Pool, inputs, rows: Rows) -> None:
    """The body of gdn_verify and kda_verify: draft j over its window W_j (the committed records,
    then its root path), tot and dec_i per key channel:
        u_j = beta_j (v_j - (S (tot * k^_j) + sum_{i in W_j, i != j} ((dec_i * k^_i) . k^_j) u_i))
        o_j = S (tot * q^_j) + sum_{i in W_j} ((dec_i * k^_i) . q^_j) u_i
    """
    tokens, flags, T = DeltaTokens.of(inputs), setup.flags, setup.drafts
    q, k, v = tokens.q, tokens.k, tokens.v
    k_heads, v_heads, K = q.shape[2], v.shape[2], q.shape[3]
    per_key = v_heads // k_heads
    l2norm = "qk_l2norm" in flags
    rec_u, rec_k, rec_g, rec_v, rec_beta = (pool.rings.get(n) for n in
                                            ("rec_u", "rec_k", "rec_g", "rec_v", "rec_beta"))  # fmt: skip
    separate, out = pool.read is not None, rows.out

    def fold(s, slots, n):
        """An early flush of n committed records into carried values s: separate mode first
        recomputes each u from s, as a step's flush does (the held u came from the read copy)."""
        ks, gs = held_rows(rec_k, slots, n), held_rows(rec_g, slots, n)
        if separate:
            vs, betas = held_rows(rec_v, slots, n), held_rows(rec_beta, slots, n)
            us = recompute_held_u(s, ks, gs, vs, betas, l2norm, per_key)
        else:
            us = held_rows(rec_u, slots, n)
        return delta_fold(s, us, ks, gs, l2norm, per_key)

    def compute(group: Group) -> None:
        r, slots, held = group.rows, group.slots, group.held
        live = live_drafts(group.drafts, T)
        q_d = draft_inputs(q, r, live)  # [r, T, H, K]
        k_d = draft_inputs(k, r, live)
        v_d = draft_inputs(v, r, live)  # [r, T, HV, V]
        g_d, beta_d = decay.draft_gates(tokens, draft_inputs(tokens.gate_a, r, live),
                                        draft_inputs(tokens.gate_b, r, live), flags)  # fmt: skip
        g_d = torch.where(live.view(*live.shape, *([1] * (g_d.dim() - 2))), g_d, 0.0)
        s, held = verify_states(setup, pool, group, fold)
        ks = torch.cat([held_rows(rec_k, slots, held), k_d.transpose(1, 2)], 2)  # [r,H,M,K]
        gs = torch.cat([_per_channel(held_rows(rec_g, slots, held), K),
                        _per_channel(g_d, K).transpose(1, 2)], 2)  # [r, HV, M, K]  # fmt: skip
        us = torch.cat([held_rows(rec_u, slots, held),
                        torch.zeros_like(v_d).transpose(1, 2)], 2)  # [r, HV, M, V]  # fmt: skip
        rk = _key_norms(ks, l2norm, per_key)  # [r, HV, M]
        keys = ks.repeat_interleave(per_key, dim=1)  # [r, HV, M, K] raw
        windows = window_mask(held, group.ancestors)  # [r, T, M]
        outs = []
        for j in range(T):
            at = held + j
            window = windows[:, j, None]  # [r, 1, M]
            # [r, HV, K, M], [r, HV, K]
            dec, total = suffix_decays(torch.where(window[..., None, :], gs.transpose(-1, -2), 0.0))
            decayed = keys * dec.transpose(-1, -2)  # k_i * dec_i over W_j
            before = window.clone()
            before[..., at] = False  # the records replayed before draft j
            q_j, query = q_d[:, j], q_d[:, j].repeat_interleave(per_key, dim=1)  # [r, HV, K]
            key_j = keys[:, :, at]
            kk = (decayed @ key_j[..., None]).squeeze(-1)  # [r, HV, M]
            kq = (decayed @ query[..., None]).squeeze(-1)
            rq = _query_scale(q_j, l2norm, per_key, tokens.scale)  # [r, HV]
            rk_j = rk[..., at]
            sk = (s @ (total * key_j)[..., None]).squeeze(-1) * rk_j[..., None]  # S (tot k^_j)
            sq = (s @ (total * query)[..., None]).squeeze(-1) * rq[..., None]  # S (tot q^_j)
            base = torch.where(before, kk * rk * rk_j[..., None], 0.0)
            coef = torch.where(before, kq * rk * rq[..., None], 0.0)
            # Selects, not zero weights: a NaN u outside j's window stays out (0 * NaN = NaN).
            pred = torch.where(before[..., None], base[..., None] * us, 0.0).sum(dim=2)
            osum = torch.where(before[..., None], coef[..., None] * us, 0.0).sum(dim=2)
            u_j = beta_d[:, j, :, None] * (v_d[:, j] - (sk + pred))
            u_j = torch.where(live[:, j, None, None], u_j, 0.0)
            o = sq + osum + (kq[..., at] * rk_j * rq)[..., None] * u_j  # dec_j = 1
            us[:, :, at] = u_j
            outs.append(torch.where(live[:, j, None, None], o, 0.0))
        out[r] = torch.stack(outs, dim=1).to(out.dtype)
        u_d = us[:, :, held:].transpose(1, 2)  # [r, T, HV, V]
        records = [(rec_u, u_d), (rec_g, g_d), (rec_k, k[r])]
        if separate:  # what a flush recomputes u from (v as given, beta in FP32)
            records += [(rec_v, v[r]), (rec_beta, beta_d)]
        write_draft_records(slots, held, live, records)

    protocol.run_verify(setup, pool, rows, compute)


def _snapshot(setup: StepScalars, decay: Decay, state: torch.Tensor, inputs, rows: Rows) -> None:
    """The body of gdn_snapshot and kda_snapshot: draft j of a row is a conventional step of the
    state after draft j - 1 (u = beta (v - alpha S k^), S <- alpha S + u k^T, o = S q^; KDA's
    alpha a diagonal over the key channels); the state slot_indices[b] is read, never written."""
    tokens, flags = DeltaTokens.of(inputs), setup.flags
    q, k, v = tokens.q, tokens.k, tokens.v
    per_key = v.shape[2] // q.shape[2]
    l2norm = "qk_l2norm" in flags

    def token(s, r, j, live):
        q_j = draft_inputs(q, r, live)[:, j]  # [r, H, K]
        k_j = draft_inputs(k, r, live)[:, j]
        v_j = draft_inputs(v, r, live)[:, j]  # [r, HV, V]
        g_j, beta = decay.gates(tokens, draft_inputs(tokens.gate_a, r, live)[:, j],
                                draft_inputs(tokens.gate_b, r, live)[:, j], flags)  # fmt: skip
        rk = _key_norms(k_j[:, :, None], l2norm, per_key)[..., 0]  # [r, HV]
        key = k_j.repeat_interleave(per_key, dim=1) * rk[..., None]  # k^ [r, HV, K]
        query = q_j.repeat_interleave(per_key, dim=1)
        query = query * _query_scale(q_j, l2norm, per_key, tokens.scale)[..., None]
        alpha = torch.exp(g_j)[..., None, None] if g_j.dim() == 2 else torch.exp(g_j)[..., None, :]
        s = alpha * s
        u = beta[..., None] * (v_j - (s @ key[..., None]).squeeze(-1))
        s = s + u[..., None] * key[:, :, None]
        return (s @ query[..., None]).squeeze(-1), s

    protocol.run_snapshot(setup, state, rows, token)


def gdn_step(setup: StepScalars, pool: Pool, inputs, rows: Rows) -> None:
    """One Gated DeltaNet decode step (conventional or ReplaySSM), as the module's bindings take
    it: pool state [slots, HV, V, K] (separate mode: a read copy, rec_v [slots, HV, CAP, V] act
    and rec_beta [slots, HV, CAP] f32), rec_u [slots, HV, CAP, V] f32, rec_k [slots, H, CAP, K]
    act (raw k), rec_g [slots, HV, CAP] f32; inputs DeltaTokens; rows.out [batch, HV, V]. Value
    head hv reads key head hv // (HV // H). With j records, dec_i = exp(sum_{m>i} g_m), tot =
    a(1:j):
        u_j = beta (v - (tot S_c k^_j + sum_{i<j} dec_i (k^_i . k^_j) u_i))
        flush:  S <- tot S_c + sum_i dec_i u_i k^_i^T, o = S q^
        else:   o = tot S_c q^ + sum_{i<=j} dec_i (k^_i . q^) u_i
    A non-flush step appends (u_j, raw k_j, g_j) at ring row n."""
    _step(setup, GDN, pool, inputs, rows)


def kda_step(setup: StepScalars, pool: Pool, inputs, rows: Rows) -> None:
    """One KDA decode step: gdn_step with rec_g [slots, HV, CAP, K] and gate_a [batch, HV, K],
    dt_bias [HV * K]; dec_i and tot per key channel:
        u_j = beta (v - (S_c (tot * k^_j) + sum_{i<j} ((dec_i * k^_i) . k^_j) u_i))
        flush:  S <- S_c Diag(tot) + sum_i u_i (dec_i * k^_i)^T, o = S q^
        else:   o = S_c (tot * q^) + sum_{i<=j} ((dec_i * k^_i) . q^) u_i"""
    _step(setup, KDA, pool, inputs, rows)


def gdn_verify(setup: StepScalars, pool: Pool, inputs, rows: Rows) -> None:
    """Verify T GDN drafts per row, as the module's verify_step binding takes them: inputs with a
    draft dim (q, k [batch, T, H, K]; v [batch, T, HV, V]; gates [batch, T, HV]); rows.out
    [batch, T, HV, V]; rows' num_drafts, num_accepted [batch], parents [batch, T]. Drafts run in
    index order (a parent precedes its children), each u along its own root path."""
    _verify(setup, GDN, pool, inputs, rows)


def kda_verify(setup: StepScalars, pool: Pool, inputs, rows: Rows) -> None:
    """Verify T KDA drafts per row: gdn_verify with gate_a [batch, T, HV, K] and KDA's gates."""
    _verify(setup, KDA, pool, inputs, rows)


def gdn_snapshot(setup: StepScalars, state: torch.Tensor, inputs, rows: Rows) -> None:
    """The conventional GDN spec baseline, as the module's snapshot_step binding takes it: inputs
    as gdn_verify's, rows.snapshot_slots [batch, T] int."""
    _snapshot(setup, GDN, state, inputs, rows)


def kda_snapshot(setup: StepScalars, state: torch.Tensor, inputs, rows: Rows) -> None:
    """The conventional KDA spec baseline: gdn_snapshot with a decay per key channel (S <- S
    Diag(alpha) + u k^T, u = beta (v - S Diag(alpha) k^))."""
    _snapshot(setup, KDA, state, inputs, rows)
