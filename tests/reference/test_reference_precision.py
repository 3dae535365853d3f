"""The float64 checkpoint-rounding emulations (replayssm_jit/reference/precision.py): exhaustive
code round trips, ties, saturation, NaN, scales, integer decode, SR mean and determinism."""

from __future__ import annotations

import math

import pytest
import torch

from replayssm_jit.core.codecs import rounding_bits
from replayssm_jit.reference import precision as P

F64 = torch.float64
HAS_E4M3 = hasattr(torch, "float8_e4m3fn")


def _bits(n: int, seed: int = 7, stream: int = 3) -> torch.Tensor:
    """n draws of 16 random bits from the project's counter-based generator."""
    return rounding_bits(seed, torch.tensor(stream), torch.arange(n))


def _draw_bits(seed: int, draws: int, shape) -> torch.Tensor:
    """[draws, *shape] random bits: draw d uses stream d, element i counter i."""
    n = math.prod(shape)
    return rounding_bits(seed, torch.arange(draws)[:, None], torch.arange(n)[None]).view(
        draws, *shape
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as bit patterns of float64 (NaN == NaN, -0 != +0)."""
    return torch.equal(a.to(F64).view(torch.int64), b.to(F64).view(torch.int64))


# --------------------------------------------------------------------------- e4m3 codes


def test_e4m3_decode_formula_points():
    codes = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x80, 0x7F, 0xFF])
    got = P.e4m3_decode(codes.to(torch.uint8))
    want = [0.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0, -0.0]
    assert _same(got[:8], torch.tensor(want, dtype=F64))
    assert torch.isnan(got[8:]).all()


def test_e4m3_all_codes_round_trip():
    codes = torch.arange(256).to(torch.uint8)
    back = P.e4m3_encode(P.e4m3_decode(codes))
    nan = (codes.to(torch.int64) & 0x7F) == 0x7F
    assert torch.equal(back[~nan], codes[~nan])  # incl. -0.0 -> 0x80 and every subnormal
    assert (back[nan] == P.E4M3_NAN).all()


@pytest.mark.skipif(not HAS_E4M3, reason="torch without float8_e4m3fn")
def test_e4m3_decode_matches_torch():
    codes = torch.arange(256).to(torch.uint8)
    ours = P.e4m3_decode(codes)
    theirs = codes.view(torch.float8_e4m3fn).to(F64)
    assert _same(torch.nan_to_num(ours, 1e9), torch.nan_to_num(theirs, 1e9))


def test_e4m3_ties_to_even():
    cases = {
        1.0 + 1 / 16: 1.0,  # between 1 and 1.125: even mantissa 000
        1.125 + 1 / 16: 1.25,  # between 1.125 (001) and 1.25 (010)
        2.0**-10: 0.0,  # half the smallest subnormal -> 0
        3 * 2.0**-10: 2.0**-8,  # between 2^-9 (001) and 2^-8 (010)
        15 * 2.0**-10: 2.0**-6,  # largest subnormal / smallest normal midpoint -> 1000
        432.0: 448.0,  # between 416 (101) and 448 (110)
        -(1.0 + 1 / 16): -1.0,
        1.0 + 1 / 16 + 2.0**-30: 1.125,  # just above the tie
    }
    q = torch.tensor(list(cases), dtype=F64)
    assert _same(P.e4m3_decode(P.e4m3_encode(q)), torch.tensor(list(cases.values()), dtype=F64))


def test_e4m3_saturation_and_nan():
    q = torch.tensor([449.0, 464.0, 1e30, math.inf, -500.0, -math.inf, math.nan, -math.nan])
    codes = P.e4m3_encode(q.to(F64)).tolist()
    assert codes == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0x7F]
    bits = torch.zeros(q.shape, dtype=torch.int64)  # u = 0: away from zero whenever inexact
    assert P.e4m3_encode(q.to(F64), bits).tolist() == codes  # SR saturates too, never NaN


@pytest.mark.skipif(not HAS_E4M3, reason="torch without float8_e4m3fn")
def test_e4m3_rn_matches_torch():
    g = torch.Generator().manual_seed(0)
    mant = torch.rand(20000, generator=g) * 2 - 1
    expo = torch.randint(-14, 9, (20000,), generator=g).to(torch.float32)
    x = mant * torch.exp2(expo)
    grid = P.e4m3_decode(torch.arange(0x7E).to(torch.uint8)).to(torch.float32)
    mids = (grid[:-1] + grid[1:]) / 2  # every tie between positive neighbours, exact in FP32
    x = torch.cat([x, mids, -mids, grid])
    x = x[x.abs() < 464]  # torch's cast is not saturating: it maps |x| >= 464 to NaN
    ours = P.e4m3_encode(x.to(F64))
    theirs = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)


# --------------------------------------------------------------------------- e2m1 codes


def test_e2m1_all_codes_round_trip():
    codes = torch.arange(16).to(torch.uint8)
    vals = P.e2m1_decode(codes)
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert _same(vals, torch.tensor(mags + [-m for m in mags], dtype=F64))
    assert torch.equal(P.e2m1_encode(vals), codes)


def test_e2m1_ties_saturation_nan():
    q = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.5, 1e9, -math.inf], dtype=F64)
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0, 6.0, -6.0]
    assert _same(P.e2m1_decode(P.e2m1_encode(q)), torch.tensor(want, dtype=F64))
    with pytest.raises(ValueError):
        P.e2m1_encode(torch.tensor([math.nan], dtype=F64))


# --------------------------------------------------------------------------- BF16 / FP16


@pytest.mark.parametrize(("dtype", "ulp"), [(torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)])
def test_half_rn_ties_to_even(dtype, ulp):
    q = torch.tensor(
        [1 + ulp / 2, 1 + 1.5 * ulp, -(1 + ulp / 2), 1 + ulp / 2 + ulp / 64], dtype=F64
    )
    out = P.round_half_rn(q, dtype)
    assert out.stored.dtype == dtype
    assert _same(out.value, torch.tensor([1.0, 1 + 2 * ulp, -1.0, 1 + ulp], dtype=F64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_sr_mean_and_determinism(dtype):
    n = 40000
    x = torch.full((n,), 1.0 + 2.0**-13 * 3, dtype=F64)  # strictly between two neighbours
    bits = _bits(n)
    out = P.round_half_sr(x, bits, dtype)
    assert torch.equal(out.value, P.round_half_sr(x, bits, dtype).value)
    gap = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert set(out.value.unique().tolist()) <= {1.0, 1.0 + gap}
    # Each draw's error is within one gap: the mean's sd is <= gap / (2 sqrt(n)); allow 5 sd.
    assert abs((out.value - x).mean().item()) < 5 * gap / (2 * math.sqrt(n))


# --------------------------------------------------------------------------- SR on grids


@pytest.mark.parametrize(
    ("encode", "decode", "q", "gap"),
    [
        (P.e4m3_encode, P.e4m3_decode, 1.0 + 0.3 * 0.125, 0.125),
        (P.e4m3_encode, P.e4m3_decode, -(2.0**-9) * 0.7, 2.0**-9),  # subnormal, negative
        (P.e4m3_encode, P.e4m3_decode, 300.1, 32.0),
        (P.e2m1_encode, P.e2m1_decode, 0.2, 0.5),
        (P.e2m1_encode, P.e2m1_decode, -4.9, 2.0),
    ],
)
def test_grid_sr_unbiased(encode, decode, q, gap):
    n = 40000
    x = torch.full((n,), q, dtype=F64)
    vals = decode(encode(x, _bits(n)))
    assert len(vals.unique()) == 2  # only the two neighbours
    assert ((vals - x).abs() < gap).all()
    assert abs((vals - x).mean().item()) < 5 * gap / (2 * math.sqrt(n))


def test_grid_sr_rule_and_determinism():
    # e2m1: frac = 0.5 between 1 and 1.5: away from zero iff u < 0.5, u = bits * 2^-16
    x = torch.full((4,), 1.25, dtype=F64)
    bits = torch.tensor([0, (1 << 15) - 1, 1 << 15, (1 << 16) - 1])
    assert P.e2m1_decode(P.e2m1_encode(x, bits)).tolist() == [1.5, 1.5, 1.0, 1.0]
    # e4m3: frac = 0.25 between 1 and 1.125: the bits added atop the 20 dropped mantissa bits
    # (0x40000 of 2^20) carry iff bits >= 0xC000
    x = torch.full((4,), 1.03125, dtype=F64)
    bits = torch.tensor([0, 0xBFFF, 0xC000, (1 << 16) - 1])
    assert P.e4m3_decode(P.e4m3_encode(x, bits)).tolist() == [1.0, 1.0, 1.125, 1.125]
    # subnormal: 2^-9 + a quarter gap, on |q| + 2^-6
    x = torch.full((2,), 2.0**-9 * 1.25, dtype=F64)
    bits = torch.tensor([0xBFFF, 0xC000])
    assert P.e4m3_decode(P.e4m3_encode(x, bits)).tolist() == [2.0**-9, 2.0**-8]
    exact = torch.tensor([1.0, 6.0, -0.5, 0.0], dtype=F64)
    ones = torch.full((4,), (1 << 16) - 1)
    zeros = torch.zeros(4, dtype=torch.int64)
    for b in (ones, zeros):  # representable values never move, whatever the bits
        assert _same(P.e2m1_decode(P.e2m1_encode(exact, b)), exact)
    r = _bits(1000, seed=11)
    y = torch.randn(1000, dtype=F64)
    assert torch.equal(P.e2m1_encode(y, r), P.e2m1_encode(y, r))
    assert not torch.equal(P.e2m1_encode(y, r), P.e2m1_encode(y, _bits(1000, seed=12)))


# --------------------------------------------------------------------------- FP8 checkpoint


def test_fp8_scales_and_encode():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, 32, dtype=F64, generator=g) * 7
    x[0, 0, 0] = 0.0  # an all-zero row
    out = P.fp8_encode(x)
    amax = x.to(torch.float32).abs().amax(-1, keepdim=True)
    assert out.scale.dtype == torch.float32 and out.scale.shape == (2, 3, 8, 1)
    assert torch.equal(out.scale, amax / 448.0)
    assert (out.codes[0, 0, 0] == 0).all() and out.scale[0, 0, 0].item() == 0.0
    # Each row's amax element lands on +-448 (or just below, by the scale's rounding).
    top = P.e4m3_decode(out.codes).abs().amax(-1)
    assert (top[out.scale[..., 0] > 0] >= 416).all()
    # Bit-exact against an independent step-by-step FP32 emulation.
    q = (x.to(torch.float32) / torch.where(out.scale == 0, 1.0, out.scale)).to(F64)
    assert torch.equal(out.codes, P.e4m3_encode(q))
    want = (P.e4m3_decode(out.codes).to(torch.float32) * out.scale).to(F64)
    assert torch.equal(out.value, want)
    # Relative error per row: at most half an e4m3 ulp (2^-4) of |x| plus the subnormal floor.
    err = (out.value - x).abs()
    assert (err <= x.abs() * 2.0**-4 + out.scale.to(F64) * 2.0**-10 + 1e-12).all()
    per_head = P.fp8_encode(x, dims=(-2, -1))
    assert per_head.scale.shape == (2, 3, 1, 1)


@pytest.mark.skipif(not HAS_E4M3, reason="torch without float8_e4m3fn")
def test_fp8_encode_matches_torch_cast():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, 64, dtype=F64, generator=g) * torch.logspace(-3, 3, 64, dtype=F64)
    out = P.fp8_encode(x)
    q = x.to(torch.float32) / out.scale
    assert torch.equal(out.codes, q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_sr_is_unbiased_over_draws():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, dtype=F64, generator=g)
    draws = 2000
    bits = _draw_bits(5, draws, x.shape)  # all draws at once, along a leading dim
    mean = P.fp8_encode(x.expand(draws, -1, -1), bits=bits).value.mean(0)
    scale = P.fp8_scales(x).to(F64)
    q = x.abs() / scale
    e4m3_ulp = torch.exp2(
        torch.floor(torch.log2(q)).clamp(min=-6) - 3
    )  # binade gap, subnormal 2^-9
    gap = scale * e4m3_ulp
    # |mean error| per element < 5 sd (one draw errs by < gap) + the FP32 rounding of x / scale.
    bound = 5 * gap / (2 * math.sqrt(draws)) + x.abs() * 2.0**-23
    assert ((mean - x).abs() <= bound).all()


# --------------------------------------------------------------------------- NVFP4 checkpoint


def test_nibble_packing():
    codes = torch.tensor([[1, 2, 15, 0, 8, 7]])
    packed = P.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x78]]
    assert torch.equal(P.unpack_nibbles(packed), codes)


def test_nvfp4_scales_and_layout():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 64, dtype=F64, generator=g) * 3  # [heads, rows, n]
    x[1, 0, :16] = 0.0  # an all-zero block
    out = P.nvfp4_encode(x)
    assert out.packed.shape == (3, 4, 32) and out.packed.dtype == torch.uint8
    assert out.block_scales.shape == (3, 4, 4) and out.head_scale.shape == (3, 1, 1)
    amax = x.to(torch.float32).abs().amax((-2, -1), keepdim=True)
    assert torch.equal(out.head_scale, amax / (6.0 * 448.0))
    bs = P.e4m3_decode(out.block_scales)
    assert (bs <= 448).all() and bs.max().item() >= 416  # the head's amax block uses the top
    assert out.block_scales[1, 0, 0].item() == 0 and (out.value[1, 0, :16] == 0).all()
    # Independent FP32 emulation of the element step.
    s = (bs.to(torch.float32) * out.head_scale).repeat_interleave(16, -1)
    q = x.to(torch.float32) / torch.where(s == 0, 1.0, s)
    codes = P.e2m1_encode(torch.where(s == 0, 0.0, q).to(F64))
    assert torch.equal(P.unpack_nibbles(out.packed), codes.to(torch.int64))
    # Each block's amax element decodes within e2m1's coarsest relative step of itself.
    blocks = x.unflatten(-1, (-1, 16)).abs().amax(-1)
    dec = out.value.unflatten(-1, (-1, 16)).abs().amax(-1)
    assert ((dec - blocks).abs() <= blocks * 0.25 + 1e-12).all()
    with pytest.raises(ValueError):
        P.nvfp4_encode(torch.zeros(2, 8, dtype=F64))
    with pytest.raises(ValueError):
        P.nvfp4_encode(torch.full((1, 16), math.inf, dtype=F64))


def test_nvfp4_round_trip_exact_on_grid():
    # Values already on the grid of their block and head scale re-encode to the same codes.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 32, dtype=F64, generator=g)
    first = P.nvfp4_encode(x)
    again = P.nvfp4_encode(first.value)
    assert torch.equal(again.value, first.value)


def test_nvfp4_integer_decode_matches_table():
    g = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (5, 8, 32), generator=g).to(torch.uint8)
    block = torch.randint(0, 0x7F, (5, 8, 4), generator=g).to(torch.uint8)  # finite, >= 0
    block[0, 0] = torch.tensor([0x00, 0x01, 0x07, 0x7E])  # zero, subnormals, max
    head = torch.exp2(torch.randint(-30, 30, (5, 1, 1), generator=g).float())
    head = head * (1 + torch.rand(5, 1, 1, generator=g))  # full-mantissa FP32 head scales
    table = P.nvfp4_decode(packed, block, head)
    ints = P.nvfp4_decode_bits(packed, block, head)
    assert _same(table, ints)
    # All 16 nibbles x all 256 block codes (NaN codes too) against the table, bit for bit.
    nib = torch.arange(16).repeat(16)
    packed_all = P.pack_nibbles(nib).expand(256, -1)
    block_all = torch.arange(256).to(torch.uint8).view(256, 1).expand(-1, 16)
    one = torch.tensor(0.7, dtype=torch.float32)
    assert _same(
        P.nvfp4_decode(packed_all, block_all, one), P.nvfp4_decode_bits(packed_all, block_all, one)
    )


def test_nvfp4_sr_unbiased_and_deterministic():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4, 32, dtype=F64, generator=g)
    draws = 2000
    bits = _draw_bits(9, draws, x.shape)
    out = P.nvfp4_encode(x.expand(draws, -1, -1, -1), bits=bits)
    mean = out.value.mean(0)
    assert torch.equal(out.packed[0], P.nvfp4_encode(x, bits=bits[0]).packed)
    rn = P.nvfp4_encode(x)
    s = (P.e4m3_decode(rn.block_scales) * rn.head_scale.to(F64)).repeat_interleave(16, -1)
    q = x.abs() / s
    gap = s * torch.where(q < 2, 0.5, torch.where(q < 4, 1.0, 2.0))  # e2m1's gap around q
    bound = 5 * gap / (2 * math.sqrt(draws)) + x.abs() * 2.0**-23
    # Block amax elements can saturate at 6 (a block scale rounded down): excluded, they are RN.
    inside = q < 6
    assert (((mean - x).abs() <= bound) | ~inside).all()
