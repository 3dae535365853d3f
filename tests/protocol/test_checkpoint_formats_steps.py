"""Decode steps of each checkpoint format and read copy (docs/precision.md) against float64.

On every device (the GPU cases carry the gpu marker): decode steps of fresh random sequences,
outputs poisoned first, against float64 emulations that round where the kernels round:
  - each non-flush output against a float64 decode from the copy the step reads (the read copy
    in separate mode, else the checkpoint), decoded;
  - each flush output against a float64 decode from the carried copy; the carried and read
    copies after the flush against the float64 state encoded by reference.precision with the
    step's rounding bits (RN, or SR from core.codecs.rounding_bits), within one code of each value;
  - separate mode's carried FP32 copy bit for bit against an FP32-only run of the same inputs;
  - SR: the same seed gives the same bits, another seed other bits, and the read copies of many
    slots holding one value average to it (unbiased within a stated bound).
"""

from __future__ import annotations

import math

import pytest
import torch
from support.checkpoint_formats import F32, F64, DeltaFamily, Mamba2Family

from replayssm_jit import GDNDecodeCache, GDNDecodeWrapper
from replayssm_jit.core import codecs
from replayssm_jit.families.spec import mamba2_spec
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.reference import precision as P

SEED = 77
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TORCH = {"f32": F32, "f16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
         "nvfp4": torch.float4_e2m1fn_x2}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Decode steps against float64 emulations
# ---------------------------------------------------------------------------------------------


FAMILIES = {
    "mamba2": lambda device, gen: Mamba2Family(device, gen),
    "gdn": lambda device, gen: DeltaFamily(device, gen, False),
    "kda": lambda device, gen: DeltaFamily(device, gen, True),
}


def decoded(tensors, codes: str, scale: str) -> torch.Tensor:
    """A copy as float64 on the CPU (e4m3: code times row scale in FP32; nvfp4: reference
    .precision's decode of codes, block scales and head scales)."""
    t = tensors[codes].cpu()
    if t.dtype == torch.float4_e2m1fn_x2:
        blocks = tensors[scale.replace("scale", "block_scale")].cpu().view(torch.uint8)
        head = tensors[scale].cpu()[..., None, None]
        return P.nvfp4_decode(t.view(torch.uint8), blocks, head)
    values = t.to(F32)
    if tensors.get(scale) is not None:
        values = values * tensors[scale].cpu().unsqueeze(-1)
    return values.to(F64)


def nvfp4_step(want: torch.Tensor) -> torch.Tensor:
    """One e2m1 code's step at each value of float64 heads `want` [..., P, N], times its block's
    multiplier S as the encoder forms it from `want` (0.5, 1 or 2 on the grid)."""
    enc = P.nvfp4_encode(want, head_dims=2)
    s = (P.e4m3_decode(enc.block_scales) * enc.head_scale).repeat_interleave(16, dim=-1)
    q = want.abs() / torch.where(s == 0, 1.0, s)
    gap = torch.where(q < 2, 0.5, torch.where(q < 4, 1.0, 2.0))
    return gap * s


def assert_within_one_code(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str):
    """Each value of `got` within one code of `want`: the format's step at the larger of the
    two (e4m3: at the value over its row's scale, then scaled back; nvfp4: at the value over
    its block's multiplier)."""
    assert torch.isfinite(got).all(), f"{what}: not finite"
    if dtype == "f32":
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), what
        return
    if dtype == "nvfp4":
        excess = ((got - want).abs() - 1.01 * nvfp4_step(want)).max().item()
        assert excess <= 0, f"{what}: a value is more than one code away ({excess:.3e} over)"
        return
    bits = {"f16": 10, "bf16": 7, "e4m3": 3}[dtype]
    mag = torch.maximum(got.abs(), want.abs())
    if dtype == "e4m3":  # the code's step at |value / row scale| (subnormal below 2^-6), scaled
        scale = want.abs().amax(-1, keepdim=True) / 448
        q = (mag / scale.clamp_min(1e-30)).clamp_min(2.0**-6)
        ulp = torch.exp2(torch.floor(torch.log2(q)) - bits) * scale
    else:
        ulp = torch.exp2(torch.floor(torch.log2(mag.clamp_min(2.0**-14))) - bits)
    excess = ((got - want).abs() - 1.01 * ulp).max().item()
    assert excess <= 0, f"{what}: a value is more than one code away ({excess:.3e} over)"


def encode_like_the_kernel(values, dtype, *, sr, slots, epochs, read_copy, shape):
    """reference.precision's encoding of FP32-rounded float64 `values` [n, *shape] as a flush
    stores them, with the step's bits where SR."""
    bits = None
    if sr:
        element = torch.arange(math.prod(shape), dtype=torch.int64)
        stream = (slots.to(torch.int64) << 32) | epochs.to(torch.int64)
        if read_copy:
            stream = stream | -(2**63)
        bits = codecs.rounding_bits(SEED, stream[:, None], element[None, :]).view(values.shape)
    if dtype == "e4m3":
        return P.fp8_encode(values, bits=bits).value
    if dtype == "nvfp4":
        return P.nvfp4_encode(values.to(F32).to(F64), head_dims=2, bits=bits).value
    if dtype == "f32":
        return values.to(F32).to(F64)
    if sr:
        return P.round_half_sr(values, bits, TORCH[dtype]).value
    return P.round_half_rn(values, TORCH[dtype]).value


def drive(name, device, state_dtype, read_dtype, sr, *, window=4, steps=13, batch=5, slots=7,
          gen_seed=0, config=None, read_rn=False):  # fmt: skip
    """Runs `steps` tokens of fresh random sequences through a cache of the given format; checks
    every step as the module doc says. Returns the cache and the tokens (for twin runs)."""
    gen = torch.Generator().manual_seed(gen_seed)
    fam = FAMILIES[name](device, gen)
    cache = fam.cache_type(slots, **fam.dims, window=window, state_dtype=TORCH[state_dtype],
                           read_dtype=read_dtype and TORCH[read_dtype], act_dtype=F32,
                           device=device)  # fmt: skip
    wrapper = fam.wrapper_type(cache)
    rn = {"read_copy_round_to_nearest": True} if read_rn else {}
    wrapper.plan(batch, config=config, seed=SEED, stochastic_rounding=sr, **fam.options, **rn)
    rows = torch.tensor([3, -1, 0, 5, 6][:batch], dtype=torch.int32)
    live = rows[rows >= 0].long()
    init = 0.5 * torch.randn(slots, *fam.state_shape, generator=gen)
    cache.reset(list(range(slots)), init)
    carried = decoded(cache.tensors, "state", "state_scale")
    read = decoded(cache.tensors, "read_state", "read_scale") if read_dtype else carried.clone()
    ref_carried, ref_read = carried.clone(), read.clone()
    held = 0
    tokens = []
    for step in range(steps):
        tok = fam.tokens(batch)
        tokens.append(tok)
        flush = held + 1 >= window
        out = torch.full((batch, *fam.state_shape[:2]), math.nan, dtype=F32, device=device)
        fam.run(wrapper, {**tok, "out": out}, rows.to(device))
        y_carried = fam.reference(ref_carried, rows, tok)
        y_read = fam.reference(ref_read, rows, tok)
        want = y_carried if flush else y_read
        got = out.cpu().to(F64)
        assert torch.equal(got[1], torch.zeros_like(got[1])), "pad row"
        err = (got - want).norm() / want.norm()
        assert err < 2e-5, f"step {step} ({'flush' if flush else 'read'}): rel error {err:.2e}"
        if flush:
            epochs = cache.cursors[live, 1].cpu() - 1  # the epoch the flush rounded at
            shape = fam.state_shape
            enc = dict(sr=sr, slots=live, epochs=epochs, shape=shape)
            want_state = encode_like_the_kernel(ref_carried[live], state_dtype, read_copy=False,
                                                **enc)  # fmt: skip
            got_state = decoded(cache.tensors, "state", "state_scale")
            assert_within_one_code(got_state[live], want_state, state_dtype, f"state at {step}")
            if read_dtype:
                read_enc = {**enc, "sr": sr and not read_rn}
                want_read = encode_like_the_kernel(ref_carried[live], read_dtype, read_copy=True,
                                                   **read_enc)  # fmt: skip
                got_read = decoded(cache.tensors, "read_state", "read_scale")
                assert_within_one_code(got_read[live], want_read, read_dtype, f"read at {step}")
            # The next window starts from what the kernels stored.
            ref_carried = decoded(cache.tensors, "state", "state_scale")
            ref_read = (
                decoded(cache.tensors, "read_state", "read_scale") if read_dtype
                else ref_carried.clone()
            )  # fmt: skip
            held = 0
        else:
            held += 1
        untouched = [s for s in range(slots) if s not in live.tolist()]
        now = decoded(cache.tensors, "state", "state_scale")
        assert torch.equal(now[untouched], carried[untouched]), "an unnamed slot changed"
    return cache, tokens


FORMATS = [
    ("mamba2", "e4m3", None, False),
    ("mamba2", "e4m3", None, True),
    ("mamba2", "f32", "e4m3", False),
    ("mamba2", "f32", "e4m3", True),
    ("mamba2", "f16", "e4m3", True),
    ("mamba2", "bf16", "e4m3", True),
    ("mamba2", "f32", "bf16", False),
    ("mamba2", "nvfp4", None, False),
    ("mamba2", "nvfp4", None, True),
    ("mamba2", "f32", "nvfp4", False),
    ("mamba2", "f32", "nvfp4", True),
    ("mamba2", "f16", "nvfp4", True),
    ("gdn", "e4m3", None, False),
    ("gdn", "e4m3", None, True),
    ("gdn", "f32", "e4m3", False),
    ("gdn", "f32", "e4m3", True),
    ("gdn", "f16", "e4m3", True),
    ("gdn", "bf16", "e4m3", True),
    ("gdn", "f32", "bf16", False),
    ("gdn", "nvfp4", None, False),
    ("gdn", "nvfp4", None, True),
    ("gdn", "f32", "nvfp4", False),
    ("gdn", "f32", "nvfp4", True),
    ("gdn", "f16", "nvfp4", True),
    ("kda", "e4m3", None, False),
    ("kda", "e4m3", None, True),
    ("kda", "nvfp4", None, False),
    ("kda", "nvfp4", None, True),
]


def _fid(case):
    name, state, read, sr = case
    return f"{name}-{state}" + (f"+{read}" if read else "") + ("-sr" if sr else "")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FORMATS, ids=_fid)
def test_steps_match_the_emulation(case, device):
    name, state, read, sr = case
    drive(name, device, state, read, sr)


# KDA's separate mode runs on the torch path only (its CUDA modules refuse a read copy).
KDA_SEPARATE = [
    ("kda", "f32", "e4m3", False),
    ("kda", "f32", "e4m3", True),
    ("kda", "f16", "e4m3", True),
    ("kda", "f32", "bf16", False),
    ("kda", "f32", "nvfp4", False),
    ("kda", "f32", "nvfp4", True),
]


@pytest.mark.parametrize("case", KDA_SEPARATE, ids=_fid)
def test_kda_separate_steps_match_the_emulation(case):
    name, state, read, sr = case
    drive(name, "cpu", state, read, sr)


@pytest.mark.parametrize("state", ["f32", "f16"])
@pytest.mark.parametrize("read_dtype", ["e4m3", "nvfp4"])
def test_kda_separate_carried_copy_is_the_single_copy_run(read_dtype, state):
    """As test_separate_carried_copy_is_the_single_copy_run, for KDA on the torch path: its
    flush recomputes each held u from the carried copy with the per-channel decays."""
    runs = [drive("kda", "cpu", state, read, state != "f32", window=4, steps=12)[0].state
            for read in (None, read_dtype)]  # fmt: skip
    a, b = (codecs.raw_bits(run).view(torch.uint8) for run in runs)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["per-item", "split"])
@pytest.mark.parametrize("state", ["f32", "f16"])
def test_read_copy_rounded_to_nearest_under_sr(state, kernel, device):
    """read_copy_round_to_nearest: SR rounds the carried copy (where it is 16-bit), the read copy
    is rounded to nearest (drive() holds it to the RN encoding, within one code)."""
    drive("mamba2", device, state, "e4m3", True, read_rn=True, config=LaunchConfig(kernel=kernel))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["rn", "sr", "sr-read-rn"])
def test_read_copy_is_the_carried_copy_encoded(rounding, device):
    """With an FP32 carried copy the read copy is exactly the oracle's encoding of it, bit for
    bit: round to nearest, or SR with the read copy's own bits (the stream with bit 63 set, the
    epoch of the last flush), or to nearest under SR with read_copy_round_to_nearest."""
    sr, read_rn = rounding != "rn", rounding == "sr-read-rn"
    cache, _ = drive("mamba2", device, "f32", "e4m3", sr, read_rn=read_rn)
    live = torch.tensor([3, 0, 5, 6])
    carried = cache.state.cpu()[live]
    bits = None
    if sr and not read_rn:
        epochs = cache.cursors.cpu()[live, 1].to(torch.int64) - 1
        stream = ((live << 32) | epochs) | -(2**63)
        element = torch.arange(carried[0].numel(), dtype=torch.int64)
        bits = codecs.rounding_bits(SEED, stream[:, None], element[None, :]).view(carried.shape)
    want = P.fp8_encode(carried, bits=bits)
    assert torch.equal(cache.tensors["read_state"].cpu()[live].view(torch.uint8), want.codes)
    assert torch.equal(cache.tensors["read_scale"].cpu()[live], want.scale.squeeze(-1))


def test_read_copy_rounding_option_needs_sr_and_a_read_copy():
    with pytest.raises(ValueError, match="^flags: 'read_rn'"):
        mamba2_spec(headdim=64, dstate=128, heads_per_group=8, read_dtype="e4m3",
                    flags=("read_rn",))  # fmt: skip
    with pytest.raises(ValueError, match="^flags: 'read_rn'"):
        mamba2_spec(headdim=64, dstate=128, heads_per_group=8, state_dtype="bf16",
                    flags=("sr", "read_rn"))  # fmt: skip


SPLIT_FORMATS = [c for c in FORMATS if c[0] in ("mamba2", "gdn") and c[2] in ("e4m3", "nvfp4")] + [
    FORMATS[0],
    ("mamba2", "nvfp4", None, True),
    ("gdn", "nvfp4", None, True),
    ("kda", "nvfp4", None, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SPLIT_FORMATS, ids=_fid)
def test_split_steps_match_the_emulation(case, device):
    """The split step (a records kernel, then the state kernel) of each format and mode."""
    name, state, read, sr = case
    drive(name, device, state, read, sr, config=LaunchConfig(kernel="split"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_conventional_e4m3_matches_the_emulation(name, device):
    """Conventional steps (window 1) store e4m3 every token: each state against the float64
    step of the previous one, encoded (RN)."""
    gen = torch.Generator().manual_seed(2)
    fam = FAMILIES[name](device, gen)
    cache = fam.cache_type(3, **fam.dims, window=1, state_dtype=torch.float8_e4m3fn,
                           act_dtype=F32, device=device)  # fmt: skip
    wrapper = fam.wrapper_type(cache, mode="conventional")
    wrapper.plan(2, **fam.options)
    cache.reset([0, 2], 0.5 * torch.randn(2, *fam.state_shape, generator=gen))
    rows = torch.tensor([2, 0], dtype=torch.int32)
    for step in range(4):
        before = decoded(cache.tensors, "state", "state_scale")
        tok = fam.tokens(2)
        out = torch.full((2, *fam.state_shape[:2]), math.nan, device=device)
        fam.run(wrapper, {**tok, "out": out}, rows.to(device))
        want_out = fam.reference(before, rows, tok)
        assert (out.cpu().double() - want_out).norm() / want_out.norm() < 2e-5
        want = P.fp8_encode(before[rows.long()]).value
        got = decoded(cache.tensors, "state", "state_scale")[rows.long()]
        assert_within_one_code(got, want, "e4m3", f"step {step}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name,kernel",
    [("mamba2", "per-item"), ("mamba2", "split"), ("gdn", "per-item"), ("gdn", "split")],
)
@pytest.mark.parametrize("state", ["f32", "f16"])
@pytest.mark.parametrize("read_dtype", ["e4m3", "nvfp4"])
def test_separate_carried_copy_is_the_single_copy_run(read_dtype, state, name, kernel, device):
    """Separate mode never lets the read copy's error reach the carried copy: after three
    flushes the carried copy is bit for bit that of a one-copy run of the same format with the
    same inputs (same kernel and row tile, whole heads for NVFP4; GDN's flush recomputes each
    held u from the carried copy as the one-copy run's non-flush steps computed it); drive()
    holds each run's non-flush outputs to its own read copy."""
    whole_head = FAMILIES[name]("cpu", torch.Generator()).state_shape[1]
    rows = whole_head if read_dtype == "nvfp4" else 64
    config = LaunchConfig(kernel=kernel, rows_per_cta=rows)
    runs = {}
    for read in (None, read_dtype):
        cache, _ = drive(name, device, state, read, state != "f32", window=4, steps=12,
                         config=config)  # fmt: skip
        runs[read] = cache
    a, b = runs[None].state.cpu(), runs[read_dtype].state.cpu()
    assert torch.equal(codecs.raw_bits(a).view(torch.uint8), codecs.raw_bits(b).view(torch.uint8))


@pytest.mark.gpu
def test_gdn_separate_per_item_carried_copy_on_the_policys_small_batch_tile():
    """The 32-row tile GDN separate mode's per-item step takes at small batch (tile_targets'
    "per-item read copy"): the carried copy is still a one-copy run's, bit for bit."""
    config = LaunchConfig(kernel="per-item", rows_per_cta=32)
    ends = [drive("gdn", "cuda", "f32", read, False, window=4, steps=12, config=config)[0].state
            for read in (None, "e4m3")]  # fmt: skip
    a, b = (end.cpu() for end in ends)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("state, read", [("e4m3", None), ("f32", "e4m3")])
def test_mamba2_windowed_per_item_on_the_policys_small_batch_tile(state, read):
    """The 32-row tile Mamba-2's windowed per-item step takes at batch 1 (tile_targets
    "per-item"): every step against the float64 emulation, as drive() checks them."""
    config = LaunchConfig(kernel="per-item", rows_per_cta=32)
    drive("mamba2", "cuda", state, read, False, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["per-item", "split"])
def test_gdn_separate_with_bf16_activations(kernel):
    """BF16 activations (the split state kernel then recomputes from FP32 copies of the held k
    rows): the carried copy is bit for bit a one-copy FP32 run's, and within FMA order of the
    CPU twin's, after three flushes."""
    gen = torch.Generator().manual_seed(9)
    fam = DeltaFamily("cpu", gen, per_channel=False)
    init = 0.5 * torch.randn(4, *fam.state_shape, generator=gen)
    tokens = []
    for _ in range(12):
        tok = fam.tokens(3)
        tokens.append({k: (v.to(torch.bfloat16) if k in "qkv" else v) for k, v in tok.items()})
    rows = torch.tensor([2, 0, 3], dtype=torch.int32)
    ends = {}
    for device, read in (("cuda", None), ("cuda", "e4m3"), ("cpu", "e4m3")):
        cache = GDNDecodeCache(4, **fam.dims, window=4, read_dtype=read,
                               act_dtype=torch.bfloat16, device=device)  # fmt: skip
        wrapper = GDNDecodeWrapper(cache)
        wrapper.plan(3, config=LaunchConfig(kernel=kernel, rows_per_cta=64), **fam.options)
        cache.reset([0, 1, 2, 3], init)
        for tok in tokens:
            fam.run(wrapper, {k: v.to(device) for k, v in tok.items()}, rows.to(device))
        ends[device, read] = cache.state.cpu()
    assert torch.equal(ends["cuda", "e4m3"], ends["cuda", None])
    assert torch.allclose(ends["cuda", "e4m3"], ends["cpu", "e4m3"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ends["cuda", "e4m3"], init), "no flush reached the state"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in FORMATS if c[3]], ids=_fid)
def test_gpu_rounding_is_the_cpu_twin(case):
    """The kernels' rounding bits are the CPU twin's: the same sequence on both devices ends in
    the same codes, up to the rare value whose FP32 fold differs by an ulp (FMA order); bits
    from another stream would change about a third of the stochastically rounded codes."""
    name, state, read, sr = case
    ends = {dev: drive(name, dev, state, read, sr, steps=8)[0] for dev in ("cpu", "cuda")}
    for copy in ends["cpu"].layout.checkpoint_names:
        a = codecs.raw_bits(ends["cpu"].tensors[copy])
        b = codecs.raw_bits(ends["cuda"].tensors[copy]).cpu()
        if a.dtype == F32:  # FP32 copies and row scales: FMA order only
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), copy
            continue
        differ = (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
        assert differ < 0.01, f"{copy}: {differ:.2%} of the bytes differ from the CPU twin"


@pytest.mark.parametrize("device", DEVICES)
def test_sr_same_seed_same_bits(device):
    """Two runs with one seed store the same e4m3 bits; a run with another seed differs."""

    def run(seed):
        gen = torch.Generator().manual_seed(3)
        fam = Mamba2Family(device, gen)
        cache = fam.cache_type(2, **fam.dims, window=2, state_dtype="e4m3", act_dtype=F32,
                               device=device)  # fmt: skip
        wrapper = fam.wrapper_type(cache)
        wrapper.plan(2, seed=seed, stochastic_rounding=True, **fam.options)
        cache.reset([0, 1], 0.5 * torch.randn(2, *fam.state_shape, generator=gen))
        for _ in range(4):
            fam.run(wrapper, fam.tokens(2), torch.tensor([0, 1], dtype=torch.int32, device=device))
        return cache.state.view(torch.uint8).cpu().clone()

    first, again, other = run(11), run(11), run(12)
    assert torch.equal(first, again)
    assert (first != other).float().mean() > 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_sr_read_copy_is_unbiased(device):
    """256 slots carry one FP32 state; after a flush their e4m3 read copies (SR, keyed by slot)
    average to the carried values: the mean error, in units of each value's gap, is below 6
    standard errors (each draw's error is within one gap, so its variance is below 1/4)."""
    gen = torch.Generator().manual_seed(6)
    fam = Mamba2Family(device, gen, heads=1, groups=1)
    slots = 256
    cache = fam.cache_type(slots, **fam.dims, window=2, read_dtype="e4m3", act_dtype=F32,
                           device=device)  # fmt: skip
    wrapper = fam.wrapper_type(cache)
    wrapper.plan(slots, seed=SEED, stochastic_rounding=True, **fam.options)
    one = 0.5 * torch.randn(1, *fam.state_shape, generator=gen)
    cache.reset(list(range(slots)), one.expand(slots, -1, -1, -1).contiguous())
    rows = torch.arange(slots, dtype=torch.int32, device=device)
    tok = {k: (v[:1].expand(slots, *v.shape[1:]).contiguous() if v.dim() > 1 else v)
           for k, v in fam.tokens(1).items()}  # fmt: skip
    for _ in range(2):  # the second step flushes
        fam.run(wrapper, tok, rows)
    carried = cache.state.cpu().double()
    assert torch.equal(carried, carried[:1].expand_as(carried)), "the carried copies differ"
    read = decoded(cache.tensors, "read_state", "read_scale")
    scale = cache.tensors["read_scale"].cpu().double().unsqueeze(-1)
    # One gap of each value: the e4m3 step at |value / scale| (subnormal below 2^-6), scaled.
    q = (carried / scale).abs().clamp_min(2.0**-6)
    ulp = torch.exp2(torch.floor(torch.log2(q)) - 3) * scale
    moved = read != P.fp8_encode(carried.to(F32)).value
    assert moved.float().mean() > 0.2, "SR left most values at their nearest code"
    err = ((read - carried) / ulp).mean().item()
    bound = 6 * 0.5 / math.sqrt(read.numel())
    assert abs(err) < bound, f"mean SR error {err:.2e} gaps exceeds {bound:.2e}"
