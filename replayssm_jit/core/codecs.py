"""Checkpoint formats' arithmetic, bit for bit as the kernels do it (templates/common/rounding.cuh,
fp8.cuh, nvfp4.cuh, checkpoint.cuh): the stochastic-rounding hash, FP16 / BF16 stochastic
rounding, and the FP8 e4m3 and NVFP4 encoders and decoder, on torch tensors of any device.

The torch path (ops/torch_path), the lifecycle and prefix ops (on CUDA tensors too) and the
float64 references' precision emulation (reference/precision.py) all round through here, so a
format has one definition.

Stochastic rounding: an element's 16 bits are rounding_bits(seed, slot << 32 | epoch, element),
the hashes in int64 arithmetic that wraps mod 2^64 as the kernels' uint64 does.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "NVFP4",
    "decode_nvfp4_heads",
    "e4m3_sr_magnitude",
    "encode_e4m3_rows",
    "encode_nvfp4_heads",
    "pack_nibbles",
    "raw_bits",
    "round_stochastic",
    "rounding_bits",
    "signed64",
    "unpack_nibbles",
]

_F32 = torch.float32


def signed64(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned `value` (taken mod 2^64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX_1 = signed64(0xBF58476D1CE4E5B9)
_MIX_2 = signed64(0x94D049BB133111EB)
_GOLDEN = signed64(0x9E3779B97F4A7C15)


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
    key = _mix64(signed64(seed) ^ _mix64(stream * _GOLDEN))
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
    raise ValueError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")


E4M3_MAX = 448.0  # largest finite e4m3fn magnitude


def e4m3_sr_magnitude(mag: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp8.cuh's sr_value on FP32 magnitudes `mag` in [0, 448] with 16 random bits each (int64,
    broadcasting): the bits are added atop the 20 FP32 mantissa bits e4m3 drops, which are then
    cleared (below 2^-6, e4m3's subnormals, on mag + 2^-6, taken off again); the result is an
    e4m3 value, saturated at 448, as FP32."""
    low = mag < 2.0**-6
    m = torch.where(low, mag + 2.0**-6, mag)
    u = m.view(torch.int32).to(torch.int64) + (bits.to(torch.int64) << 4)
    rounded = (u & 0x7FF00000).to(torch.int32).view(_F32).clamp(max=E4M3_MAX)
    return torch.where(low, rounded - 2.0**-6, rounded)


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
    if bits is not None:
        mag = e4m3_sr_magnitude(mag, bits)
    code = mag.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)  # nearest, ties even
    sign = torch.where(q.view(torch.int32) < 0, 0x80, 0)
    code = torch.where(torch.isnan(q), 0x7F, code | sign)
    return code.to(torch.uint8), scale


NVFP4 = torch.float4_e2m1fn_x2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the e2m1 magnitudes, in code order
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
        lower = sum((a >= e).to(torch.int64) for e in E2M1_VALUES[1:])
        table = torch.tensor(E2M1_VALUES, dtype=_F32, device=q.device)
        gap_inverse = torch.tensor(_E2M1_GAP_INVERSE, dtype=_F32, device=q.device)
        frac = (a - table[lower]) * gap_inverse[lower] * 65536.0
        up = (lower < 7) & (bits.to(_F32) < frac)
        code = lower + up.to(torch.int64)
    return code | (torch.signbit(q).to(torch.int64) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] 4-bit codes -> uint8 [..., n / 2]: element 2i in the low nibble, 2i + 1 high."""
    c = codes.to(torch.int64)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> int64 codes [..., n] (inverse of pack_nibbles)."""
    p = packed.to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


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
    return pack_nibbles(_e2m1_codes(q, bits)), blocks, head


def decode_nvfp4_heads(
    packed: torch.Tensor, blocks: torch.Tensor, head: torch.Tensor
) -> torch.Tensor:
    """FP32 values fp32(e2m1(code) * S) of encode_nvfp4_heads' output, S = fp32(e4m3(block) * head)."""
    codes = unpack_nibbles(packed.view(torch.uint8))
    table = torch.tensor(E2M1_VALUES, dtype=_F32, device=packed.device)
    e2m1 = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    s = _e4m3_values(blocks.view(torch.uint8)) * head.to(_F32)[..., None, None]
    return e2m1 * s.repeat_interleave(16, dim=-1)


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or its bytes (uint8) where it is FP8 or NVFP4, for the index ops they lack."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, NVFP4) else t
