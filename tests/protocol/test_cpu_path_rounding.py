"""Stochastic rounding on the torch path against rounding.cuh re-derived in plain Python."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch
from support.checks import bits
from support.cpu_path import (
    BF16,
    CASES,
    F16,
    F32,
    F64,
    assert_same_bits,
    fresh_pool,
    randn,
    uniform,
)

from replayssm_jit.core import codecs

# One intra-op thread (conftest's single_thread): tiny tensors, and threads contend on a busy box.
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# Stochastic rounding: rounding.cuh re-derived with Python integers and floats
# ---------------------------------------------------------------------------------------------

M64 = (1 << 64) - 1


def py_mix64(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


M32 = (1 << 32) - 1


def py_pair_bits(key: int, pair: int) -> int:
    x = (key & M32) ^ ((pair * 0x9E3779B9) & M32)
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    x ^= x >> 15
    return x ^ (key >> 32)


def py_rounding_bits(seed: int, stream: int, counter: int) -> int:
    """16 bits per element: one 32-bit hash per pair of elements, keyed once per stream."""
    key = py_mix64((seed & M64) ^ py_mix64(stream * 0x9E3779B97F4A7C15))
    return (py_pair_bits(key, (counter >> 1) & M32) >> (16 * (counter & 1))) & 0xFFFF


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def py_round_bf16(v: float, bits: int) -> int:
    """bf16 bit pattern of a finite FP32 value: add 16 random bits below the kept 16, truncate."""
    return ((f32_bits(v) + bits) >> 16) & 0xFFFF


def py_round_f16(v: float, bits: int) -> int:
    """fp16 bit pattern of a finite FP32 value, from its two FP16 neighbours in exact float64
    arithmetic: the upper one where the low 13 random bits reach the distance to it in 2^-13
    ulps (FP16 normals), or where the 16 bits as a fraction fall below (|v| - low) / ulp
    (subnormals); never past the largest finite value."""
    a = abs(v)
    if a >= 65504.0:
        res = 65504.0
    elif a == 0.0:
        res = 0.0
    else:
        exponent = math.frexp(a)[1] - 1  # a in [2^e, 2^(e+1))
        ulp = 2.0 ** (max(exponent, -14) - 10)
        low = math.floor(a / ulp) * ulp
        frac = (a - low) / ulp
        if exponent >= -14:
            up = (bits & 0x1FFF) + frac * 8192 >= 8192
        else:
            up = (bits & 0xFFFF) / 2.0**16 < frac
        res = low + ulp if up else low
    return struct.unpack("<H", struct.pack("<e", math.copysign(res, v)))[0]


def test_rounding_bits_match_python():
    rng = random.Random(41)
    seeds = [0, 1, 1234, 2**63 - 1, 2**64 - 1, *(rng.getrandbits(64) for _ in range(4))]
    streams = [0, 5 << 32, (3 << 32) | 7, M64, *(rng.getrandbits(64) for _ in range(4))]
    counters = [0, 1, 511, 2**40 + 3, *(rng.getrandbits(63) for _ in range(4))]
    to_i64 = codecs.signed64
    st = torch.tensor([to_i64(s) for s in streams])[:, None]
    ct = torch.tensor([to_i64(c) for c in counters])[None, :]
    for seed in seeds:
        got = codecs.rounding_bits(seed, st, ct)
        want = [[py_rounding_bits(seed, s, c) for c in counters] for s in streams]
        assert got.tolist() == want, f"seed {seed}"


def _sr_values(gen, dtype) -> torch.Tensor:
    spread = (-30.0, 30.0) if dtype == BF16 else (-9.0, 5.0)
    mags = 10.0 ** uniform(gen, 4000, lo=spread[0], hi=spread[1])
    v = (randn(gen, 4000) * mags).to(F32)
    edges = [0.0, -0.0, 1.0, -1.5, 1e-8, -1e-8, 3e-5, 65504.0, 65519.0, -65530.0, 7e4, 1e38]
    return torch.cat([v, torch.tensor(edges, dtype=F32)])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_round_stochastic_matches_python(dtype):
    gen = torch.Generator().manual_seed(42)
    v = _sr_values(gen, dtype)
    bits = torch.randint(0, 2**16, v.shape, generator=gen, dtype=torch.int64)
    bits[:8] = torch.tensor([0, 2**16 - 1, 2**15, 255, 256, 2**13 - 1, 2**13, 2**12])
    # Values halfway between two neighbours, with bits just below, at and above one half of the
    # dropped bits (16 for bf16, 13 for fp16): at it, the integer add carries to the upper one.
    half_bits = 2**15 if dtype == BF16 else 2**12
    half = 1.0 + 2.0 ** (-8 if dtype == BF16 else -11)
    ties = torch.tensor([half, -half] * 3, dtype=F32)
    tie_bits = torch.tensor([half_bits - 1] * 2 + [half_bits] * 2 + [half_bits + 1] * 2)
    v, bits = torch.cat([v, ties]), torch.cat([bits, tie_bits])
    got = codecs.round_stochastic(v, bits, dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    model = py_round_bf16 if dtype == BF16 else py_round_f16
    want = [model(float(x), int(r)) for x, r in zip(v.tolist(), bits.tolist())]
    assert got.tolist() == want
    # Specials round to nearest; FP32 passes through.
    specials = torch.tensor([math.inf, -math.inf, math.nan], dtype=F32)
    rounded = codecs.round_stochastic(specials, torch.full((3,), 2**16 - 1), dtype).to(F32)
    assert rounded[0] == math.inf and rounded[1] == -math.inf and torch.isnan(rounded[2])
    assert torch.equal(codecs.round_stochastic(v, bits, F32), v)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_round_stochastic_is_unbiased(dtype):
    """Each value rounds to one of its two neighbours, and on average to itself."""
    gen = torch.Generator().manual_seed(43)
    v = (randn(gen, 64) * 3.0).to(F32)
    bits = torch.randint(0, 2**16, (4096, 64), generator=gen, dtype=torch.int64)
    r = codecs.round_stochastic(v.expand(4096, 64), bits, dtype).to(F64)
    mantissa_bits = 7 if dtype == BF16 else 10
    ulp = torch.ldexp(torch.ones(64, dtype=F64), torch.frexp(v.to(F64))[1] - 1 - mantissa_bits)
    v64 = v.to(F64)
    low = torch.where(v64 >= 0, torch.floor(v64 / ulp), torch.ceil(v64 / ulp)) * ulp
    high = low + torch.sign(v64) * ulp
    assert bool(((r == low) | (r == high)).all())
    bias = (r.mean(0) - v64).abs() / ulp
    assert float(bias.max()) < 0.06, float(bias.max())  # 4096 draws: sigma <= 0.008 ulp


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("state_dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "conventional"])
def test_stochastic_rounding_key(family, state_dtype, replay):
    """A stochastically rounded flush stores round_stochastic(S, rounding_bits(seed, slot << 32
    | epoch, element)) of the FP32 fold S, the epoch as the step read it (0 in conventional
    mode): S comes from a twin pool with an FP32 state holding the same values, the bits from
    the Python model of rounding.cuh."""
    case = CASES[family](state_dtype=state_dtype, window=2)
    case.flags = case.flags | {"sr"}
    gen, pool = fresh_pool(case, 44)
    pool.cursors[1:4, 1] = torch.tensor([0, -5, 2**31 - 1], dtype=torch.int32)
    twin = pool.clone()
    twin.state = pool.state.to(F32)
    seed = 2**63 - 25
    model = py_round_bf16 if state_dtype == BF16 else py_round_f16
    for step in range(3):
        slots_list = [3, 1, -1, 2]
        batch = len(slots_list)
        tok = case.tokens(gen, batch)
        epochs = pool.cursors[:, 1].tolist()
        before = pool.state.clone()
        outs = [case.out(batch), case.out(batch)]
        for p, out in zip((pool, twin), outs):
            case.run(
                p,
                tok,
                out,
                torch.tensor(slots_list, dtype=torch.int32),
                -1,
                replay=replay,
                seed=seed,
            )
        assert torch.equal(bits(outs[0]), bits(outs[1])), "outputs differ from the FP32 twin's"
        flushed = not replay or step % 2 == 1  # window 2: held 0, 1, 0
        for s in (1, 2, 3):
            if not flushed:
                assert_same_bits(pool.state[s], before[s], f"step {step}: state {s}")
                continue
            epoch = epochs[s] if replay else 0
            stream = ((s << 32) | (epoch & M64)) & M64
            values = twin.state[s].flatten().tolist()
            want = [model(x, py_rounding_bits(seed, stream, i)) for i, x in enumerate(values)]
            got = (pool.state[s].flatten().view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
            assert got == want, f"step {step}: slot {s} bits"
            twin.state[s] = pool.state[s].to(F32)  # keep the twin on the rounded checkpoint
    # The same seed again gives the same bits; another seed, others.
    pools = [case.pool(torch.Generator().manual_seed(45)) for _ in range(3)]
    tok = case.tokens(gen, 1)
    for p, sd in zip(pools, (seed, seed + 1, seed)):
        one = torch.tensor([1], dtype=torch.int32)
        case.run(p, tok, case.out(1), one, -1, replay=False, seed=sd)
    assert not torch.equal(bits(pools[0].state[1]), bits(pools[1].state[1])), "seed ignored"
    assert_same_bits(pools[2].state[1], pools[0].state[1], "same seed")
