"""FP8 e4m3 checkpoints (shared mode) and separate mode's read copy (docs/precision.md).

On the CPU: specs, URIs, layouts, errors, lifecycle and the PyTorch twin. On every device (the
GPU cases carry the gpu marker): decode steps of fresh random sequences, outputs poisoned first,
against float64 emulations that round where the kernels round:
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
from typing import ClassVar

import pytest
import torch

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    KDADecodeCache,
    KDADecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
)
from replayssm_jit.core import codecs
from replayssm_jit.families import HeadShape
from replayssm_jit.families.layout import CheckpointFormat, gdn_layout, mamba2_layout
from replayssm_jit.families.spec import gdn_spec, make_spec, mamba2_spec
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.reference import precision as P
from replayssm_jit.reference.gdn import gdn_step_pool
from replayssm_jit.reference.kda import kda_step_pool
from replayssm_jit.reference.mamba2 import mamba2_step_pool

F32, F64 = torch.float32, torch.float64
SEED = 77
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TORCH = {"f32": F32, "f16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
         "nvfp4": torch.float4_e2m1fn_x2}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Specs, layouts and their errors
# ---------------------------------------------------------------------------------------------


def test_uri_names_the_checkpoint_formats():
    shared = mamba2_spec(headdim=64, dstate=128, heads_per_group=8, state_dtype="e4m3")
    separate = mamba2_spec(headdim=64, dstate=128, heads_per_group=8, read_dtype="e4m3")
    assert "_state-e4m3" in shared.uri and "read-" not in shared.uri
    assert "_state-f32_read-e4m3" in separate.uri
    assert separate.template_context()["read_t"] == "replayssm::e4m3"
    assert shared.template_context()["read_t"] == "void"
    sr = mamba2_spec(headdim=64, dstate=128, heads_per_group=8, read_dtype="e4m3", flags=("sr",))
    assert sr.flags == ("sr",)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(read_dtype="f32"), ValueError, "^read_dtype: expected a format narrower"),
        (dict(state_dtype="bf16", read_dtype="bf16"), ValueError, "^read_dtype: expected"),
        (dict(state_dtype="bf16", read_dtype="f16"), ValueError, "^read_dtype: a read copy"),
        (dict(state_dtype="e4m3", read_dtype="bf16"), ValueError, "^read_dtype: a read copy"),
        (dict(read_dtype="fp8"), TypeError, "^read_dtype: expected one of"),
        (dict(read_dtype="e4m3", window=1), ValueError, r"^read_dtype: .*window=1"),
        (dict(flags=("sr",)), ValueError, "^flags: 'sr'"),
        (dict(act_dtype="e4m3"), TypeError, "^act_dtype: expected one of"),
        (dict(act_dtype="nvfp4"), TypeError, "^act_dtype: expected one of"),
        (dict(state_dtype="nvfp4", read_dtype="e4m3"), ValueError, "^read_dtype: a read copy"),
        (dict(state_dtype="e4m3", read_dtype="nvfp4"), ValueError, "^read_dtype: a read copy"),
        (dict(read_dtype="nvfp4", dstate=16), ValueError, "^dstate: expected a multiple of 32"),
    ],
)
def test_bad_checkpoint_formats_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        mamba2_spec(**{"headdim": 64, "dstate": 128, "heads_per_group": 8, **kwargs})


def test_nvfp4_tiles_hold_whole_heads_per_cta():
    """NVFP4's head scale is reduced over the head at a flush: a CTA holds whole heads (no row
    splits), with at most 64 values per lane (GDN's 128-row heads: 8 warps); KDA, which has no
    separate mode, refuses an NVFP4 read copy by name."""
    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=8, state_dtype="nvfp4")
    assert "_state-nvfp4" in spec.uri and spec.template_context()["state_t"] == "replayssm::nvfp4x2"
    assert {rows for rows, _ in spec.template_context()["tilings"]} == {64}
    separate = mamba2_spec(headdim=64, dstate=128, heads_per_group=8, read_dtype="nvfp4")
    assert "_state-f32_read-nvfp4" in separate.uri
    assert {rows for rows, _ in separate.template_context()["tilings"]} == {64}
    for state, read in (("nvfp4", None), ("f32", "nvfp4"), ("bf16", "nvfp4")):
        spec = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2,
                        state_dtype=state, read_dtype=read)  # fmt: skip
        assert spec.template_context()["tilings"] == [(128, 8)]
    kda = make_spec("kda", HeadShape(2, 4, 128, 128), state_dtype="nvfp4")
    assert kda.template_context()["tilings"] == [(128, 8)]
    with pytest.raises(ValueError, match="^read_dtype: separate mode .* not kda"):
        make_spec("kda", HeadShape(2, 4, 128, 128), read_dtype="nvfp4")


def test_nvfp4_layout_tensors_and_bytes():
    args = dict(num_heads=8, headdim=64, dstate=128, ngroups=1)
    shared = mamba2_layout(**args, state_dtype="nvfp4")
    separate = mamba2_layout(**args, read_dtype=torch.float4_e2m1fn_x2)
    plain = mamba2_layout(**args)
    assert shared.checkpoint_names == ("state", "state_scale", "state_block_scale")
    assert separate.checkpoint_names == ("state", "read_state", "read_scale", "read_block_scale")
    by_name = {t.name: t for t in shared.tensors()}
    assert by_name["state"].dtype == torch.float4_e2m1fn_x2
    assert by_name["state"].per_slot_shape == (8, 64, 64)
    assert by_name["state_scale"].per_slot_shape == (8,)
    assert by_name["state_block_scale"].per_slot_shape == (8, 64, 8)
    assert by_name["state_block_scale"].dtype == torch.float8_e4m3fn
    rings = plain.bytes_per_slot() - 8 * 64 * 128 * 4
    head = 64 * (64 + 8) + 4  # codes, block scales, head scale
    assert shared.bytes_per_slot() == rings + 8 * head
    assert separate.bytes_per_slot() == plain.bytes_per_slot() + 8 * head


@pytest.mark.parametrize(
    "fmt, state, read, window",
    [
        (dict(hp_dtype="f32", lp_format="nvfp4"), torch.float32, torch.float4_e2m1fn_x2, 16),
        (
            dict(hp_dtype=torch.float16, lp_format="fp8_e4m3"),
            torch.float16,
            torch.float8_e4m3fn,
            16,
        ),
        (dict(hp_dtype=None, lp_format="nvfp4", mode="shared"), torch.float4_e2m1fn_x2, None, 16),
        (dict(hp_dtype=None, lp_format="bf16", mode="shared"), torch.bfloat16, None, 16),
        (
            dict(hp_dtype="f32", lp_format="fp8_e4m3", mode="conventional"),
            torch.float8_e4m3fn,
            None,
            1,
        ),
        (dict(hp_dtype="bf16", mode="conventional"), torch.bfloat16, None, 1),
    ],
)
def test_checkpoint_format_names_the_layout_dtypes(fmt, state, read, window):
    layout = mamba2_layout(num_heads=8, headdim=64, dstate=128, ngroups=1,
                           checkpoint_format=CheckpointFormat(**fmt))  # fmt: skip
    assert (layout.state_dtype, layout.read_dtype, layout.window) == (state, read, window)


@pytest.mark.parametrize(
    "fmt, error, match",
    [
        (
            dict(hp_dtype="f32", lp_format="nvfp4", mode="shared"),
            ValueError,
            "^hp_dtype, lp_format: shared",
        ),
        (dict(hp_dtype=None, mode="shared"), ValueError, "^hp_dtype, lp_format: shared"),
        (dict(hp_dtype="f32"), ValueError, "^lp_format: separate mode needs"),
        (dict(hp_dtype=None, lp_format="nvfp4"), ValueError, "^hp_dtype: separate mode needs one"),
        (dict(lp_format="fp4"), ValueError, "^lp_format: expected None or one of"),
        (dict(lp_format="nvfp4", mode="both"), ValueError, "^mode: expected one of"),
        (dict(hp_dtype="e4m3", lp_format="nvfp4"), TypeError, "^hp_dtype: expected one of"),
    ],
)
def test_bad_checkpoint_format_is_refused(fmt, error, match):
    with pytest.raises(error, match=match):
        CheckpointFormat(**fmt)


def test_checkpoint_format_replaces_the_dtypes():
    fmt = CheckpointFormat(hp_dtype="f32", lp_format="nvfp4")
    with pytest.raises(ValueError, match="^checkpoint_format: expected it in place of"):
        mamba2_layout(num_heads=8, headdim=64, dstate=128, ngroups=1, checkpoint_format=fmt,
                      read_dtype="e4m3")  # fmt: skip
    with pytest.raises(TypeError, match="^checkpoint_format: expected a CheckpointFormat"):
        mamba2_layout(num_heads=8, headdim=64, dstate=128, ngroups=1, checkpoint_format="nvfp4")


def test_separate_mode_is_built_for_mamba2_and_gdn():
    from replayssm_jit.families.spec import kda_spec

    dims = dict(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    with pytest.raises(ValueError, match=r"^read_dtype: separate mode .* not kda"):
        kda_spec(**dims, read_dtype="e4m3")
    spec = gdn_spec(**dims, read_dtype="e4m3")
    assert spec.read_dtype == "e4m3" and "_read-e4m3" in spec.uri


def test_gdn_separate_layout_records_v_and_beta():
    """Separate mode's GDN rings add (v, beta) per record, the inputs a flush recomputes each
    held u from; the other layouts have no such rings."""
    args = dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128, window=4)
    plain, separate = gdn_layout(**args), gdn_layout(**args, read_dtype="e4m3")
    assert plain.ring_names == ("rec_u", "rec_k", "rec_g")
    assert separate.ring_names == ("rec_u", "rec_k", "rec_g", "rec_v", "rec_beta")
    cap = separate.capacity
    read_copy = 2 * 128 * (128 + 4)
    extra_rings = 2 * cap * 128 * 2 + 2 * cap * 4  # rec_v (act bf16), rec_beta (f32)
    assert separate.bytes_per_slot() == plain.bytes_per_slot() + read_copy + extra_rings


def test_gdn_separate_mode_keeps_the_window():
    from replayssm_jit.launch.policy import choose_replay_kernel

    spec = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, read_dtype="e4m3")
    assert choose_replay_kernel(spec, 256, 64, 132, LaunchConfig()) == "split"
    assert choose_replay_kernel(spec, 1, 64, 132, LaunchConfig()) == "per-item"


def test_e4m3_rows_must_fill_16_byte_chunks():
    with pytest.raises(ValueError, match="^dstate: expected a multiple of 16"):
        mamba2_spec(headdim=64, dstate=8, heads_per_group=8, state_dtype="e4m3")


def test_layout_tensors_and_bytes():
    args = dict(num_heads=8, headdim=64, dstate=128, ngroups=1)
    shared = mamba2_layout(**args, state_dtype=torch.float8_e4m3fn)
    separate = mamba2_layout(**args, read_dtype="e4m3")
    plain = mamba2_layout(**args)
    assert shared.checkpoint_names == ("state", "state_scale")
    assert separate.checkpoint_names == ("state", "read_state", "read_scale")
    by_name = {t.name: t for t in separate.tensors()}
    assert by_name["read_state"].dtype == torch.float8_e4m3fn
    assert by_name["read_state"].per_slot_shape == (8, 64, 128)
    assert by_name["read_scale"].per_slot_shape == (8, 64)
    rings = plain.bytes_per_slot() - 8 * 64 * 128 * 4
    assert shared.bytes_per_slot() == rings + 8 * 64 * (128 + 4)
    assert separate.bytes_per_slot() == plain.bytes_per_slot() + 8 * 64 * (128 + 4)


def test_conventional_plan_of_a_separate_layout_is_refused():
    cache = Mamba2DecodeCache(4, num_heads=8, headdim=64, dstate=128, ngroups=1,
                              read_dtype="e4m3", device="cpu")  # fmt: skip
    wrapper = Mamba2DecodeWrapper(cache, mode="conventional")
    with pytest.raises(ValueError, match="^mode: expected 'replay' for a layout with a read copy"):
        wrapper.plan(2)


def test_policy_keeps_the_window_with_a_read_copy():
    """Separate mode never flushes every step (that would read the carried copy every token):
    small batches run per item, large ones split, as for 16-bit checkpoints."""
    from replayssm_jit.launch.policy import choose_replay_kernel

    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=16, read_dtype="e4m3")
    assert choose_replay_kernel(spec, 1, 128, 132, LaunchConfig()) == "per-item"
    assert choose_replay_kernel(spec, 256, 128, 132, LaunchConfig()) == "split"
    plain = mamba2_spec(headdim=64, dstate=128, heads_per_group=16)
    assert choose_replay_kernel(plain, 1, 128, 132, LaunchConfig()) == "flush-every-step"


def test_missing_scale_tensor_is_named():
    cache = Mamba2DecodeCache(4, num_heads=8, headdim=64, dstate=128, ngroups=1,
                              state_dtype="e4m3", act_dtype=F32, device="cpu")  # fmt: skip
    wrapper = Mamba2DecodeWrapper(cache)
    wrapper.plan(1, **Mamba2Family.options)
    tensors = dict(cache.tensors)
    del tensors["state_scale"]
    from replayssm_jit.ops.mamba2 import mamba2_decode

    tok = Mamba2Family("cpu", torch.Generator().manual_seed(0), heads=8, groups=1).tokens(1)
    with pytest.raises((TypeError, ValueError), match="^state_scale: expected"):
        mamba2_decode(wrapper.decode_plan, **tensors, slot_indices=torch.zeros(1, dtype=torch.int32),
                      **tok)  # fmt: skip


def test_cpu_encoder_is_the_reference_encoder():
    """core.codecs.encode_e4m3_rows (the CPU twin of checkpoint.cuh's store_row) against
    reference.precision.fp8_encode, bit for bit, RN and SR, over rows of every magnitude."""
    gen = torch.Generator().manual_seed(4)
    for magnitude in (1e-41, 1e-20, 1e-3, 1.0, 300.0, 1e5, 1e30, 0.0):
        x = torch.randn(16, 128, generator=gen) * magnitude
        x[0, :7] = 0.0
        x[1] = -x[1].abs()
        bits = torch.randint(0, 2**16, x.shape, generator=gen)
        for b in (None, bits):
            codes, scale = codecs.encode_e4m3_rows(x, b)
            want = P.fp8_encode(x, bits=b)
            assert torch.equal(scale, want.scale.squeeze(-1)), magnitude
            assert torch.equal(codes, want.codes), magnitude


def test_lifecycle_encodes_and_materializes():
    """reset() with an initial state encodes every copy (RN); fork copies codes and scales;
    materialize returns the carried copy in FP32."""
    gen = torch.Generator().manual_seed(5)
    cache = Mamba2DecodeCache(4, num_heads=2, headdim=64, dstate=128, ngroups=1, window=4,
                              read_dtype="e4m3", device="cpu")  # fmt: skip
    init = torch.randn(2, 2, 64, 128, generator=gen)
    assert cache.allocate(4).tolist() == [0, 1, 2, 3]
    cache.reset([1, 3], init)
    assert torch.equal(cache.state[[1, 3]], init)
    codes, scale = codecs.encode_e4m3_rows(init)
    assert torch.equal(cache.tensors["read_state"][[1, 3]].view(torch.uint8), codes)
    assert torch.equal(cache.tensors["read_scale"][[1, 3]], scale)
    cache.fork([1], [2])
    for name in cache.layout.checkpoint_names:
        assert torch.equal(
            codecs.raw_bits(cache.tensors[name][2]), codecs.raw_bits(cache.tensors[name][1])
        )
    cache.reset([2])
    assert not codecs.raw_bits(cache.tensors["read_state"][2]).any()
    assert not cache.tensors["read_scale"][2].any()
    shared = Mamba2DecodeCache(2, num_heads=2, headdim=64, dstate=128, ngroups=1, window=4,
                               state_dtype="e4m3", device="cpu")  # fmt: skip
    shared.reset([0], init[:1])
    wrapper = Mamba2DecodeWrapper(shared)
    wrapper.plan(1)
    got = wrapper.materialize([0], A=-torch.ones(2))
    want = P.fp8_encode(init[:1]).value.to(F32)
    assert torch.equal(got, want)


def test_gdn_separate_materializes_the_carried_state():
    """A GDN separate-mode slot holding records materializes to the carried copy's state: its
    held u recomputed from the carried copy, as a one-copy FP32 run of the same inputs holds
    them (not the read copy's u in the ring), and to the float64 decode of the inputs."""
    gen = torch.Generator().manual_seed(8)
    fam = DeltaFamily("cpu", gen, per_channel=False)
    init = 0.5 * torch.randn(2, *fam.state_shape, generator=gen)
    tokens = [fam.tokens(2) for _ in range(6)]  # window 4: a flush at step 4, then two held
    rows = torch.tensor([0, 1], dtype=torch.int32)
    states, rings = {}, {}
    for read in (None, "e4m3"):
        cache = GDNDecodeCache(2, **fam.dims, window=4, read_dtype=read, act_dtype=F32,
                               device="cpu")  # fmt: skip
        wrapper = GDNDecodeWrapper(cache)
        wrapper.plan(2, **fam.options)
        cache.reset([0, 1], init)
        for tok in tokens:
            fam.run(wrapper, tok, rows)
        assert cache.cursors[:, 0].tolist() == [2, 2]
        states[read] = wrapper.materialize([0, 1])
        rings[read] = cache.tensors["rec_u"][:, :, :2].clone()
    assert torch.allclose(states["e4m3"], states[None], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(rings["e4m3"], rings[None], rtol=1e-4, atol=1e-5)  # LP-derived u
    want = init.to(F64)
    for tok in tokens:
        fam.reference(want, rows, tok)  # (advances `want` in place)
    err = (states["e4m3"].to(F64) - want).norm() / want.norm()
    assert err < 1e-5, err


# ---------------------------------------------------------------------------------------------
# Decode steps against float64 emulations
# ---------------------------------------------------------------------------------------------


class Mamba2Family:
    cache_type, wrapper_type = Mamba2DecodeCache, Mamba2DecodeWrapper
    options: ClassVar[dict] = dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True)

    def __init__(self, device, gen, heads=4, groups=2):
        self.device, self.gen = device, gen
        self.H, self.G, self.P, self.N = heads, groups, 64, 128
        self.dims = dict(num_heads=heads, headdim=self.P, dstate=self.N, ngroups=groups)
        self.A = -(0.5 + torch.rand(heads, generator=gen))
        self.D = torch.randn(heads, generator=gen)
        self.dt_bias = 0.1 * torch.randn(heads, generator=gen)

    @property
    def state_shape(self):
        return (self.H, self.P, self.N)

    def tokens(self, batch):
        g, dev = self.gen, self.device
        return dict(
            x=torch.randn(batch, self.H, self.P, generator=g).to(dev),
            dt=(torch.rand(batch, self.H, generator=g) * 2 - 2.5).to(dev),
            A=self.A.to(dev),
            B=(0.5 * torch.randn(batch, self.G, self.N, generator=g)).to(dev),
            C=(0.5 * torch.randn(batch, self.G, self.N, generator=g)).to(dev),
            D=self.D.to(dev),
            dt_bias=self.dt_bias.to(dev),
        )

    def run(self, wrapper, tok, slots):
        tok = dict(tok)
        return wrapper.run(tok.pop("x"), tok.pop("dt"), tok.pop("A"), tok.pop("B"), tok.pop("C"),
                           slots, **tok)  # fmt: skip

    def reference(self, pool, slots, tok):
        t = {k: v.cpu() for k, v in tok.items()}
        return mamba2_step_pool(pool, slots, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"],
                                None, t["dt_bias"], True)  # fmt: skip


class DeltaFamily:
    options: ClassVar[dict] = dict(use_qk_l2norm=True, gates_in_kernel=False)

    def __init__(self, device, gen, per_channel):
        self.device, self.gen, self.per_channel = device, gen, per_channel
        self.H, self.HV, self.K, self.V = 1, 2, 128, 128
        self.dims = dict(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128)
        self.cache_type = KDADecodeCache if per_channel else GDNDecodeCache
        self.wrapper_type = KDADecodeWrapper if per_channel else GDNDecodeWrapper
        self.step_pool = kda_step_pool if per_channel else gdn_step_pool

    @property
    def state_shape(self):
        return (self.HV, self.V, self.K)

    def tokens(self, batch):
        g, dev = self.gen, self.device
        gate = (batch, self.HV, self.K) if self.per_channel else (batch, self.HV)
        return dict(
            q=torch.randn(batch, self.H, self.K, generator=g).to(dev),
            k=torch.randn(batch, self.H, self.K, generator=g).to(dev),
            v=torch.randn(batch, self.HV, self.V, generator=g).to(dev),
            g=(-0.3 * torch.rand(gate, generator=g)).to(dev),
            beta=torch.rand(batch, self.HV, generator=g).to(dev),
        )

    def run(self, wrapper, tok, slots):
        tok = dict(tok)
        return wrapper.run(tok.pop("q"), tok.pop("k"), tok.pop("v"), slots, **tok)

    def reference(self, pool, slots, tok):
        t = {k: v.cpu() for k, v in tok.items()}
        return self.step_pool(pool, slots, t["q"], t["k"], t["v"], t["g"], t["beta"],
                              self.K**-0.5, True)  # fmt: skip


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


# ---------------------------------------------------------------------------------------------
# Layout arguments, drawn (hypothesis): every combination is accepted or refused by the
# documented rules, worked out here, and a refusal names its argument
# ---------------------------------------------------------------------------------------------

CHECKPOINT_FORMS = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, torch.float32: 4,
                    torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1}  # fmt: skip
NAME_OF = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
           torch.float8_e4m3fn: "e4m3"}  # fmt: skip


def expected_refusal(family, state, read, window, drafts, key_dim) -> str | None:
    """The argument a layout must name in its error, or None where the rules allow it (the row
    tiling, which decides the value dim, aside)."""
    if state not in CHECKPOINT_FORMS:
        return "state_dtype"
    if read is not None and read not in CHECKPOINT_FORMS:
        return "read_dtype"
    s = NAME_OF.get(state, state)
    r = NAME_OF.get(read, read) if read is not None else None
    if r is not None:
        if CHECKPOINT_FORMS[read] >= CHECKPOINT_FORMS[state] or s == "e4m3":
            return "read_dtype"
        if family not in ("mamba2", "gdn") or window < 2:
            return "read_dtype"
    # (drafts with e4m3 or a read copy: the torch path's and Mamba-2's kernels; check_cuda_spec
    # refuses GDN and KDA CUDA modules)
    narrowest = min(CHECKPOINT_FORMS[state], CHECKPOINT_FORMS[read] if r else 4)
    vec = 16 // narrowest
    if key_dim % max(vec, 8) or key_dim > 32 * vec * 8:
        return "key_dim"
    return None


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_drawn_layout_formats_follow_the_rules(family):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    forms = [*CHECKPOINT_FORMS, torch.float64, "fp8", "float8", None, 1]
    key_arg = "dstate" if family == "mamba2" else "head_k_dim"
    value_arg = "headdim" if family == "mamba2" else "head_v_dim"

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(state=st.sampled_from(forms[:-1]), read=st.sampled_from(forms),
           window=st.sampled_from([1, 2, 4, 16]), drafts=st.sampled_from([1, 2, 4]),
           key_dim=st.sampled_from([8, 16, 24, 32, 64, 128, 4096, 8192]),
           value_dim=st.sampled_from([16, 32, 64, 80, 128]))  # fmt: skip
    def check(state, read, window, drafts, key_dim, value_dim):
        read = None if read == 1 else read  # (1 stands for "no read copy" among the draws)
        if family == "mamba2":
            dims = dict(num_heads=4, ngroups=2, headdim=value_dim, dstate=key_dim)
        else:
            dims = dict(num_k_heads=1, num_v_heads=2, head_k_dim=key_dim, head_v_dim=value_dim)
        want = expected_refusal(family, state, read, window, drafts, key_dim)
        want = {"key_dim": key_arg}.get(want, want)
        try:
            layout = family_layout_of(family, dims, state, read, window, drafts)
        except (TypeError, ValueError) as exc:
            names = (want,) if want else (value_arg,)
            assert str(exc).startswith(tuple(f"{n}:" for n in names)), (want, str(exc))
            return
        assert want is None, f"accepted, but {want} breaks the rules"
        names = [t.name for t in layout.tensors()]
        copies = [n for n in names if n in ("state", "state_scale", "read_state", "read_scale")]
        expect = ["state"] + (["state_scale"] if NAME_OF.get(state, state) == "e4m3" else [])
        if read is not None:
            expect += ["read_state"] + (["read_scale"] if NAME_OF.get(read, read) == "e4m3" else [])
        assert copies == expect

    check()


def family_layout_of(family, dims, state, read, window, drafts):
    from replayssm_jit.families.layout import family_layout

    return family_layout(family, window=window, drafts=drafts, state_dtype=state,
                         read_dtype=read, **dims)  # fmt: skip
