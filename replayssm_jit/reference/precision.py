"""float64 emulations of checkpoint rounding: the test oracles for a kernel that stores its
checkpoint in a narrower format than the FP32 it computes in (docs/precision.md).

Every encoder takes a float64 (or any float) tensor and returns the stored representation plus
its dequantized value as float64. The kernel holds the state in FP32 registers before it stores
it, so every encoder first rounds its input to FP32 (round-to-nearest-even) and then rounds
exactly where the kernel rounds; every intermediate that the kernel computes in FP32 (amax,
scales, x / scale, decode products) is computed here in FP32 too, one IEEE operation at a time.

Formats (all round-to-nearest-even unless `bits` is given):

  BF16 / FP16     round_half_rn, round_half_sr (SR: core/codecs.py's bit-exact round_stochastic).
  FP8 e4m3        e4m3_encode / e4m3_decode on raw values (OCP e4m3fn: bias 7, max 448, no inf,
                  NaN = 0x7F / 0xFF, subnormals of 2^-9), fp8_encode / fp8_decode with one FP32
                  decode scale per reduced group (a row by default), scale = amax / 448 in FP32.
  NVFP4           e2m1_encode / e2m1_decode on raw values (bias 1, magnitudes 0, 0.5, 1, 1.5, 2,
                  3, 4, 6), nvfp4_encode with one e4m3 scale per 16 contiguous elements and one
                  FP32 scale per head; nvfp4_decode (table) and nvfp4_decode_bits (shift-and-mask
                  integer decode, the Hopper path) agree bit for bit.

Stochastic rounding (`bits`: int64 tensor of 16 random bits per element, in [0, 2^16), e.g.
from core.codecs.rounding_bits, broadcasting with the input) follows rounding.cuh's convention for
FP16 subnormals: with u = bits * 2^-16 (a uniform in [0, 1)), a value strictly between its two
representable neighbours rounds to the one away from zero iff u < frac, where frac = (|x| -
lower) / (upper - lower) is its distance from the one toward zero in units of the gap, so
E[rounded] = x up to the 2^-16 resolution of u. Representable values stay, values past the
format's max saturate to it (never rounded up to NaN / inf), NaN stays NaN. BF16 instead adds
the 16 bits below its kept 16 bits and truncates, FP16 normals add the low 13 bits below
their kept mantissa and truncate (exactly unbiased: frac has 13 bits there), and e4m3 adds the
16 bits atop the 20 FP32 mantissa bits it drops and clears them (e4m3_sr_value).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from replayssm_jit.core.codecs import (
    E2M1_VALUES,
    E4M3_MAX,
    e4m3_sr_magnitude,
    pack_nibbles,
    round_stochastic,
    unpack_nibbles,
)

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_NAN",
    "NVFP4_BLOCK",
    "FP8Tensor",
    "NVFP4Tensor",
    "Rounded",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "e4m3_sr_value",
    "fp8_decode",
    "fp8_encode",
    "fp8_scales",
    "nvfp4_decode",
    "nvfp4_decode_bits",
    "nvfp4_encode",
    "nvfp4_scales",
    "pack_nibbles",
    "round_half_rn",
    "round_half_sr",
    "sr_uniform",
    "unpack_nibbles",
]

_F32 = torch.float32
_F64 = torch.float64

E4M3_NAN = 0x7F  # the NaN code the encoders emit (0xFF also decodes to NaN)
E2M1_MAX = 6.0  # largest e2m1 magnitude: exponent 3, mantissa 1
NVFP4_BLOCK = 16  # elements per e4m3 block scale along the contiguous dim
NVFP4_MIN_HEAD_SCALE = 2.0**-117  # 2^-9 (e4m3's least subnormal) times it is FP32's least normal


def _e4m3_magnitudes() -> torch.Tensor:
    """The 127 finite non-negative e4m3fn magnitudes in code order 0x00..0x7E (increasing)."""
    codes = torch.arange(0x7F, dtype=torch.int64)
    exp, man = codes >> 3, (codes & 7).to(_F64)
    normal = torch.ldexp(1.0 + man / 8.0, (exp - 7).to(_F64))
    return torch.where(exp == 0, man * 2.0**-9, normal)  # subnormals: m * 2^(1 - 7 - 3)


_E4M3_GRID = _e4m3_magnitudes()
_E2M1_GRID = torch.tensor(E2M1_VALUES, dtype=_F64)


class Rounded(NamedTuple):
    """A BF16 / FP16 checkpoint: the stored tensor and its value as float64."""

    stored: torch.Tensor
    value: torch.Tensor


class FP8Tensor(NamedTuple):
    """An e4m3 checkpoint: codes (uint8), FP32 decode scales (keepdim over the reduced dims,
    so they broadcast against codes) and the decoded value as float64."""

    codes: torch.Tensor
    scale: torch.Tensor
    value: torch.Tensor


class NVFP4Tensor(NamedTuple):
    """An NVFP4 checkpoint: packed e2m1 codes (uint8 [..., n / 2], low nibble = even element),
    e4m3 block-scale codes (uint8 [..., n / 16]), FP32 head scales (keepdim over the head's
    dims) and the decoded value as float64."""

    packed: torch.Tensor
    block_scales: torch.Tensor
    head_scale: torch.Tensor
    value: torch.Tensor


# ---------------------------------------------------------------------------------------------
# BF16 / FP16
# ---------------------------------------------------------------------------------------------


def _check_half(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"expected torch.bfloat16 or torch.float16, got {dtype}")


def round_half_rn(x: torch.Tensor, dtype: torch.dtype) -> Rounded:
    """x -> FP32 (RN) -> `dtype` (RN, ties to even mantissa); IEEE overflow: finite values past
    the largest bf16 / fp16 midpoint become inf, as the hardware conversion does."""
    _check_half(dtype)
    stored = x.to(_F32).to(dtype)
    return Rounded(stored, stored.to(_F64))


def round_half_sr(x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> Rounded:
    """x -> FP32 (RN) -> `dtype` by rounding.cuh's round_stochastic with `bits` (int64 in
    [0, 2^16)): BF16 adds the bits below its kept 16 bits and truncates; FP16 adds the low 13
    below its kept mantissa and truncates (normals) or rounds away from zero iff bits * 2^-16 <
    frac (subnormals). Inf / NaN / exact values round to nearest."""
    _check_half(dtype)
    stored = round_stochastic(x.to(_F32), bits, dtype)
    return Rounded(stored, stored.to(_F64))


# ---------------------------------------------------------------------------------------------
# Rounding onto a small grid (e4m3, e2m1): codes 0..n-1 are the magnitudes in increasing order
# ---------------------------------------------------------------------------------------------


def sr_uniform(bits: torch.Tensor) -> torch.Tensor:
    """The stochastic-rounding uniform of 16 random bits: bits * 2^-16 in [0, 1)."""
    return bits.to(_F64) * 2.0**-16


# Kept apart from core/codecs.py on purpose: a float64 grid search, independent of the torch casts
# the codec rounds to nearest with, so that the tests compare two derivations.
def _grid_index(mag: torch.Tensor, grid: torch.Tensor, bits: torch.Tensor | None) -> torch.Tensor:
    """Index into `grid` of the rounded non-negative non-NaN float64 `mag` (saturating)."""
    mag = mag.clamp(max=grid[-1].item())  # satfinite: past the max (inf too) gives the max
    hi = torch.searchsorted(grid, mag.contiguous())  # first grid value >= mag
    lo = (hi - 1).clamp(min=0)
    lo_v, hi_v = grid[lo], grid[hi]
    exact = hi_v == mag
    if bits is None:
        below, above = mag - lo_v, hi_v - mag  # exact in float64: few-bit values, near exponents
        # Ties go to the even code, whose mantissa LSB (bit 0 of the code) is 0.
        up = (above < below) | ((above == below) & (hi % 2 == 0))
    else:
        gap = torch.where(exact, torch.ones_like(hi_v), hi_v - lo_v)  # no 0 / 0 on exact values
        up = sr_uniform(bits) < (mag - lo_v) / gap  # exact: the gap is a power of two
    return torch.where(exact | up, hi, lo)


def _grid_encode(
    q: torch.Tensor, grid: torch.Tensor, sign_bit: int, bits: torch.Tensor | None
) -> torch.Tensor:
    """Sign-magnitude codes of float64 `q` on `grid`; NaN gets index 0 (callers replace it)."""
    q = q.to(_F64)
    nan = torch.isnan(q)
    idx = _grid_index(torch.where(nan, 0.0, q.abs()), grid, bits)
    if bits is not None:
        idx = idx.expand(torch.broadcast_shapes(idx.shape, q.shape))
    code = idx | (torch.signbit(q).to(torch.int64) << sign_bit)  # -0.0 keeps its sign
    return torch.where(nan, E4M3_NAN, code)


def e4m3_encode(q: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
    """Raw values -> e4m3fn codes (uint8), as cvt.rn.satfinite.e4m3x2.f32 does in RN mode:
    nearest of the 253 finite values, ties to the even mantissa, |q| > 448 (and +-inf) saturate
    to +-448 (0x7E / 0xFE), NaN -> 0x7F, -0.0 -> 0x80. `q` is rounded as given (float64);
    callers that model FP32 pass FP32 values. With `bits`: e4m3_sr_value's stochastic rounding
    of fp32(q), then its (exact) code."""
    if bits is not None:
        q = e4m3_sr_value(q, bits)
    return _grid_encode(q, _E4M3_GRID, 7, None).to(torch.uint8)


def e4m3_sr_value(q: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of fp32(q) to an e4m3fn value (float64, exact), as fp8.cuh's
    sr_value: the 16 random bits are added at the top of the 20 FP32 mantissa bits e4m3 drops,
    then those 20 bits are cleared, so the value rounds away from zero iff bits >= 2^16 (1 -
    frac) (probability frac to the 2^-16 resolution of the bits; representable values stay).
    Below 2^-6 (e4m3 subnormals, a fixed gap of 2^-9) the same is done to fp32(|q| + 2^-6),
    then 2^-6 is taken off again (exact). |q| is first clamped to 448, and a value that rounds
    past 448 saturates to it; NaN stays NaN; the sign is kept (-0.0 too)."""
    q32 = q.to(_F32)
    v = e4m3_sr_magnitude(q32.abs().clamp(max=E4M3_MAX), bits)  # (inf clamps too)
    signed = torch.where(torch.signbit(q32), -v, v)
    return torch.where(torch.isnan(q32), q32, signed).to(_F64)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (uint8) -> float64: sign * 2^(e - 7) * (1 + m / 8), e = 0: m * 2^-9;
    0x7F / 0xFF -> NaN."""
    c = codes.to(torch.int64)
    mag = _E4M3_GRID[(c & 0x7F).clamp(max=0x7E)]
    val = torch.where((c & 0x80) != 0, -mag, mag)
    return torch.where((c & 0x7F) == 0x7F, math.nan, val)


def e2m1_encode(q: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
    """Raw values -> e2m1 codes (uint8 in [0, 16), bit 3 = sign): nearest of 0, 0.5, 1, 1.5,
    2, 3, 4, 6, ties to the even code (mantissa 0), |q| > 6 (and +-inf) saturate to +-6.
    e2m1 has no NaN: NaN input raises. With `bits`: stochastic (module doc)."""
    if torch.isnan(q).any():
        raise ValueError("e2m1_encode: e2m1 has no NaN encoding")
    return _grid_encode(q, _E2M1_GRID, 3, bits).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (values in [0, 16)) -> float64: sign * 2^(e - 1) * (1 + m / 2), e = 0: m / 2."""
    c = codes.to(torch.int64)
    mag = _E2M1_GRID[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


# ---------------------------------------------------------------------------------------------
# FP8 checkpoint: e4m3 codes with one FP32 decode scale per group (a row by default)
# ---------------------------------------------------------------------------------------------


def fp8_scales(x: torch.Tensor, dims: Sequence[int] = (-1,)) -> torch.Tensor:
    """FP32 decode scales: amax(|fp32(x)|) over `dims` (keepdim), divided by 448 in FP32, at
    least 2^-126 (FP32's smallest normal, so that 1 / scale is finite) where the amax is not 0.
    dims=(-1,): one scale per row of each head's state (per (head, row) for [..., H, P, N]);
    dims=(-2, -1): one per head; (-3, -2, -1) on [slots, H, P, N]: one per slot."""
    amax = x.to(_F32).abs().amax(dim=tuple(dims), keepdim=True)
    scale = (amax / torch.tensor(E4M3_MAX, dtype=_F32)).clamp_min(2.0**-126)
    return torch.where(amax == 0, torch.zeros_like(scale), scale)


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's load: fp32(e4m3(code) * scale), one FP32 rounding, returned as float64."""
    return (e4m3_decode(codes).to(_F32) * scale.to(_F32)).to(_F64)


def fp8_encode(
    x: torch.Tensor, dims: Sequence[int] = (-1,), bits: torch.Tensor | None = None
) -> FP8Tensor:
    """The kernel's store: scale = fp8_scales(x, dims), inverse = fp32(1 / scale); code =
    e4m3(fp32(fp32(x) * inverse)) by e4m3_encode (RN or, with `bits`, SR; saturating: the
    rounded scale and inverse can put the group's amax a hair past 448). An all-zero group gets
    scale 0 and codes 0 (inverse 1 there)."""
    xf = x.to(_F32)
    scale = fp8_scales(xf, dims)
    one = torch.ones_like(scale)
    inverse = torch.where(scale == 0, one, one / scale)
    codes = e4m3_encode((xf * inverse).to(_F64), bits)
    return FP8Tensor(codes, scale, fp8_decode(codes, scale))


# ---------------------------------------------------------------------------------------------
# NVFP4 checkpoint: e2m1 values, e4m3 scale per 16 contiguous elements, FP32 scale per head
# ---------------------------------------------------------------------------------------------


def _check_blocks(x: torch.Tensor, head_dims: int) -> None:
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4: last dim {x.shape[-1]} is not a multiple of {NVFP4_BLOCK}")
    if not 1 <= head_dims <= x.dim():
        raise ValueError(f"NVFP4: head_dims={head_dims} for a {x.dim()}-d tensor")


def nvfp4_scales(x: torch.Tensor, head_dims: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-scale codes, head scales) of the standard two-level scaling, all in FP32:
    head = amax(|fp32(x)|) over the last `head_dims` dims / (6 * 448), keepdim, so the block
    scales land in e4m3's range, at least 2^-117 where the amax is not 0 (so that every nonzero
    block multiplier is a normal FP32 with a finite inverse); block code =
    e4m3_rn(fp32(fp32(block amax / 6) / head)), saturating at 448; a zero head (head = 0) gets
    block codes 0."""
    _check_blocks(x, head_dims)
    xf = x.to(_F32)
    dims = tuple(range(-head_dims, 0))
    amax = xf.abs().amax(dim=dims, keepdim=True)
    head = (amax / torch.tensor(E2M1_MAX * E4M3_MAX, dtype=_F32)).clamp_min(NVFP4_MIN_HEAD_SCALE)
    head = torch.where(amax == 0, torch.zeros_like(head), head)
    blocks = xf.unflatten(-1, (-1, NVFP4_BLOCK)).abs().amax(dim=-1)
    per_block = blocks / torch.tensor(E2M1_MAX, dtype=_F32)
    divisor = torch.where(head == 0, torch.ones_like(head), head)
    codes = e4m3_encode((per_block / divisor).to(_F64))
    return codes, head


def _block_multiplier(block_scales: torch.Tensor, head_scale: torch.Tensor) -> torch.Tensor:
    """S = fp32(e4m3(block) * head), the one FP32 factor per 16 elements, repeated per element."""
    s = e4m3_decode(block_scales).to(_F32) * head_scale.to(_F32)
    return s.repeat_interleave(NVFP4_BLOCK, dim=-1)


# Kept apart from core/codecs.py's decode_nvfp4_heads on purpose: any head_dims, e4m3 by the
# float64 grid rather than torch's cast, so the codec's decode is checked against a second one.
def nvfp4_decode(
    packed: torch.Tensor, block_scales: torch.Tensor, head_scale: torch.Tensor
) -> torch.Tensor:
    """Table decode: fp32(e2m1(code) * S), S = fp32(e4m3(block) * head) (e2m1 * S is the only
    per-element rounding), returned as float64."""
    e2m1 = e2m1_decode(unpack_nibbles(packed)).to(_F32)
    return (e2m1 * _block_multiplier(block_scales, head_scale)).to(_F64)


def _f32_from_bits(u: torch.Tensor) -> torch.Tensor:
    """FP32 whose bit pattern is the int64 `u` in [0, 2^32)."""
    return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32).view(_F32)


def nvfp4_decode_bits(
    packed: torch.Tensor, block_scales: torch.Tensor, head_scale: torch.Tensor
) -> torch.Tensor:
    """Integer decode (no FP4 / FP8 instructions): equals nvfp4_decode bit for bit.

    e2m1 nibble n = s e e m: FP32 bits = s << 31 | (e + 126) << 23 | m << 22 for e > 0, i.e.
    ((n & 7) << 22) + (126 << 23) (rebias 1 -> 127); n & 7 == 1 (0.5) is 126 << 23, 0 is 0.
    e4m3 block code c: (c & 0x7F) << 20 places e and m in FP32's fields, which reads as the value
    times 2^-120 for normals and subnormals alike, so one exact multiply by 2^120 rebiases it.
    The head scale is folded into that per-block factor S, so each element costs shift, mask,
    add, select and one FP32 multiply by S."""
    p = packed.to(torch.int64)
    n = torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)
    mag = n & 7
    normal = ((mag << 22) + (126 << 23)) * (mag > 1)  # mag >= 2 means e > 0
    half = (126 << 23) * (mag == 1)  # the single subnormal, 0.5
    e2m1 = _f32_from_bits(((n & 8) << 28) | normal | half)
    c = block_scales.to(torch.int64)
    scale_bits = ((c & 0x80) << 24) | ((c & 0x7F) << 20)
    block = _f32_from_bits(scale_bits) * torch.tensor(2.0**120, dtype=_F32)  # exact: 2^k
    block = torch.where((c & 0x7F) == 0x7F, math.nan, block)  # e4m3fn's only NaN codes
    s = (block * head_scale.to(_F32)).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return (e2m1 * s).to(_F64)


def nvfp4_encode(
    x: torch.Tensor, head_dims: int = 2, bits: torch.Tensor | None = None
) -> NVFP4Tensor:
    """The kernel's store of a finite state x [..., n] whose last `head_dims` dims are one head:
    (block codes, head) = nvfp4_scales(x); per element q = fp32(fp32(x) * fp32(1 / S)) with the
    decode's S = fp32(e4m3(block) * head) (one multiply per element, as for FP8); code =
    e2m1_encode(q) (RN, or SR with `bits`; saturating at 6, which the rounded block scale and
    inverse can need). S = 0 (zero block, or a block scale below e4m3's 2^-9 after head
    scaling) stores codes 0 (+0). Block scales are always RN: only the values take the random
    bits."""
    if not torch.isfinite(x).all():
        raise ValueError("nvfp4_encode: the state must be finite (e2m1 has no inf / NaN)")
    block_scales, head = nvfp4_scales(x, head_dims)
    s = _block_multiplier(block_scales, head)
    xf = x.to(_F32)
    one = torch.ones_like(s)
    q = xf * (one / torch.where(s == 0, one, s))
    q = torch.where(s == 0, torch.zeros_like(q), q)
    codes = e2m1_encode(q.to(_F64), bits)
    packed = pack_nibbles(codes)
    return NVFP4Tensor(packed, block_scales, head, nvfp4_decode(packed, block_scales, head))
