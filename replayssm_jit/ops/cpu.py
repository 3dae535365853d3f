"""Plain-PyTorch decode steps: what the CUDA modules' bindings do, for CPU tensors (any device).

`mamba2_step` and `gdn_step` take the same tensors as the modules' conventional_step /
replay_step bindings (shapes: ops/mamba2.py, ops/gdn.py), already validated, and mutate the
state, rings, cursors and `out` in place as the per-item kernels (templates/*/decode_kernel.cuh)
do: the same flush decision, the same ring rows, the same cursor words, the same stored dtypes.
Arithmetic is float32 throughout (inputs widened exactly, results rounded once to the tensors'
own dtypes); the order of FP32 additions differs from the kernels', so results agree with them
to FP32 rounding, not bit for bit. Decays are exp of suffix sums of log-decays, never products of
rounded factors.

Per batch row b with slot s = slot_indices[b]:
  * s == pad_slot_id: out[b] = 0; nothing else is read or written.
  * replay=True and cursors[s, 0] outside [0, window) (a corrupted cursor; no step leaves one):
    out[b] = NaN; nothing else is read or written (the kernels' held_count_valid guard).
  * replay=False (conventional): read state[s], take one step, write it back, write out[b].
  * replay=True: n = cursors[s, 0] records are held; with j = n + 1 (those plus this token) the
    row flushes when j >= window or flush_every_step. A flush folds the n held records and this
    token into state[s] (stored in its dtype, stochastically rounded with "sr") and writes the
    output of the folded FP32 state; otherwise the output comes from the checkpoint and the
    records, this token's record is written at ring row n, and the state is not written.
  * Cursor words afterwards (common/replay.cuh, finish_step_cursor): in flush_every_step mode
    without "sr", a row that held nothing only advances the epoch (word 1), leaving words 0 and 2
    as they were; otherwise word 0 = 0 after a flush else j, word 1 = epoch + 1 after a flush,
    word 2 (the CTA-arrival scratch) = 0. Word 3 is never touched.

Rows are grouped by their held count and each group is computed at once, vectorised over rows
and heads. Slots must be distinct among non-pad rows (the callers check).

Stochastic rounding reproduces templates/common/rounding.cuh bit for bit (SplitMix64 in wrapping
int64 arithmetic): an element's bits are rounding_bits(seed, slot << 32 | epoch, element) with
the element's flat index in its slot's state block and the epoch read at the step's start (0 in
conventional mode), so the same seed gives the GPU's bits.

Nothing here imports replayssm_jit.reference (the float64 oracles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "SUPPORTS_STOCHASTIC_ROUNDING",
    "gdn_step",
    "mamba2_step",
    "round_stochastic",
    "rounding_bits",
]

SUPPORTS_STOCHASTIC_ROUNDING = True

NORM_EPS = 1e-6  # GDN's L2 norm: x * rsqrt(sum x^2 + eps)

_F32 = torch.float32


# ---------------------------------------------------------------------------------------------
# Stochastic rounding (templates/common/rounding.cuh), in int64 arithmetic that wraps mod 2^64
# ---------------------------------------------------------------------------------------------


def _signed64(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned `value` (taken mod 2^64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX_1 = _signed64(0xBF58476D1CE4E5B9)
_MIX_2 = _signed64(0x94D049BB133111EB)
_GOLDEN = _signed64(0x9E3779B97F4A7C15)


def _shr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bit patterns (multiplications wrap as uint64 ones do)."""
    z = (z ^ _shr(z, 30)) * _MIX_1
    z = (z ^ _shr(z, 27)) * _MIX_2
    return z ^ _shr(z, 31)


def rounding_bits(seed: int, stream: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """rounding_bits(seed, stream, counter) of rounding.cuh: 32 random bits per element, as
    int64 values in [0, 2^32). stream and counter: int64 tensors (uint64 bit patterns) that
    broadcast together."""
    inner = _mix64(stream * _GOLDEN + counter)
    return _shr(_mix64(inner ^ _signed64(seed)), 32)


def _from_bits16(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit patterns held in int64 [0, 2^16) as a bf16 / fp16 tensor."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    """A bf16 / fp16 tensor's bit patterns as int64 in [0, 2^16)."""
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def _round_bf16(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """BF16: add the top 16 random bits below the kept ones, then truncate; inf / NaN as RN."""
    u = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = _from_bits16(_shr(u + _shr(bits, 16), 16), torch.bfloat16)
    return torch.where(torch.isfinite(v), rounded, v.to(torch.bfloat16))


def _round_f16(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """FP16: the neighbour away from zero with probability equal to the distance from the one
    toward zero (one FP16 ulp apart); exact values, inf and NaN round to nearest."""
    nearest = v.to(torch.float16)
    nearest_bits = _bits16(nearest)
    # Toward zero: the nearest value, or one step back toward zero where it rounded outward.
    outward = nearest.to(_F32).abs() > v.abs()
    toward_bits = torch.where(outward, nearest_bits - 1, nearest_bits)  # magnitude - 1 ulp
    toward = _from_bits16(toward_bits, torch.float16)
    low = toward.to(_F32)
    away_bits = toward_bits + 1  # one ulp away from zero (the sign bit stays)
    away = _from_bits16(away_bits, torch.float16)
    high = away.to(_F32)
    frac = (v - low) / (high - low)  # exact in FP32: the divisor is one FP16 ulp, a power of 2
    r = _shr(bits, 8).to(_F32) * (1.0 / 16777216.0)
    choice = torch.where(r < frac, away, toward)
    choice = torch.where(torch.isinf(away), toward, choice)  # never round a finite value to inf
    exact = (low == v) | ~torch.isfinite(v) | torch.isinf(toward)
    return torch.where(exact, nearest, choice)


def round_stochastic(v: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round_stochastic<dtype>(v, bits) of rounding.cuh: FP32 `v` to `dtype` with the random
    `bits` (int64 in [0, 2^32), broadcasting with v); FP32 is returned unchanged."""
    v = v.to(_F32)
    if dtype == torch.bfloat16:
        return _round_bf16(v, bits)
    if dtype == torch.float16:
        return _round_f16(v, bits)
    if dtype == _F32:
        return v
    raise ValueError(f"round_stochastic: expected bf16, fp16 or fp32, got {dtype}")


def _store_state(
    state: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
    *,
    sr: bool,
    seed: int,
    epochs: torch.Tensor,
) -> None:
    """state[slots] = FP32 `values` [rows, *state.shape[1:]] in state's dtype: round to nearest,
    or (sr) stochastically with the key store_chunk gets (slot << 32 | epoch, flat element)."""
    if not sr or state.dtype == _F32:
        state[slots] = values.to(state.dtype)
        return
    per_slot = state.shape[1:]
    element = torch.arange(per_slot.numel(), dtype=torch.int64, device=values.device)
    stream = (slots.to(torch.int64) << 32) | epochs.to(torch.int64)  # int32 epochs sign-extend
    bits = rounding_bits(seed, stream[:, None], element[None, :])
    flat = values.reshape(values.shape[0], -1)
    state[slots] = round_stochastic(flat, bits, state.dtype).view(values.shape)


# ---------------------------------------------------------------------------------------------
# Shared pieces: gates, decays, the per-row driver (pad rows, held-count groups, cursors)
# ---------------------------------------------------------------------------------------------


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """The kernels' softplus: x above 20, else log1p(exp(x))."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _suffix_decays(log_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For log_decay [..., j]: decay [..., j], decay[i] = exp(sum_{m>i} log_decay[m]) (the last
    is 1), and total [...] = exp(sum of all), each the exp of one FP32 suffix sum."""
    inclusive = log_decay.flip(-1).cumsum(-1).flip(-1)  # inclusive[i] = sum_{m>=i}
    exclusive = torch.cat([inclusive[..., 1:], torch.zeros_like(inclusive[..., :1])], dim=-1)
    return torch.exp(exclusive), torch.exp(inclusive[..., 0])


def _with_current(ring: torch.Tensor | None, slots, held: int, current: torch.Tensor):
    """The held ring rows [rows, heads, held, ...] of `slots` (as FP32) followed by this token's
    row `current` [rows, heads, ...]: [rows, heads, held + 1, ...]."""
    current = current.to(_F32).unsqueeze(2)
    if held == 0:
        return current
    return torch.cat([ring[slots, :, :held].to(_F32), current], dim=2)


# compute(rows, slots, held, flush, epochs): one group's math and its state / ring / out writes.
_Compute = Callable[[torch.Tensor, torch.Tensor, int, bool, torch.Tensor], None]


@dataclass(frozen=True)
class StepSetup:
    """The scalars a step takes besides its tensors, as the module's bindings do: ReplaySSM or
    conventional, flush-every-step mode, the window L, the spec's flags, the pad slot id and the stochastic-rounding seed."""

    replay: bool
    flush_every_step: bool
    window: int
    flags: frozenset[str]
    pad_slot_id: int
    seed: int


def _run_rows(
    setup: StepSetup,
    *,
    sr: bool,
    cursors: torch.Tensor | None,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    compute: _Compute,
) -> None:
    """Pad rows, then `compute` once per group of rows with the same held count (read from the
    cursors before anything is written), then the cursor words as finish_step_cursor leaves
    them."""
    replay, flush_every_step = setup.replay, setup.flush_every_step
    window, pad_slot_id = setup.window, setup.pad_slot_id
    slot_of_row = slot_indices.to(device=out.device, dtype=torch.int64)
    pad = slot_of_row == pad_slot_id
    rows = torch.nonzero(~pad).flatten()
    slots = slot_of_row[rows]
    if not replay:
        out[pad] = 0
        if rows.numel():
            compute(rows, slots, 0, True, torch.zeros_like(slots))
        return
    if cursors is None:
        raise ValueError("cursors: required in replay mode")
    words = cursors[slots].to(torch.int64)
    held_of_row, epoch_of_row = words[:, 0], words[:, 1]
    faulted = (held_of_row < 0) | (
        held_of_row >= window
    )  # a corrupted cursor, as the kernels see it
    out[pad] = 0
    out[rows[faulted]] = float("nan")
    rows, slots = rows[~faulted], slots[~faulted]
    held_of_row, epoch_of_row = held_of_row[~faulted], epoch_of_row[~faulted]
    for held in sorted(set(held_of_row.tolist())):
        members = held_of_row == held
        group_rows, group_slots = rows[members], slots[members]
        records = held + 1
        flush = records >= window or flush_every_step
        epochs = epoch_of_row[members] if sr else torch.zeros_like(group_slots)
        compute(group_rows, group_slots, held, flush, epochs)
        if not sr and flush_every_step and records == 1:
            cursors[group_slots, 1] = cursors[group_slots, 1] + 1  # epoch only (int32 wraps)
        else:
            cursors[group_slots, 0] = 0 if flush else records
            if flush:
                cursors[group_slots, 1] = cursors[group_slots, 1] + 1
            cursors[group_slots, 2] = 0


def _check_flags(flags: frozenset[str], known: set[str], family: str) -> bool:
    unknown = set(flags) - known
    if unknown:
        raise ValueError(f"flags: unknown {family} flags {sorted(unknown)}")
    return "sr" in flags and SUPPORTS_STOCHASTIC_ROUNDING


# ---------------------------------------------------------------------------------------------
# Mamba-2
# ---------------------------------------------------------------------------------------------

_MAMBA2_FLAGS = {"d", "z", "dt_bias", "dt_softplus", "sr", "device_seed"}


def mamba2_step(
    setup: StepSetup,
    *,
    state: torch.Tensor,
    rec_x: torch.Tensor | None,
    rec_b: torch.Tensor | None,
    rec_dt: torch.Tensor | None,
    cursors: torch.Tensor | None,
    x: torch.Tensor,
    z: torch.Tensor | None,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """One Mamba-2 decode step (conventional or ReplaySSM), as the module's bindings take it.

    state [slots, H, P, N]; rec_x [slots, H, CAP, P] act, rec_b [slots, G, CAP, N] act, rec_dt
    [slots, H, CAP] f32 (dt after bias and softplus), cursors [slots, 4] int32 (rings and cursors
    None when replay=False); x, z [batch, H, P]; dt [batch, H] f32 raw; A, D, dt_bias [H] f32;
    B, C [batch, G, N]; out [batch, H, P]. With j records (held ones, then this token's), per
    head h of group g:
        dt_i = softplus(dt + dt_bias) (as flagged), dec_i = exp(sum_{m>i} dt_m A), tot = a(1:j)
        flush:  S <- tot S + sum_i dec_i dt_i x_i B_i^T, y = S C + D x
        else:   y = tot (S C) + sum_i dec_i dt_i (B_i . C) x_i + D x
    then y *= silu(z) with "z".
    """
    flags, seed = setup.flags, setup.seed
    sr = _check_flags(flags, _MAMBA2_FLAGS, "Mamba-2")
    heads, groups = x.shape[1], B.shape[1]
    per_group = heads // groups
    has_d, has_z = "d" in flags, "z" in flags
    has_bias, softplus = "dt_bias" in flags, "dt_softplus" in flags
    a = A.to(_F32)

    def compute(rows, slots, held, flush, epochs):
        x_j = x[rows].to(_F32)  # [b, H, P]
        c = C[rows].to(_F32)  # [b, G, N]
        dt_j = dt[rows].to(_F32)  # [b, H]
        if has_bias:
            dt_j = dt_j + dt_bias.to(_F32)
        if softplus:
            dt_j = _softplus(dt_j)
        xs = _with_current(rec_x, slots, held, x_j)  # [b, H, j, P]
        bs = _with_current(rec_b, slots, held, B[rows])  # [b, G, j, N]
        dts = _with_current(rec_dt, slots, held, dt_j)  # [b, H, j]
        decay, total = _suffix_decays(dts * a[:, None])  # [b, H, j], [b, H]
        weight = decay * dts  # a(i+1:j) dt_i
        q = c.repeat_interleave(per_group, dim=1)  # [b, H, N]
        s = state[slots].to(_F32)  # [b, H, P, N]
        extra = D.to(_F32)[:, None] * x_j if has_d else torch.zeros_like(x_j)
        if flush:
            keys = bs.repeat_interleave(per_group, dim=1)  # [b, H, j, N]
            vals = xs * weight[..., None]  # [b, H, j, P]
            s = s * total[..., None, None] + vals.transpose(-1, -2) @ keys
            y = (s @ q[..., None]).squeeze(-1) + extra
            _store_state(state, slots, s, sr=sr, seed=seed, epochs=epochs)
        else:
            dots = (bs @ c[..., None]).squeeze(-1).repeat_interleave(per_group, dim=1)  # [b,H,j]
            replayed = ((weight * dots)[..., None] * xs).sum(dim=2)  # [b, H, P]
            y = total[..., None] * (s @ q[..., None]).squeeze(-1) + (extra + replayed)
        if has_z:
            zr = z[rows].to(_F32)
            y = y * (zr / (1.0 + torch.exp(-zr)))
        out[rows] = y.to(out.dtype)
        if not flush:  # this token's record at ring row `held` (x, B exact; dt in FP32)
            rec_x[slots, :, held] = x[rows].to(rec_x.dtype)
            rec_b[slots, :, held] = B[rows].to(rec_b.dtype)
            rec_dt[slots, :, held] = dt_j.to(rec_dt.dtype)

    _run_rows(setup, sr=sr, cursors=cursors, out=out, slot_indices=slot_indices, compute=compute)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------

_GDN_FLAGS = {"qk_l2norm", "gates_in_kernel", "sr", "device_seed"}


def gdn_step(
    setup: StepSetup,
    *,
    state: torch.Tensor,
    rec_u: torch.Tensor | None,
    rec_k: torch.Tensor | None,
    rec_g: torch.Tensor | None,
    cursors: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_a: torch.Tensor,
    gate_b: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """One Gated DeltaNet decode step (conventional or ReplaySSM), as the module's bindings take it.

    state [slots, HV, V, K]; rec_u [slots, HV, CAP, V] f32, rec_k [slots, H, CAP, K] act (raw
    k), rec_g [slots, HV, CAP] f32 log-decay, cursors [slots, 4] int32 (None when replay=False);
    q, k [batch, H, K]; v [batch, HV, V]; gate_a, gate_b [batch, HV] f32: a, b with
    "gates_in_kernel" (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), else g and
    beta. Value head hv reads key head hv // (HV // H). With j records, dec_i = exp(sum_{m>i}
    g_m), tot = a(1:j), k^ = k rk (rk = rsqrt(|k|^2 + 1e-6) with "qk_l2norm", else 1) and
    q^ = q rq (rq = scale rsqrt(|q|^2 + 1e-6), or scale):
        u_j = beta (v - (tot S_c k^_j + sum_{i<j} dec_i (k^_i . k^_j) u_i))
        flush:  S <- tot S_c + sum_i dec_i u_i k^_i^T, o = S q^
        else:   o = tot S_c q^ + sum_{i<=j} dec_i (k^_i . q^) u_i
    A non-flush step appends (u_j, raw k_j, g_j) at ring row n.
    """
    flags, seed = setup.flags, setup.seed
    sr = _check_flags(flags, _GDN_FLAGS, "GDN")
    k_heads, v_heads = q.shape[1], v.shape[1]
    per_key = v_heads // k_heads
    l2norm, gates_in_kernel = "qk_l2norm" in flags, "gates_in_kernel" in flags

    def compute(rows, slots, held, flush, epochs):
        q_j = q[rows].to(_F32)  # [b, H, K]
        k_j = k[rows].to(_F32)
        v_j = v[rows].to(_F32)  # [b, HV, V]
        g_j = gate_a[rows].to(_F32)  # [b, HV]
        beta = gate_b[rows].to(_F32)
        if gates_in_kernel:
            g_j = -torch.exp(A_log.to(_F32)) * _softplus(g_j + dt_bias.to(_F32))
            beta = _sigmoid(beta)
        ks = _with_current(rec_k, slots, held, k_j)  # [b, H, j, K]
        gs = _with_current(rec_g, slots, held, g_j)  # [b, HV, j]
        decay, total = _suffix_decays(gs)  # [b, HV, j], [b, HV]
        # Dots per key head, then read by its value heads: k_i . k_j, k_i . q, |k_i|^2, |q|^2.
        kk = (ks @ k_j[..., None]).squeeze(-1).repeat_interleave(per_key, dim=1)  # [b, HV, j]
        kq = (ks @ q_j[..., None]).squeeze(-1).repeat_interleave(per_key, dim=1)
        if l2norm:
            rk = torch.rsqrt((ks * ks).sum(-1) + NORM_EPS).repeat_interleave(per_key, dim=1)
            rq = torch.rsqrt((q_j * q_j).sum(-1) + NORM_EPS).repeat_interleave(per_key, dim=1)
            rq = rq * scale
        else:
            rk = torch.ones_like(kk)
            rq = torch.full_like(total, scale)
        rk_j = rk[..., held]  # [b, HV]
        keys = ks.repeat_interleave(per_key, dim=1)  # [b, HV, j, K] raw
        query = q_j.repeat_interleave(per_key, dim=1)  # [b, HV, K] raw
        s = state[slots].to(_F32)  # [b, HV, V, K]
        sk = (s @ keys[:, :, held, :, None]).squeeze(-1) * rk_j[..., None]  # S_c k^_j
        sq = (s @ query[..., None]).squeeze(-1) * rq[..., None]  # S_c q^
        pred = torch.zeros_like(sk)
        osum = torch.zeros_like(sq)
        if held:
            us = rec_u[slots, :, :held].to(_F32)  # [b, HV, n, V]
            base = decay[..., :held] * kk[..., :held] * rk[..., :held]
            pred = ((base * rk_j[..., None])[..., None] * us).sum(dim=2)
            coef = decay[..., :held] * kq[..., :held] * rk[..., :held] * rq[..., None]
            osum = (coef[..., None] * us).sum(dim=2)
        u_j = beta[..., None] * (v_j - (total[..., None] * sk + pred))  # [b, HV, V]
        if flush:  # weights of the raw keys: dec_i rk_i u_i, and rk_j u_j for this token
            vals = (rk_j[..., None] * u_j)[:, :, None]
            if held:
                vals = torch.cat([(decay[..., :held] * rk[..., :held])[..., None] * us, vals], 2)
            s = s * total[..., None, None] + vals.transpose(-1, -2) @ keys
            o = (s @ query[..., None]).squeeze(-1) * rq[..., None]
            _store_state(state, slots, s, sr=sr, seed=seed, epochs=epochs)
        else:
            coef_j = kq[..., held] * rk_j * rq  # dec_j = 1
            o = total[..., None] * sq + osum + coef_j[..., None] * u_j
        out[rows] = o.to(out.dtype)
        if not flush:  # this token's record at ring row `held` (u, g in FP32; raw k exact)
            rec_u[slots, :, held] = u_j.to(rec_u.dtype)
            rec_g[slots, :, held] = g_j.to(rec_g.dtype)
            rec_k[slots, :, held] = k[rows].to(rec_k.dtype)

    _run_rows(setup, sr=sr, cursors=cursors, out=out, slot_indices=slot_indices, compute=compute)
