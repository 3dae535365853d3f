"""Plain-PyTorch decode steps: what the CUDA modules' bindings do, for CPU tensors (any device).

`mamba2_step`, `gdn_step` and `kda_step` take the same tensors as the modules' conventional_step /
replay_step bindings (shapes: ops/mamba2.py, ops/gdn.py), already validated, and mutate the
state, rings, cursors and `out` in place as the per-item kernels (templates/*/decode_kernel.cuh)
do: the same flush decision, the same ring rows, the same cursor words, the same stored dtypes.
Arithmetic is float32 throughout (inputs widened exactly, results rounded once to the tensors'
own dtypes); the order of FP32 additions differs from the kernels', so results agree with them
to FP32 rounding, not bit for bit. Decays are exp of suffix sums of log-decays, never products of
rounded factors.

Per batch row b with slot s = slot_indices[b]:
  * s == pad_slot_id: out[b] = 0; nothing else is read or written.
  * replay=True and cursors[s, 0] outside [0, window) with T == 1 drafts, or outside
    [0, window + T) with T >= 2 (a commit may leave up to L + T - 1 records): a corrupted cursor,
    no step leaves one. out[b] = NaN; nothing else is read or written (the kernels'
    held_count_valid guard).
  * replay=False (conventional): read state[s], take one step, write it back, write out[b].
  * replay=True: n = cursors[s, 0] records are held; with j = n + 1 (those plus this token) the
    row flushes when j >= window or flush_every_step. A flush folds the n held records and this
    token into state[s] (stored in its dtype, stochastically rounded with "sr") and writes the
    output of the folded FP32 state; otherwise the output comes from the checkpoint and the
    records, this token's record is written at ring row n, and the state is not written.
  * Cursor words afterwards (common/replay.cuh, finish_step_cursor): in flush_every_step mode
    without "sr", a row that held nothing only advances the epoch (word 1), leaving words 0 and 2
    as they were; otherwise word 0 = 0 after a flush else j, word 1 = epoch + 1 after a flush,
    word 2 (the CTA-arrival scratch) = 0. Word 3 (the pending drafts of a verify) = 0 either
    way: a standard step drops them uncommitted.

The speculative steps (docs/speculative.md) follow: `mamba2_verify` / `gdn_verify` (verify T
drafts against the checkpoint and the committed records, with a fused commit and an early flush),
`commit` (advance the cursor over the accepted drafts, compacting a tree's path) and
`mamba2_snapshot` / `gdn_snapshot` (the conventional spec baseline that writes one state per
draft into caller-given slots).

Rows are grouped by their held count and each group is computed at once, vectorised over rows
and heads. Slots must be distinct among non-pad rows (the callers check).

Stochastic rounding reproduces templates/common/rounding.cuh bit for bit (its hashes in wrapping
int64 arithmetic): an element's 16 bits are rounding_bits(seed, slot << 32 | epoch, element) with
the element's flat index in its slot's state block and the epoch read at the step's start (0 in
conventional mode), so the same seed gives the GPU's bits.

Nothing here imports replayssm_jit.reference (the float64 oracles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from replayssm_jit.core.cursor_words import (
    CURSOR_ARRIVALS,
    CURSOR_EPOCH,
    CURSOR_HELD,
    CURSOR_PENDING,
)

__all__ = [
    "StepScalars",
    "commit",
    "gdn_snapshot",
    "gdn_step",
    "gdn_verify",
    "kda_step",
    "mamba2_snapshot",
    "mamba2_step",
    "mamba2_verify",
    "round_stochastic",
    "rounding_bits",
]

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


_MASK32 = (1 << 32) - 1


def _pair_bits(key: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """pair_bits(key, pair) of rounding.cuh on int64 tensors: 32 bits in [0, 2^32)."""
    x = (key & _MASK32) ^ ((pair * 0x9E3779B9) & _MASK32)
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _MASK32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _MASK32
    x ^= x >> 15
    return x ^ _shr(key, 32)


def rounding_bits(seed: int, stream: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The 16 random bits rounding.cuh's store_chunk gives element `counter` of stream `stream`
    (slot << 32 | epoch) under `seed`: half of pair_bits(rounding_key(seed, stream), counter >>
    1), the low half for even counters. int64 values in [0, 2^16); stream and counter: int64
    tensors (uint64 bit patterns) that broadcast together."""
    key = _mix64(_signed64(seed) ^ _mix64(stream * _GOLDEN))
    bits = _pair_bits(key, _shr(counter, 1) & _MASK32)
    return (bits >> (16 * (counter & 1))) & 0xFFFF


def _from_bits16(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit patterns held in int64 [0, 2^16) as a bf16 / fp16 tensor."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    """A bf16 / fp16 tensor's bit patterns as int64 in [0, 2^16)."""
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def _round_bf16(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """BF16: add the 16 random bits below the kept ones, then truncate; inf / NaN as RN."""
    u = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = _from_bits16(_shr(u + bits, 16), torch.bfloat16)
    return torch.where(torch.isfinite(v), rounded, v.to(torch.bfloat16))


def _round_f16(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """FP16: the neighbour away from zero with probability equal to the distance from the one
    toward zero. From 2^-14 up (finite): add the low 13 random bits to the 13 FP32 mantissa bits
    below an FP16 ulp and truncate (past 65504, truncation keeps 65504). Below: FP16
    subnormals, where the 16 bits (as a fraction of 1) are compared with the exact fraction;
    exact values, inf and NaN round to nearest."""
    u = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    magnitude = u & 0x7FFFFFFF
    normal = (magnitude >= 0x38800000) & (magnitude < 0x7F800000)
    # Truncation toward zero of FP32 bit patterns to FP16, in the normal range: drop 13 bits.
    bumped = (u + (bits & 0x1FFF)) & 0xFFFFFFFF
    exponent = ((bumped >> 23) & 0xFF) - 127
    mantissa = (bumped >> 13) & 0x3FF
    sign = (bumped >> 16) & 0x8000
    truncated = torch.where(exponent > 15, 0x7BFF, ((exponent + 15).clamp(min=0) << 10) | mantissa)
    normal_bits = sign | truncated
    # Subnormal range: neighbours on the 2^-24 grid.
    nearest = v.to(torch.float16)
    nearest_bits = _bits16(nearest)
    outward = nearest.to(_F32).abs() > v.abs()
    toward_bits = torch.where(outward, nearest_bits - 1, nearest_bits)
    low = _from_bits16(toward_bits, torch.float16).to(_F32)
    frac = (v - low).abs() * 16777216.0
    r = (bits & 0xFFFF).to(_F32) * (1.0 / 65536.0)
    small_bits = torch.where((low != v) & (r < frac), toward_bits + 1, toward_bits)
    result = torch.where(normal, normal_bits, small_bits)
    rounded = _from_bits16(result, torch.float16)
    return torch.where(torch.isfinite(v), rounded, nearest)


def round_stochastic(v: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round_stochastic<dtype>(v, bits) of rounding.cuh: FP32 `v` to `dtype` with the random
    `bits` (int64 in [0, 2^16), broadcasting with v); FP32 is returned unchanged."""
    v = v.to(_F32)
    if dtype == torch.bfloat16:
        return _round_bf16(v, bits)
    if dtype == torch.float16:
        return _round_f16(v, bits)
    if dtype == _F32:
        return v
    raise ValueError(f"round_stochastic: expected bf16, fp16 or fp32, got {dtype}")


E4M3_MAX = 448.0


def encode_e4m3_rows(
    values: torch.Tensor, bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, FP32 row scales [...]) of FP32 `values` [..., n] as common/checkpoint.cuh's
    store_row: scale = max(amax / 448, 2^-126) (0 for a zero row), codes of values * fp32(1 /
    scale), saturating at 448; round to nearest even, or (bits: 16 per element) fp8.cuh's
    sr_value: the bits added atop the 20 FP32 mantissa bits e4m3 drops, then cleared (below
    2^-6 on |q| + 2^-6, taken off again)."""
    v = values.to(_F32)
    amax = v.abs().amax(dim=-1)
    scale = torch.where(amax == 0, 0.0, (amax / E4M3_MAX).clamp_min(2.0**-126))
    inverse = torch.where(scale == 0, 1.0, 1.0 / scale)
    q = v * inverse[..., None]
    mag = q.abs().clamp(max=E4M3_MAX)
    if bits is not None:  # add the bits atop the 20 dropped mantissa bits, clear them
        low = mag < 2.0**-6
        m = torch.where(low, mag + 2.0**-6, mag)
        u = m.view(torch.int32).to(torch.int64) + (bits.to(torch.int64) << 4)
        mag = (u & 0x7FF00000).to(torch.int32).view(_F32).clamp(max=E4M3_MAX)
        mag = torch.where(low, mag - 2.0**-6, mag)
    code = mag.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)  # nearest, ties even
    sign = torch.where(q.view(torch.int32) < 0, 0x80, 0)
    code = torch.where(torch.isnan(q), 0x7F, code | sign)
    return code.to(torch.uint8), scale


NVFP4 = torch.float4_e2m1fn_x2
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_GAP_INVERSE = (2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.5, 0.5)  # 1 / (next value - this one)


def _e2m1_codes(q: torch.Tensor, bits: torch.Tensor | None) -> torch.Tensor:
    """e2m1 codes (int64, bit 3 the sign) of FP32 q as nvfp4.cuh's encode_rn (nearest, ties to
    the even code, saturating at 6) or, with 16 bits per value, encode_sr (up iff bits <
    (|q| - lower) / gap * 2^16)."""
    a = q.abs()
    if bits is None:
        edges = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                 (3.5, True), (5.0, False))  # fmt: skip
        code = sum(((a >= e) if even_above else (a > e)).to(torch.int64) for e, even_above in edges)
    else:
        a = a.clamp(max=6.0)
        lower = sum((a >= e).to(torch.int64) for e in _E2M1_VALUES[1:])
        table = torch.tensor(_E2M1_VALUES, dtype=_F32, device=q.device)
        gap_inverse = torch.tensor(_E2M1_GAP_INVERSE, dtype=_F32, device=q.device)
        frac = (a - table[lower]) * gap_inverse[lower] * 65536.0
        up = (lower < 7) & (bits.to(_F32) < frac)
        code = lower + up.to(torch.int64)
    return code | (torch.signbit(q).to(torch.int64) << 3)


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(_F32)


def encode_nvfp4_heads(
    values: torch.Tensor, bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed e2m1 codes uint8 [..., P, N / 2], block scale codes uint8 [..., P, N / 16], head
    scales FP32 [...]) of FP32 heads `values` [..., P, N], as common/checkpoint.cuh's NVFP4
    store: head = max(amax / 2688, 2^-117) (0 for a zero head); block code = e4m3 of
    fp32(fp32(block amax / 6) / head), nearest, saturating; codes of value * fp32(1 / S), S =
    fp32(e4m3(block) * head), +0 where S is 0; RN or (bits) SR."""
    v = values.to(_F32)
    amax = v.abs().amax(dim=(-2, -1))
    head = torch.where(amax == 0, 0.0, (amax / 2688.0).clamp_min(2.0**-117))
    block_amax = v.unflatten(-1, (-1, 16)).abs().amax(dim=-1)
    per_block = block_amax / 6.0
    h = head[..., None, None]
    scaled = torch.where(h == 0, per_block, per_block / torch.where(h == 0, 1.0, h))
    blocks = scaled.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    s = (_e4m3_values(blocks) * h).repeat_interleave(16, dim=-1)
    inverse = torch.where(s == 0, 0.0, 1.0 / torch.where(s == 0, 1.0, s))
    q = torch.where(inverse == 0, 0.0, v * inverse)
    codes = _e2m1_codes(q, bits)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, blocks, head


def decode_nvfp4_heads(
    packed: torch.Tensor, blocks: torch.Tensor, head: torch.Tensor
) -> torch.Tensor:
    """FP32 values fp32(e2m1(code) * S) of encode_nvfp4_heads' output, S = fp32(e4m3(block) * head)."""
    p = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)
    table = torch.tensor(_E2M1_VALUES, dtype=_F32, device=packed.device)
    e2m1 = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    s = _e4m3_values(blocks.view(torch.uint8)) * head.to(_F32)[..., None, None]
    return e2m1 * s.repeat_interleave(16, dim=-1)


def _load_state(
    state: torch.Tensor, state_scale: torch.Tensor | None, slots, block_scale=None
) -> torch.Tensor:
    """state[slots] as FP32: e4m3 codes times their row's scale (one FP32 product, as
    TileCheckpoint::values), nvfp4 codes times their block multiplier, other formats
    converted exactly."""
    if state.dtype == NVFP4:
        return decode_nvfp4_heads(raw_bits(state)[slots], block_scale[slots], state_scale[slots])
    values = state[slots].to(_F32)
    if state_scale is None:
        return values
    return values * state_scale[slots].to(_F32).unsqueeze(-1)


def checkpoint_values(tensors, slots) -> torch.Tensor:
    """The carried checkpoint of `slots` (an index) as FP32, from a layout's tensors by name
    (state, with state_scale (and state_block_scale) where it is e4m3 (nvfp4))."""
    return _load_state(tensors["state"], tensors.get("state_scale"), slots,
                       tensors.get("state_block_scale"))  # fmt: skip


def store_checkpoint(tensors, slots, values: torch.Tensor) -> None:
    """Every checkpoint copy of `slots` (an index) from FP32 `values`, rounded to nearest:
    state (with its scales) and separate mode's read copy (read_state, with its scales)."""
    zero = torch.zeros(values.shape[0], dtype=torch.int64, device=values.device)
    for prefix in ("state", "read"):
        codes = "state" if prefix == "state" else "read_state"
        if tensors.get(codes) is not None:
            _store_state(tensors[codes], slots, values, sr=False, seed=0, epochs=zero,
                         state_scale=tensors.get(f"{prefix}_scale"),
                         block_scale=tensors.get(f"{prefix}_block_scale"))  # fmt: skip


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or its bytes (uint8) where it is FP8 or NVFP4, for the index ops they lack."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, NVFP4) else t


# A read copy's rounding stream has the top bit set (read_copy_rounding_key in checkpoint.cuh).
_READ_COPY_STREAM = -(2**63)


def _store_state(
    state: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
    *,
    sr: bool,
    seed: int,
    epochs: torch.Tensor,
    state_scale: torch.Tensor | None = None,
    read_copy: bool = False,
    block_scale: torch.Tensor | None = None,
) -> None:
    """state[slots] = FP32 `values` [rows, *state.shape[1:]] in state's dtype: round to nearest,
    or (sr) stochastically with the key store_values gets (slot << 32 | epoch, with the top bit
    for a read copy; flat element). e4m3 stores codes and their row scales (state_scale[slots])
    as reference.precision.fp8_encode does; nvfp4 codes, block scales and head scales
    (encode_nvfp4_heads)."""
    fp8 = state.dtype == torch.float8_e4m3fn
    bits = None
    if sr and state.dtype != _F32:
        per_slot = values.shape[1:]
        element = torch.arange(per_slot.numel(), dtype=torch.int64, device=values.device)
        stream = (slots.to(torch.int64) << 32) | epochs.to(torch.int64)  # int32 epochs sign-extend
        if read_copy:
            stream = stream | _READ_COPY_STREAM
        bits = rounding_bits(seed, stream[:, None], element[None, :]).view(values.shape)
    if state.dtype == NVFP4:
        packed, blocks, head = encode_nvfp4_heads(values, bits)
        raw_bits(state)[slots] = packed
        block_scale.view(torch.uint8)[slots] = blocks
        state_scale[slots] = head
    elif fp8:
        codes, scale = encode_e4m3_rows(values, bits)
        state[slots] = codes.view(torch.float8_e4m3fn)
        state_scale[slots] = scale
    elif bits is None:
        state[slots] = values.to(state.dtype)
    else:
        state[slots] = round_stochastic(values, bits, state.dtype)


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


# compute(rows, slots, held, flush, epochs): the math of one group of rows that hold the same
# record count, and its state / ring / out writes.
_GroupCompute = Callable[[torch.Tensor, torch.Tensor, int, bool, torch.Tensor], None]


@dataclass(frozen=True)
class StepScalars:
    """The scalars a step takes besides its tensors, as the module's bindings do: ReplaySSM or
    conventional, flush-every-step mode, the window L, the spec's flags, the pad slot id, the
    stochastic-rounding seed and the layout's drafts T (the ring holds L + T rows)."""

    replay: bool
    flush_every_step: bool
    window: int
    flags: frozenset[str]
    pad_slot_id: int
    seed: int
    drafts: int = 1

    @property
    def held_limit(self) -> int:
        """One past the largest held count a standard step may find: L - 1 without drafts, else
        L + T - 1 (a verify that did not flush leaves n + t <= L + T - 1, then a commit)."""
        return self.window if self.drafts == 1 else self.window + self.drafts


def _run_rows(
    setup: StepScalars,
    *,
    sr: bool,
    cursors: torch.Tensor | None,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    compute: _GroupCompute,
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
    held_of_row, epoch_of_row = words[:, CURSOR_HELD], words[:, CURSOR_EPOCH]
    # A corrupted cursor, as the kernels see it.
    faulted = (held_of_row < 0) | (held_of_row >= setup.held_limit)
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
            cursors[group_slots, CURSOR_EPOCH] = (
                cursors[group_slots, CURSOR_EPOCH] + 1
            )  # epoch only (int32 wraps)
        else:
            cursors[group_slots, CURSOR_HELD] = 0 if flush else records
            if flush:
                cursors[group_slots, CURSOR_EPOCH] = cursors[group_slots, CURSOR_EPOCH] + 1
            cursors[group_slots, CURSOR_ARRIVALS] = 0
        cursors[group_slots, CURSOR_PENDING] = 0  # pending drafts dropped, never committed


def _check_flags(flags: frozenset[str], known: set[str], family: str) -> bool:
    unknown = set(flags) - known
    if unknown:
        raise ValueError(f"flags: unknown {family} flags {sorted(unknown)}")
    return "sr" in flags


# ---------------------------------------------------------------------------------------------
# Mamba-2
# ---------------------------------------------------------------------------------------------

_MAMBA2_FLAGS = {"d", "z", "dt_bias", "dt_softplus", "sr", "read_rn", "device_seed"}


def mamba2_step(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    state_scale: torch.Tensor | None = None,
    read_state: torch.Tensor | None = None,
    read_scale: torch.Tensor | None = None,
    state_block_scale: torch.Tensor | None = None,
    read_block_scale: torch.Tensor | None = None,
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

    state [slots, H, P, N] (e4m3: with state_scale [slots, H, P]; nvfp4: [slots, H, P, N / 2]
    with state_scale [slots, H] and state_block_scale [slots, H, P, N / 16]); separate mode's
    read copy read_state (read_scale, read_block_scale), which non-flush steps read and flushes
    rewrite from the new state;
    rec_x [slots, H, CAP, P] act, rec_b [slots, G, CAP, N] act, rec_dt
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
        dt_j = _mamba2_gates(dt[rows].to(_F32), dt_bias, has_bias, softplus)  # [b, H]
        xs = _with_current(rec_x, slots, held, x_j)  # [b, H, j, P]
        bs = _with_current(rec_b, slots, held, B[rows])  # [b, G, j, N]
        dts = _with_current(rec_dt, slots, held, dt_j)  # [b, H, j]
        decay, total = _suffix_decays(dts * a[:, None])  # [b, H, j], [b, H]
        weight = decay * dts  # a(i+1:j) dt_i
        q = c.repeat_interleave(per_group, dim=1)  # [b, H, N]
        reads = read_state is not None and not flush
        copy = (read_state, read_scale) if reads else (state, state_scale)
        s = _load_state(*copy, slots, read_block_scale if reads else state_block_scale)
        extra = D.to(_F32)[:, None] * x_j if has_d else torch.zeros_like(x_j)
        if flush:
            keys = bs.repeat_interleave(per_group, dim=1)  # [b, H, j, N]
            vals = xs * weight[..., None]  # [b, H, j, P]
            s = s * total[..., None, None] + vals.transpose(-1, -2) @ keys
            y = (s @ q[..., None]).squeeze(-1) + extra
            _store_state(state, slots, s, sr=sr, seed=seed, epochs=epochs, state_scale=state_scale,
                         block_scale=state_block_scale)  # fmt: skip
            if read_state is not None:
                _store_state(read_state, slots, s, sr=sr and "read_rn" not in flags, seed=seed,
                             epochs=epochs, state_scale=read_scale, read_copy=True,
                             block_scale=read_block_scale)  # fmt: skip
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

_GDN_FLAGS = {"qk_l2norm", "gates_in_kernel", "sr", "read_rn", "device_seed"}


def gdn_step(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    state_scale: torch.Tensor | None = None,
    read_state: torch.Tensor | None = None,
    read_scale: torch.Tensor | None = None,
    state_block_scale: torch.Tensor | None = None,
    read_block_scale: torch.Tensor | None = None,
    rec_u: torch.Tensor | None,
    rec_k: torch.Tensor | None,
    rec_g: torch.Tensor | None,
    cursors: torch.Tensor | None,
    rec_v: torch.Tensor | None = None,
    rec_beta: torch.Tensor | None = None,
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
    A non-flush step appends (u_j, raw k_j, g_j) at ring row n. Separate mode (read_state, its
    read_scale for e4m3, rec_v [slots, HV, CAP, V] act, rec_beta [slots, HV, CAP] f32): non-flush
    steps read S_c from the read copy and append (v_j, beta_j) too; a flush recomputes each held
    u_i from state by the formula above (record i's own step, from state), folds, and stores
    both copies.
    """
    return _delta_step(
        setup, "GDN", lambda rows: _gdn_gates(gate_a[rows], gate_b[rows], A_log, dt_bias,
                                              "gates_in_kernel" in setup.flags),
        copies=(state, state_scale, state_block_scale),
        read_copy=(read_state, read_scale, read_block_scale), rec_u=rec_u,
        rec_k=rec_k, rec_g=rec_g, rec_v=rec_v, rec_beta=rec_beta, cursors=cursors, q=q, k=k, v=v,
        scale=scale, out=out,
        slot_indices=slot_indices,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Kimi Delta Attention: GDN with a decay per key channel
# ---------------------------------------------------------------------------------------------


def _kda_gates(gate_a, gate_b, A_log, dt_bias, lower_bound: float, gates_in_kernel: bool):
    """(g [b, HV, K], beta [b, HV]) FP32 from the given gates: raw a [b, HV, K], b with
    "gates_in_kernel" (fla's gate, or the safe gate where lower_bound < 0), else g and beta."""
    g, beta = gate_a.to(_F32), gate_b.to(_F32)
    if gates_in_kernel:
        x = g + dt_bias.to(_F32).view(g.shape[1], g.shape[2])
        rate = torch.exp(A_log.to(_F32))[:, None]
        g = lower_bound * _sigmoid(rate * x) if lower_bound < 0 else -rate * _softplus(x)
        beta = _sigmoid(beta)
    return g, beta


def kda_step(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    state_scale: torch.Tensor | None = None,
    read_state: torch.Tensor | None = None,
    read_scale: torch.Tensor | None = None,
    state_block_scale: torch.Tensor | None = None,
    read_block_scale: torch.Tensor | None = None,
    rec_u: torch.Tensor | None,
    rec_k: torch.Tensor | None,
    rec_g: torch.Tensor | None,
    cursors: torch.Tensor | None,
    rec_v: torch.Tensor | None = None,
    rec_beta: torch.Tensor | None = None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_a: torch.Tensor,
    gate_b: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    scale: float,
    lower_bound: float,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """One KDA decode step (conventional or ReplaySSM), as the module's bindings take it.

    Tensors as gdn_step's, except rec_g [slots, HV, CAP, K], gate_a [batch, HV, K] (a, or g)
    and dt_bias [HV * K]; lower_bound < 0 selects the safe gate (0: fla's gate). With j records,
    dec_i [K] = exp(sum_{m>i} g_m) and tot [K] = a(1:j) per channel, k^, q^ as gdn_step's:
        u_j = beta (v - (S_c (tot * k^_j) + sum_{i<j} ((dec_i * k^_i) . k^_j) u_i))
        flush:  S <- S_c Diag(tot) + sum_i u_i (dec_i * k^_i)^T, o = S q^
        else:   o = S_c (tot * q^) + sum_{i<=j} ((dec_i * k^_i) . q^) u_i
    A non-flush step appends (u_j, raw k_j, g_j [HV, K]) at ring row n.
    """
    return _delta_step(
        setup, "KDA", lambda rows: _kda_gates(gate_a[rows], gate_b[rows], A_log, dt_bias,
                                              lower_bound, "gates_in_kernel" in setup.flags),
        copies=(state, state_scale, state_block_scale),
        read_copy=(read_state, read_scale, read_block_scale), rec_u=rec_u,
        rec_k=rec_k, rec_g=rec_g, rec_v=rec_v, rec_beta=rec_beta, cursors=cursors, q=q, k=k, v=v,
        scale=scale, out=out,
        slot_indices=slot_indices,
    )  # fmt: skip


def _delta_step(setup: StepScalars, family: str, gates, *, copies, read_copy, rec_u,
                rec_k, rec_g, rec_v, rec_beta, cursors, q, k, v, scale: float, out,
                slot_indices) -> None:  # fmt: skip
    """The delta-rule step of gdn_step and kda_step: `gates(rows)` gives (g, beta), g a log-decay
    per value head ([b, HV], GDN) or per key channel ([b, HV, K], KDA); a per-head one is the
    per-channel step with the same decay on every channel. copies: (state, state_scale,
    state_block_scale), the scales where its format has them. read_copy: separate mode's
    (read_state, read_scale, read_block_scale), or Nones: non-flush steps
    read it and append (v, beta) to rec_v, rec_beta too; a flush recomputes each held u from
    state, in record order, as the non-flush steps of a one-copy run of state's dtype did."""
    state, state_scale, state_block_scale = copies
    read_state, read_scale, read_block_scale = read_copy
    flags, seed = setup.flags, setup.seed
    sr = _check_flags(flags, _GDN_FLAGS, family)
    k_heads, v_heads = q.shape[1], v.shape[1]
    per_key = v_heads // k_heads
    l2norm = "qk_l2norm" in flags

    def compute(rows, slots, held, flush, epochs):
        q_j = q[rows].to(_F32)  # [b, H, K]
        k_j = k[rows].to(_F32)
        v_j = v[rows].to(_F32)  # [b, HV, V]
        g_j, beta = gates(rows)
        ks = _with_current(rec_k, slots, held, k_j)  # [b, H, j, K]
        gs = _with_current(rec_g, slots, held, g_j)  # [b, HV, j] or [b, HV, j, K]
        query = q_j.repeat_interleave(per_key, dim=1)  # [b, HV, K] raw
        rq = _query_scale(q_j, l2norm, per_key, scale)  # [b, HV]
        reads = read_state is not None and not flush
        source = read_copy if reads else copies  # (codes, scales, block scales)
        s = _load_state(source[0], source[1], slots, source[2])
        us = None  # the held u [b, HV, n, V]: a separate-mode flush's again from state
        if held and read_state is not None and flush:
            vs, betas = rec_v[slots, :, :held].to(_F32), rec_beta[slots, :, :held].to(_F32)
            us = recompute_held_u(s, ks[:, :, :held], gs[:, :, :held], vs, betas, l2norm, per_key)
        elif held:
            us = rec_u[slots, :, :held].to(_F32)
        predicted, total, decayed, kq, rk = _delta_replay(s, ks, gs, us, query, l2norm, per_key)
        rk_j = rk[..., held]
        u_j = beta[..., None] * (v_j - predicted)  # [b, HV, V]
        if flush:  # weights of the decayed raw keys: rk_i u_i, and rk_j u_j for this token
            vals = (rk_j[..., None] * u_j)[:, :, None]
            if held:
                vals = torch.cat([rk[..., :held, None] * us, vals], 2)
            s = s * total[..., None, :] + vals.transpose(-1, -2) @ decayed
            o = (s @ query[..., None]).squeeze(-1) * rq[..., None]
            _store_state(state, slots, s, sr=sr, seed=seed, epochs=epochs, state_scale=state_scale,
                         block_scale=state_block_scale)  # fmt: skip
            if read_state is not None:
                _store_state(read_state, slots, s, sr=sr and "read_rn" not in flags, seed=seed,
                             epochs=epochs, state_scale=read_scale, read_copy=True,
                             block_scale=read_block_scale)  # fmt: skip
        else:
            o = (s @ (total * query)[..., None]).squeeze(-1) * rq[..., None]
            if held:
                o = o + ((kq[..., :held] * rk[..., :held] * rq[..., None])[..., None] * us).sum(2)
            o = o + (kq[..., held] * rk_j * rq)[..., None] * u_j  # dec_j = 1
        out[rows] = o.to(out.dtype)
        if not flush:  # this token's record at ring row `held` (u, g in FP32; raw k exact)
            rec_u[slots, :, held] = u_j.to(rec_u.dtype)
            rec_g[slots, :, held] = g_j.to(rec_g.dtype)
            rec_k[slots, :, held] = k[rows].to(rec_k.dtype)
            if read_state is not None:
                rec_v[slots, :, held] = v[rows].to(rec_v.dtype)
                rec_beta[slots, :, held] = beta.to(rec_beta.dtype)

    _run_rows(setup, sr=sr, cursors=cursors, out=out, slot_indices=slot_indices, compute=compute)


# ---------------------------------------------------------------------------------------------
# Speculative decoding (docs/speculative.md): verify, commit, the snapshot baseline
# ---------------------------------------------------------------------------------------------
#
# Per batch row b of a verify, slot s = slot_indices[b], with n = cursors[s, 0] committed
# records, the epoch e = cursors[s, 1] and p = cursors[s, 3] pending drafts, all read first:
#   * s == pad_slot_id: out[b] = 0; nothing else is read or written.
#   * n outside [0, L + T), p outside [0, T] or n + p > L + T - 1 (a corrupted cursor):
#     out[b] = NaN; nothing else is read or written.
#   * otherwise: a = clamp(num_accepted[b], 0, p) (0 without it), n <- n + a; t =
#     clamp(num_drafts[b], 0, T) (T without it). If n + t >= L + T the n records are folded into
#     state[s] in FP32 (stored in its dtype, "sr" keyed by e) and n <- 0, e <- e + 1; the drafts
#     then replay from the folded FP32 state. Draft j < t replays the n records, then its root
#     path (parents[b], clamped: a parent outside [-1, j) is -1), itself last; out[b, j >= t] = 0.
#     Draft j's record goes to ring row n + j. Cursor: (n, e, 0, t).


def _cursor_valid(held: torch.Tensor, pending: torch.Tensor, setup: StepScalars) -> torch.Tensor:
    """Whether each cursor is one a launch may leave (else corrupted): 0 <= n, 0 <= p <= T and
    n + p < L + T."""
    capacity = setup.window + setup.drafts
    return (held >= 0) & (pending >= 0) & (pending <= setup.drafts) & (held + pending < capacity)


def _ancestors(parents: torch.Tensor | None, rows: int, drafts: int, device) -> torch.Tensor:
    """[rows, T, T] bool: [r, j, i] = draft i is draft j or one of its ancestors. parents: [rows,
    T] int64 or None (a chain); a parent outside [-1, j) counts as -1, as the kernels clamp it."""
    index = torch.arange(drafts, device=device)
    if parents is None:
        parents = (index - 1).expand(rows, drafts)
    parents = torch.where((parents >= -1) & (parents < index), parents, -1)
    anc = torch.zeros((rows, drafts, drafts), dtype=torch.bool, device=device)
    every = torch.arange(rows, device=device)
    for j in range(drafts):  # a parent's row is complete before its children's (parent < j)
        p = parents[:, j]
        inherited = anc[every, p.clamp(min=0)] & (p >= 0)[:, None]
        anc[:, j] = inherited | (index == j)
    return anc


# compute(rows, slots, held, flush, epochs, t, ancestors): one group's drafts; `held` is the
# committed count after the fused commit (folded first where `flush`).
_DraftCompute = Callable[
    [torch.Tensor, torch.Tensor, int, bool, torch.Tensor, torch.Tensor, torch.Tensor], None
]


def _run_verify_rows(
    setup: StepScalars,
    *,
    sr: bool,
    cursors: torch.Tensor,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    num_drafts: torch.Tensor | None,
    parents: torch.Tensor | None,
    num_accepted: torch.Tensor | None,
    compute: _DraftCompute,
) -> None:
    """Pad rows, corrupted cursors, the fused commit, then `compute` once per group of rows with
    the same committed count and flush decision, then the cursor words (n, e, 0, t)."""
    T, capacity = setup.drafts, setup.window + setup.drafts
    slot_of_row = slot_indices.to(device=out.device, dtype=torch.int64)
    pad = slot_of_row == setup.pad_slot_id
    rows = torch.nonzero(~pad).flatten()
    slots = slot_of_row[rows]
    words = cursors[slots].to(torch.int64)
    held, epoch, pending = words[:, CURSOR_HELD], words[:, CURSOR_EPOCH], words[:, CURSOR_PENDING]
    valid = _cursor_valid(held, pending, setup)
    out[pad] = 0
    out[rows[~valid]] = float("nan")
    rows, slots, held, epoch, pending = (v[valid] for v in (rows, slots, held, epoch, pending))
    if num_accepted is not None:
        accepted = num_accepted.to(out.device, torch.int64)[rows].clamp(min=0)
        held = held + torch.minimum(accepted, pending)
    if num_drafts is None:
        drafts = torch.full_like(held, T)
    else:
        drafts = num_drafts.to(out.device, torch.int64)[rows].clamp(0, T)
    flush = held + drafts >= capacity
    given = None if parents is None else parents.to(out.device, torch.int64)[rows]
    anc = _ancestors(given, rows.numel(), T, out.device)
    for n, f in sorted(set(zip(held.tolist(), flush.tolist()))):
        members = (held == n) & (flush == f)
        group_slots = slots[members]
        epochs = epoch[members] if sr else torch.zeros_like(group_slots)
        compute(rows[members], group_slots, n, f, epochs, drafts[members], anc[members])
        cursors[group_slots, CURSOR_HELD] = 0 if f else n
        if f:
            cursors[group_slots, CURSOR_EPOCH] = (
                cursors[group_slots, CURSOR_EPOCH] + 1
            )  # (int32 wraps)
        cursors[group_slots, CURSOR_ARRIVALS] = 0
        cursors[group_slots, CURSOR_PENDING] = drafts[members].to(cursors.dtype)


def _live_drafts(drafts: torch.Tensor, T: int) -> torch.Tensor:
    """[rows, T] bool: draft j < t of its row."""
    return torch.arange(T, device=drafts.device) < drafts[:, None]


def _draft_inputs(t: torch.Tensor, rows: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """FP32 rows of a [batch, T, ...] input, zero past each row's t: unused drafts' inputs (any
    bits, NaN included) never reach a sum."""
    v = t[rows].to(_F32)
    mask = live.view(*live.shape, *([1] * (v.dim() - 2)))
    return torch.where(mask, v, torch.zeros((), dtype=_F32))


def _window_mask(held: int, anc: torch.Tensor) -> torch.Tensor:
    """[rows, T, held + T] bool: what draft j replays, the committed records then its path."""
    committed = torch.ones((*anc.shape[:2], held), dtype=torch.bool, device=anc.device)
    return torch.cat([committed, anc], dim=-1)


def _write_draft_records(
    slots: torch.Tensor,
    held: int,
    live: torch.Tensor,
    records: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Draft j's record at ring row held + j of each row with j < t. records: (ring, its values
    [rows, T, ...] per draft)."""
    for j in range(live.shape[1]):
        m = live[:, j]
        if not bool(m.any()):
            break  # (live drafts are a prefix of each row)
        for ring, values in records:
            ring[slots[m], :, held + j] = values[m, j].to(ring.dtype)


def _mamba2_gates(dt, dt_bias, has_bias: bool, softplus: bool) -> torch.Tensor:
    """dt after the bias and the softplus (as flagged), FP32."""
    if has_bias:
        dt = dt + dt_bias.to(_F32)
    return _softplus(dt) if softplus else dt


def mamba2_fold(s, xs, bs, dts, a, per_group) -> torch.Tensor:
    """S <- a(1:n) S + sum_i a(i+1:n) dt_i x_i B_i^T over n records (xs [b, H, n, P], bs [b, G,
    n, N], dts [b, H, n]), in FP32."""
    decay, total = _suffix_decays(dts * a[:, None])
    vals = xs * (decay * dts)[..., None]
    keys = bs.repeat_interleave(per_group, dim=1)
    return s * total[..., None, None] + vals.transpose(-1, -2) @ keys


def mamba2_verify(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    rec_x: torch.Tensor,
    rec_b: torch.Tensor,
    rec_dt: torch.Tensor,
    cursors: torch.Tensor,
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
    num_drafts: torch.Tensor | None,
    parents: torch.Tensor | None,
    num_accepted: torch.Tensor | None,
) -> None:
    """Verify T Mamba-2 drafts per row, as the module's verify_step binding takes them.

    Tensors as in mamba2_step with a draft dim: x, z [batch, T, H, P]; dt [batch, T, H] raw;
    B, C [batch, T, G, N]; out [batch, T, H, P]; num_drafts, num_accepted [batch] and parents
    [batch, T] int (or None). Draft j with window W_j (the committed records, then its root
    path) has y_j = a(W_j) (S C_j) + sum_{i in W_j} a(i+1:end of W_j) dt_i (B_i . C_j) x_i
    + D x_j, then y_j *= silu(z_j) with "z". Rows, flush and cursors: see the section notes.
    """
    flags, seed, T = setup.flags, setup.seed, setup.drafts
    sr = _check_flags(flags, _MAMBA2_FLAGS, "Mamba-2")
    heads, groups = x.shape[2], B.shape[2]
    per_group = heads // groups
    has_bias, softplus = "dt_bias" in flags, "dt_softplus" in flags
    a = A.to(_F32)

    def compute(rows, slots, held, flush, epochs, drafts, anc):
        live = _live_drafts(drafts, T)
        x_d = _draft_inputs(x, rows, live)  # [r, T, H, P]
        dt_d = _mamba2_gates(_draft_inputs(dt, rows, live), dt_bias, has_bias, softplus)
        dt_d = torch.where(live[..., None], dt_d, 0.0)  # [r, T, H]
        b_d = _draft_inputs(B, rows, live)  # [r, T, G, N]
        c_d = _draft_inputs(C, rows, live)
        s = state[slots].to(_F32)  # [r, H, P, N]
        if flush:  # early flush: the committed records only, never the drafts
            s = mamba2_fold(s, rec_x[slots, :, :held].to(_F32), rec_b[slots, :, :held].to(_F32),
                             rec_dt[slots, :, :held].to(_F32), a, per_group)  # fmt: skip
            _store_state(state, slots, s, sr=sr, seed=seed, epochs=epochs)
            held = 0
        xs = torch.cat([rec_x[slots, :, :held].to(_F32), x_d.transpose(1, 2)], 2)  # [r,H,M,P]
        bs = torch.cat([rec_b[slots, :, :held].to(_F32), b_d.transpose(1, 2)], 2)  # [r,G,M,N]
        dts = torch.cat([rec_dt[slots, :, :held].to(_F32), dt_d.transpose(1, 2)], 2)  # [r,H,M]
        window = _window_mask(held, anc)[:, None]  # [r, 1, T, M]
        log_decay = torch.where(window, (dts * a[:, None])[:, :, None], 0.0)  # [r, H, T, M]
        decay, total = _suffix_decays(log_decay)  # [r, H, T, M], [r, H, T]
        weight = torch.where(window, decay * dts[:, :, None], 0.0)
        c_heads = c_d.transpose(1, 2)  # [r, G, T, N]
        dots = (c_heads @ bs.transpose(-1, -2)).repeat_interleave(per_group, dim=1)  # B_i . C_j
        q = c_heads.repeat_interleave(per_group, dim=1)  # [r, H, T, N]
        # A select, not a zero weight: a NaN draft outside j's window stays out (0 * NaN = NaN).
        terms = torch.where(window[..., None], (weight * dots)[..., None] * xs[:, :, None], 0.0)
        y = total[..., None] * (q @ s.transpose(-1, -2)) + terms.sum(3)  # [r, H, T, P]
        y = y.transpose(1, 2)  # [r, T, H, P]
        if "d" in flags:
            y = y + D.to(_F32)[:, None] * x_d
        if "z" in flags:
            zr = _draft_inputs(z, rows, live)
            y = y * (zr / (1.0 + torch.exp(-zr)))
        out[rows] = torch.where(live[..., None, None], y, 0.0).to(out.dtype)
        _write_draft_records(slots, held, live, [(rec_x, x[rows]), (rec_b, B[rows]),
                                                 (rec_dt, dt_d)])  # fmt: skip

    _run_verify_rows(setup, sr=sr, cursors=cursors, out=out, slot_indices=slot_indices,
                     num_drafts=num_drafts, parents=parents, num_accepted=num_accepted,
                     compute=compute)  # fmt: skip


def _gdn_gates(gate_a, gate_b, A_log, dt_bias, gates_in_kernel: bool):
    """(g, beta) FP32 from the given gates: raw a, b with "gates_in_kernel", else g and beta."""
    g, beta = gate_a.to(_F32), gate_b.to(_F32)
    if gates_in_kernel:
        g = -torch.exp(A_log.to(_F32)) * _softplus(g + dt_bias.to(_F32))
        beta = _sigmoid(beta)
    return g, beta


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


def _delta_replay(s, ks, gs, us, query, l2norm: bool, per_key: int):
    """The last of j records' terms from checkpoint values s [b, HV, V, K] and the held u's us
    [b, HV, j - 1, V] (None for none): total S_c k^_j + pred (alpha_j S_{j-1} k^_j), and the
    total decay, the decayed raw keys, their dots with `query` and the key norms."""
    held = ks.shape[2] - 1
    if gs.dim() == 3:
        gs = gs[..., None].expand(*gs.shape, ks.shape[-1])
    decay, total = _suffix_decays(gs.transpose(-1, -2))  # [b, HV, K, j], [b, HV, K]
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
        predicted = _delta_replay(s, ks[:, :, : i + 1], gs[:, :, : i + 1], us[:, :, :i],
                                  ks[:, :, i].repeat_interleave(per_key, dim=1), l2norm,
                                  per_key)[0]  # fmt: skip
        us[:, :, i] = betas[:, :, i, None] * (vs[:, :, i] - predicted)
    return us


def delta_fold(s, us, ks, gs, l2norm: bool, per_key: int) -> torch.Tensor:
    """S <- S Diag(a(1:n)) + sum_i u_i (a(i+1:n) * k^_i)^T over n records (us [b, HV, n, V],
    raw ks [b, H, n, K], gs [b, HV, n] log-decays per head, or [b, HV, n, K] per key channel),
    in FP32."""
    if gs.dim() == 3:
        gs = gs[..., None].expand(*gs.shape, ks.shape[-1])
    decay, total = _suffix_decays(gs.transpose(-1, -2))  # [b, HV, K, n], [b, HV, K]
    decayed = ks.repeat_interleave(per_key, dim=1) * decay.transpose(-1, -2)
    vals = _key_norms(ks, l2norm, per_key)[..., None] * us
    return s * total[..., None, :] + vals.transpose(-1, -2) @ decayed


def gdn_verify(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    rec_u: torch.Tensor,
    rec_k: torch.Tensor,
    rec_g: torch.Tensor,
    cursors: torch.Tensor,
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
    num_drafts: torch.Tensor | None,
    parents: torch.Tensor | None,
    num_accepted: torch.Tensor | None,
) -> None:
    """Verify T GDN drafts per row, as the module's verify_step binding takes them.

    Tensors as in gdn_step with a draft dim: q, k [batch, T, H, K]; v [batch, T, HV, V]; gate_a,
    gate_b [batch, T, HV]; out [batch, T, HV, V]; num_drafts, num_accepted [batch] and parents
    [batch, T] int (or None). Drafts run in index order (a parent precedes its children), each
    over its window W_j (the committed records, then its root path): with tot = a(W_j) and dec_i
    the decay from record i to j,
        u_j = beta_j (v_j - (tot S k^_j + sum_{i in W_j, i != j} dec_i (k^_i . k^_j) u_i))
        o_j = tot S q^_j + sum_{i in W_j} dec_i (k^_i . q^_j) u_i
    so each u is computed along its own root path. Rows, flush and cursors: see the section
    notes.
    """
    gates_in_kernel = "gates_in_kernel" in setup.flags
    _delta_verify(
        setup, "GDN",
        lambda rows, live: _gdn_gates(_draft_inputs(gate_a, rows, live),
                                      _draft_inputs(gate_b, rows, live), A_log, dt_bias,
                                      gates_in_kernel),
        state=state, rec_u=rec_u, rec_k=rec_k, rec_g=rec_g, cursors=cursors, q=q, k=k, v=v,
        scale=scale, out=out, slot_indices=slot_indices, num_drafts=num_drafts,
        parents=parents, num_accepted=num_accepted,
    )  # fmt: skip


def kda_verify(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    rec_u: torch.Tensor,
    rec_k: torch.Tensor,
    rec_g: torch.Tensor,
    cursors: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_a: torch.Tensor,
    gate_b: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    scale: float,
    lower_bound: float,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    num_drafts: torch.Tensor | None,
    parents: torch.Tensor | None,
    num_accepted: torch.Tensor | None,
) -> None:
    """Verify T KDA drafts per row: gdn_verify with gate_a [batch, T, HV, K], dt_bias [HV * K]
    and kda_step's gates; tot and dec_i are vectors over the key channels, inside the dots:
        u_j = beta_j (v_j - (S (tot * k^_j) + sum_{i in W_j, i != j} ((dec_i * k^_i) . k^_j) u_i))
        o_j = S (tot * q^_j) + sum_{i in W_j} ((dec_i * k^_i) . q^_j) u_i
    """
    gates_in_kernel = "gates_in_kernel" in setup.flags

    def gates(rows, live):
        a, b = _draft_inputs(gate_a, rows, live), _draft_inputs(gate_b, rows, live)
        g, beta = _kda_gates(a.flatten(0, 1), b.flatten(0, 1), A_log, dt_bias, lower_bound,
                             gates_in_kernel)  # fmt: skip
        return g.view(a.shape), beta.view(b.shape)

    _delta_verify(
        setup, "KDA", gates, state=state, rec_u=rec_u, rec_k=rec_k, rec_g=rec_g,
        cursors=cursors, q=q, k=k, v=v, scale=scale, out=out, slot_indices=slot_indices,
        num_drafts=num_drafts, parents=parents, num_accepted=num_accepted,
    )  # fmt: skip


def _delta_verify(setup: StepScalars, family: str, gates, *, state, rec_u, rec_k, rec_g, cursors,
                  q, k, v, scale: float, out, slot_indices, num_drafts, parents,
                  num_accepted) -> None:  # fmt: skip
    """The body of gdn_verify and kda_verify: `gates(rows, live)` gives the drafts' (g, beta)
    [r, T, HV] (or g [r, T, HV, K] per key channel); a per-head decay is the per-channel one
    with the same decay on every channel."""
    flags, seed, T = setup.flags, setup.seed, setup.drafts
    sr = _check_flags(flags, _GDN_FLAGS, family)
    k_heads, v_heads, K = q.shape[2], v.shape[2], q.shape[3]
    per_key = v_heads // k_heads
    l2norm = "qk_l2norm" in flags

    def per_channel(g: torch.Tensor) -> torch.Tensor:
        return g if g.dim() == 4 else g[..., None].expand(*g.shape, K)

    def compute(rows, slots, held, flush, epochs, drafts, anc):
        live = _live_drafts(drafts, T)
        q_d = _draft_inputs(q, rows, live)  # [r, T, H, K]
        k_d = _draft_inputs(k, rows, live)
        v_d = _draft_inputs(v, rows, live)  # [r, T, HV, V]
        g_d, beta_d = gates(rows, live)  # [r, T, HV] or [r, T, HV, K]
        g_d = torch.where(live.view(*live.shape, *([1] * (g_d.dim() - 2))), g_d, 0.0)
        s = state[slots].to(_F32)  # [r, HV, V, K]
        if flush:  # early flush: the committed records only, never the drafts
            s = delta_fold(s, rec_u[slots, :, :held].to(_F32), rec_k[slots, :, :held].to(_F32),
                            rec_g[slots, :, :held].to(_F32), l2norm, per_key)  # fmt: skip
            _store_state(state, slots, s, sr=sr, seed=seed, epochs=epochs)
            held = 0
        ks = torch.cat([rec_k[slots, :, :held].to(_F32), k_d.transpose(1, 2)], 2)  # [r,H,M,K]
        gs = torch.cat([per_channel(rec_g[slots, :, :held].to(_F32)),
                        per_channel(g_d).transpose(1, 2)], 2)  # [r, HV, M, K]  # fmt: skip
        us = torch.cat([rec_u[slots, :, :held].to(_F32),
                        torch.zeros_like(v_d).transpose(1, 2)], 2)  # [r, HV, M, V]  # fmt: skip
        rk = _key_norms(ks, l2norm, per_key)  # [r, HV, M]
        keys = ks.repeat_interleave(per_key, dim=1)  # [r, HV, M, K] raw
        windows = _window_mask(held, anc)  # [r, T, M]
        outs = []
        for j in range(T):
            at = held + j
            window = windows[:, j, None]  # [r, 1, M]
            # [r, HV, K, M], [r, HV, K]
            decay, total = _suffix_decays(
                torch.where(window[..., None, :], gs.transpose(-1, -2), 0.0)
            )
            decayed = keys * decay.transpose(-1, -2)  # k_i * dec_i over W_j
            before = window.clone()
            before[..., at] = False  # the records replayed before draft j
            q_j, query = q_d[:, j], q_d[:, j].repeat_interleave(per_key, dim=1)  # [r, HV, K]
            key_j = keys[:, :, at]
            kk = (decayed @ key_j[..., None]).squeeze(-1)  # [r, HV, M]
            kq = (decayed @ query[..., None]).squeeze(-1)
            rq = _query_scale(q_j, l2norm, per_key, scale)  # [r, HV]
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
        out[rows] = torch.stack(outs, dim=1).to(out.dtype)
        u_d = us[:, :, held:].transpose(1, 2)  # [r, T, HV, V]
        _write_draft_records(slots, held, live, [(rec_u, u_d), (rec_g, g_d), (rec_k, k[rows])])

    _run_verify_rows(setup, sr=sr, cursors=cursors, out=out, slot_indices=slot_indices,
                     num_drafts=num_drafts, parents=parents, num_accepted=num_accepted,
                     compute=compute)  # fmt: skip


def commit(
    setup: StepScalars,
    *,
    cursors: torch.Tensor,
    rings: list[torch.Tensor],
    num_accepted: torch.Tensor,
    accepted_path: torch.Tensor | None,
    slot_indices: torch.Tensor,
) -> None:
    """Commit the accepted drafts of the last verify, as the module's commit_step binding does.

    rings: the layout's rings [slots, heads, CAP, ...]; num_accepted [batch] int; accepted_path
    [batch, T] int or None. Per row (pad rows and corrupted cursors are left alone): a =
    clamp(num_accepted[b], 0, p). A tree path (indices clamped to [0, p)) is compacted first:
    for i < a in order, every ring's row n + path[i] is copied to row n + i. Then word 0 = n + a
    and word 3 = 0; words 1 and 2 stay.
    """
    slot_of_row = slot_indices.to(device=cursors.device, dtype=torch.int64)
    rows = torch.nonzero(slot_of_row != setup.pad_slot_id).flatten()
    slots = slot_of_row[rows]
    words = cursors[slots].to(torch.int64)
    held, pending = words[:, CURSOR_HELD], words[:, CURSOR_PENDING]
    valid = _cursor_valid(held, pending, setup)
    rows, slots, held, pending = rows[valid], slots[valid], held[valid], pending[valid]
    accepted = num_accepted.to(cursors.device, torch.int64)[rows].clamp(min=0)
    accepted = torch.minimum(accepted, pending)
    if accepted_path is not None:
        path = accepted_path.to(cursors.device, torch.int64)[rows].clamp(min=0)
        path = torch.minimum(path, (pending - 1).clamp(min=0)[:, None])
        for i in range(path.shape[1]):
            m = accepted > i
            if not bool(m.any()):
                break
            src, dst = held[m] + path[m, i], held[m] + i
            for ring in rings:  # (the gather copies before the row is written)
                ring[slots[m], :, dst] = ring[slots[m], :, src]
    cursors[slots, CURSOR_HELD] = (held + accepted).to(cursors.dtype)
    cursors[slots, CURSOR_PENDING] = 0


def _run_snapshot_rows(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    snapshot_slots: torch.Tensor,
    num_drafts: torch.Tensor | None,
    token: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor],
) -> None:
    """The conventional spec baseline's rows: pad rows zero, the others read state[slot] once and
    run their t drafts as a chain, `token(s, rows, j, live) -> (y, s)` per draft, writing the
    state after draft j (rounded to nearest: the binding takes no seed) into
    state[snapshot_slots[b, j]] (skipped where that id is out of range, as the kernels do) and
    out[b, j]; out[b, j >= t] = 0."""
    T = setup.drafts
    slot_of_row = slot_indices.to(device=out.device, dtype=torch.int64)
    pad = slot_of_row == setup.pad_slot_id
    out[pad] = 0
    rows = torch.nonzero(~pad).flatten()
    if num_drafts is None:
        drafts = torch.full((rows.numel(),), T, dtype=torch.int64, device=out.device)
    else:
        drafts = num_drafts.to(out.device, torch.int64)[rows].clamp(0, T)
    live = _live_drafts(drafts, T)
    targets = snapshot_slots.to(out.device, torch.int64)[rows]
    written = live & (targets >= 0) & (targets < state.shape[0])
    s = state[slot_of_row[rows]].to(_F32)
    outs = []
    for j in range(T):
        y, s = token(s, rows, j, live)
        state[targets[written[:, j], j]] = s[written[:, j]].to(state.dtype)
        outs.append(torch.where(live[:, j].view(-1, *([1] * (y.dim() - 1))), y, 0.0))
    out[rows] = torch.stack(outs, dim=1).to(out.dtype)


def mamba2_snapshot(
    setup: StepScalars,
    *,
    state: torch.Tensor,
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
    snapshot_slots: torch.Tensor,
    num_drafts: torch.Tensor | None,
) -> None:
    """The conventional Mamba-2 spec baseline, as the module's snapshot_step binding takes it:
    inputs as mamba2_verify's, snapshot_slots [batch, T] int. Draft j of a row is a
    conventional step of the state after draft j - 1 (S <- exp(dt A) S + dt x B^T, y = S C + D x,
    y *= silu(z)); the state slot_indices[b] is read, never written."""
    flags = setup.flags
    _check_flags(flags, _MAMBA2_FLAGS, "Mamba-2")
    per_group = x.shape[2] // B.shape[2]
    has_bias, softplus = "dt_bias" in flags, "dt_softplus" in flags
    a = A.to(_F32)

    def token(s, rows, j, live):
        x_j = _draft_inputs(x, rows, live)[:, j]  # [r, H, P]
        dt_j = _mamba2_gates(_draft_inputs(dt, rows, live)[:, j], dt_bias, has_bias, softplus)
        keys = _draft_inputs(B, rows, live)[:, j].repeat_interleave(per_group, dim=1)  # [r,H,N]
        q = _draft_inputs(C, rows, live)[:, j].repeat_interleave(per_group, dim=1)
        vals = (dt_j[..., None] * x_j)[..., None]  # [r, H, P, 1]
        s = torch.exp(dt_j * a)[..., None, None] * s + vals * keys[:, :, None]
        y = (s @ q[..., None]).squeeze(-1)
        if "d" in flags:
            y = y + D.to(_F32)[:, None] * x_j
        if "z" in flags:
            zr = _draft_inputs(z, rows, live)[:, j]
            y = y * (zr / (1.0 + torch.exp(-zr)))
        return y, s

    _run_snapshot_rows(setup, state=state, out=out, slot_indices=slot_indices,
                       snapshot_slots=snapshot_slots, num_drafts=num_drafts,
                       token=token)  # fmt: skip


def gdn_snapshot(
    setup: StepScalars,
    *,
    state: torch.Tensor,
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
    snapshot_slots: torch.Tensor,
    num_drafts: torch.Tensor | None,
) -> None:
    """The conventional GDN spec baseline, as the module's snapshot_step binding takes it:
    inputs as gdn_verify's, snapshot_slots [batch, T] int. Draft j of a row is a conventional
    step of the state after draft j - 1 (u = beta (v - alpha S k^), S <- alpha S + u k^T,
    o = S q^); the state slot_indices[b] is read, never written."""
    gates_in_kernel = "gates_in_kernel" in setup.flags
    _delta_snapshot(
        setup, "GDN",
        lambda rows, live, j: _gdn_gates(_draft_inputs(gate_a, rows, live)[:, j],
                                         _draft_inputs(gate_b, rows, live)[:, j], A_log,
                                         dt_bias, gates_in_kernel),
        state=state, q=q, k=k, v=v, scale=scale, out=out, slot_indices=slot_indices,
        snapshot_slots=snapshot_slots, num_drafts=num_drafts,
    )  # fmt: skip


def kda_snapshot(
    setup: StepScalars,
    *,
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_a: torch.Tensor,
    gate_b: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    scale: float,
    lower_bound: float,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    snapshot_slots: torch.Tensor,
    num_drafts: torch.Tensor | None,
) -> None:
    """The conventional KDA spec baseline: gdn_snapshot with kda_verify's gates and a decay per
    key channel (S <- S Diag(alpha) + u k^T, u = beta (v - S Diag(alpha) k^))."""
    gates_in_kernel = "gates_in_kernel" in setup.flags
    _delta_snapshot(
        setup, "KDA",
        lambda rows, live, j: _kda_gates(_draft_inputs(gate_a, rows, live)[:, j],
                                         _draft_inputs(gate_b, rows, live)[:, j], A_log,
                                         dt_bias, lower_bound, gates_in_kernel),
        state=state, q=q, k=k, v=v, scale=scale, out=out, slot_indices=slot_indices,
        snapshot_slots=snapshot_slots, num_drafts=num_drafts,
    )  # fmt: skip


def _delta_snapshot(setup: StepScalars, family: str, gates, *, state, q, k, v, scale: float, out,
                    slot_indices, snapshot_slots, num_drafts) -> None:  # fmt: skip
    """The body of gdn_snapshot and kda_snapshot: `gates(rows, live, j)` gives draft j's (g,
    beta), g [r, HV] per head or [r, HV, K] per key channel."""
    flags = setup.flags
    _check_flags(flags, _GDN_FLAGS, family)
    per_key = v.shape[2] // q.shape[2]
    l2norm = "qk_l2norm" in flags

    def token(s, rows, j, live):
        q_j = _draft_inputs(q, rows, live)[:, j]  # [r, H, K]
        k_j = _draft_inputs(k, rows, live)[:, j]
        v_j = _draft_inputs(v, rows, live)[:, j]  # [r, HV, V]
        g_j, beta = gates(rows, live, j)
        rk = _key_norms(k_j[:, :, None], l2norm, per_key)[..., 0]  # [r, HV]
        key = k_j.repeat_interleave(per_key, dim=1) * rk[..., None]  # k^ [r, HV, K]
        query = q_j.repeat_interleave(per_key, dim=1)
        query = query * _query_scale(q_j, l2norm, per_key, scale)[..., None]
        alpha = torch.exp(g_j)[..., None, None] if g_j.dim() == 2 else torch.exp(g_j)[..., None, :]
        s = alpha * s
        u = beta[..., None] * (v_j - (s @ key[..., None]).squeeze(-1))
        s = s + u[..., None] * key[:, :, None]
        return (s @ query[..., None]).squeeze(-1), s

    _run_snapshot_rows(setup, state=state, out=out, slot_indices=slot_indices,
                       snapshot_slots=snapshot_slots, num_drafts=num_drafts,
                       token=token)  # fmt: skip
