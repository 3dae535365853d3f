"""Checkpoint formats on the CPU: specs, URIs, layouts and their errors, the encoder, lifecycle."""

from __future__ import annotations

import pytest
import torch
from support.checkpoint_formats import F32, F64, DeltaFamily, Mamba2Family

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
)
from replayssm_jit.core import codecs
from replayssm_jit.families import HeadShape
from replayssm_jit.families.layout import CheckpointFormat, gdn_layout, mamba2_layout
from replayssm_jit.families.spec import check_cuda_spec, gdn_spec, make_spec, mamba2_spec
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.reference import precision as P

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
    splits), with at most 64 values per lane (GDN's 128-row heads: 8 warps); KDA's NVFP4 read
    copy (separate mode, the torch path's) is a spec, whose CUDA module is refused by name."""
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
    separate = make_spec("kda", HeadShape(2, 4, 128, 128), read_dtype="nvfp4")
    assert "_state-f32_read-nvfp4" in separate.uri
    with pytest.raises(ValueError, match="^read_dtype: expected None for a CUDA kda module"):
        check_cuda_spec(separate)


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


def test_separate_mode_kernels_are_built_for_mamba2_and_gdn():
    """Every family takes a read copy on the torch path; KDA's CUDA module is refused by name."""
    from replayssm_jit.families.spec import kda_spec

    dims = dict(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    spec = gdn_spec(**dims, read_dtype="e4m3")
    assert spec.read_dtype == "e4m3" and "_read-e4m3" in spec.uri and check_cuda_spec(spec) is spec
    kda = kda_spec(**dims, read_dtype="e4m3")
    assert "_read-e4m3" in kda.uri
    with pytest.raises(ValueError, match=r"^read_dtype: expected None for a CUDA kda module"):
        check_cuda_spec(kda)


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
