"""GDN on the CPU: specs and URIs, presets, cache bookkeeping, and the float64 reference
against HF transformers' Qwen3-Next decode path. The wrapper's and the functional op's
validation on CPU tensors: test_gdn_wrapper_cpu.py."""

from __future__ import annotations

import json

import pytest
import torch
from support.aot_presets import every_preset
from support.gdn_shapes import QWEN4B

from replayssm_jit import GDNDecodeCache, gdn_layout, gdn_spec
from replayssm_jit.core.dtypes import CHUNK_VALUES
from replayssm_jit.core.tiles import rows_tilings
from replayssm_jit.families.spec import spec_tilings
from replayssm_jit.jit import build
from replayssm_jit.jit.presets import preset_specs
from replayssm_jit.reference import GDNSequence, gdn_step

PRESETS = every_preset()

TEMPLATE = build.template_root() / "gdn" / "decode.cu.jinja"
needs_template = pytest.mark.skipif(
    not TEMPLATE.exists(), reason=f"GDN template {TEMPLATE} not written yet"
)

pytestmark = pytest.mark.usefixtures("no_launch_env")


# --- specs ------------------------------------------------------------------------------------


def test_uri_is_readable_and_unique():
    a = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    assert a.uri == "gdn_k128_v128_vph2_L16_T1_act-bf16_state-f32_gates_in_kernel_qk_l2norm"
    assert a == gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    assert a.capacity == 17 and a.dims == (("k", 128), ("v", 128), ("vph", 2))
    others = [
        gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=4),  # qwen122b
        gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=8),
        gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, flags=()),
        gdn_spec(
            head_k_dim=128,
            head_v_dim=128,
            value_heads_per_key_head=2,
            state_dtype=torch.bfloat16,
            flags=("sr", "qk_l2norm", "gates_in_kernel", "sr"),
        ),
    ]
    uris = {s.uri for s in [a, *others]}
    assert len(uris) == 5
    assert others[3].flags == ("gates_in_kernel", "qk_l2norm", "sr")
    assert others[3].uri.endswith("_state-bf16_gates_in_kernel_qk_l2norm_sr")


# window and drafts as gdn_spec and the cache (which passes them on) both reject them
BAD_WINDOW_DRAFTS = [
    (dict(window=0), ValueError, "window"),
    (dict(drafts=0), ValueError, "drafts"),
    (dict(window=True), TypeError, "window"),
    (dict(drafts=True), TypeError, "drafts"),
    (dict(window=257), ValueError, "window"),
    (dict(drafts=17), ValueError, "drafts"),
]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        *BAD_WINDOW_DRAFTS,
        (dict(state_dtype=torch.float64), TypeError, "state_dtype"),
        (dict(act_dtype=torch.int8), TypeError, "act_dtype"),
        (dict(flags=("bogus",)), ValueError, "flags"),
        (dict(flags=("d", "qk_l2norm")), ValueError, "flags"),  # a Mamba-2 flag
        (dict(flags=("sr",)), ValueError, "sr"),  # needs a 16-bit state
        (dict(head_k_dim=12), ValueError, "head_k_dim"),
        (dict(head_k_dim=2048), ValueError, "head_k_dim"),
        (dict(head_k_dim=0), ValueError, "head_k_dim"),
        (dict(head_v_dim=3, state_dtype=torch.bfloat16), ValueError, "head_v_dim"),
        (dict(head_v_dim=-1), ValueError, "head_v_dim"),
        (dict(value_heads_per_key_head=0), ValueError, "value_heads_per_key_head"),
        (dict(value_heads_per_key_head=2.0), TypeError, "value_heads_per_key_head"),
    ],
)
def test_spec_rejects_bad_arguments(kwargs, error, match):
    base_kwargs = dict(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    with pytest.raises(error, match=match):
        gdn_spec(**{**base_kwargs, **kwargs})


def test_head_k_dim_limits_follow_the_state_dtype():
    # 16-byte chunks: 4 fp32 or 8 bf16 values per lane chunk, at most 32 lanes x 8 chunks.
    gdn_spec(head_k_dim=1024, head_v_dim=64, value_heads_per_key_head=1)
    gdn_spec(head_k_dim=2048, head_v_dim=64, value_heads_per_key_head=1, state_dtype="bf16")
    with pytest.raises(ValueError, match="multiple of 8 up to 2048"):
        gdn_spec(head_k_dim=2056, head_v_dim=64, value_heads_per_key_head=1, state_dtype="bf16")


@pytest.mark.parametrize("state", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("kv", [(128, 128), (64, 64), (128, 64), (64, 256)])
def test_template_context_carries_the_row_tilings(state, kv):
    K, V = kv
    spec = gdn_spec(head_k_dim=K, head_v_dim=V, value_heads_per_key_head=2, state_dtype=state)
    ctx = spec.template_context()
    assert ctx["tilings"] == rows_tilings(V, K, CHUNK_VALUES[state]) == spec_tilings(spec)
    assert ctx["tilings"] and all(
        V % rows == 0 and rows % warps == 0 for rows, warps in ctx["tilings"]
    )
    assert ctx["dims"] == {"k": K, "v": V, "vph": 2} and ctx["capacity"] == 17
    assert ctx["flags"] == {"gates_in_kernel", "qk_l2norm"}


def test_qwen_tilings():
    for state in ("f32", "bf16"):
        tilings = spec_tilings(
            gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, state_dtype=state)
        )
        assert tilings[0][0] == 128, "whole heads first"
        assert len(tilings) > 1, "split heads for small batches"
        assert [r for r, _ in tilings] == sorted({r for r, _ in tilings}, reverse=True)


# --- AOT presets ------------------------------------------------------------------------------


def test_presets_hold_the_gdn_specs():
    models = [s.uri for s in preset_specs(["models"]) if s.family == "gdn"]
    assert len(models) == 8  # qwen4b, qwen122b x L {1, 16} x state {f32, bf16}
    assert {"vph2", "vph4"} == {u.split("_")[3] for u in models}
    h200 = {s.uri: s for s in preset_specs(["h200"]) if s.family == "gdn"}
    for vph in (2, 4):
        for w in (1, 4, 16, 32):
            assert (
                f"gdn_k128_v128_vph{vph}_L{w}_T1_act-f32_state-f32_gates_in_kernel_qk_l2norm"
                in h200
            )
        for w in (1, 4, 8, 16, 32):
            for state in ("f32", "bf16"):
                assert (
                    f"gdn_k128_v128_vph{vph}_L{w}_T1_act-bf16_state-{state}_gates_in_kernel_qk_l2norm"
                    in h200
                )
        assert (
            f"gdn_k128_v128_vph{vph}_L16_T1_act-bf16_state-bf16_gates_in_kernel_qk_l2norm_sr"
            in h200
        )
        assert f"gdn_k128_v128_vph{vph}_L16_T1_act-f32_state-f32_qk_l2norm" in h200
    for w in (1, 4, 16, 32):
        assert f"gdn_k64_v64_vph2_L{w}_T1_act-f32_state-f32_gates_in_kernel_qk_l2norm" in h200
    assert "gdn_k64_v64_vph2_L16_T1_act-f32_state-f32_qk_l2norm" in h200


@needs_template
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_gdn_spec_renders(preset):
    for spec in preset_specs([preset], PRESETS):
        if spec.family != "gdn":
            continue
        text = build.render(spec)
        assert spec.uri in text
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(replay_step" in text
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(conventional_step" in text
        assert "{{" not in text and "{%" not in text


@needs_template
@pytest.mark.nvcc
def test_gdn_aot_build_exports_both_steps(jit_cache, aot_split_modules, monkeypatch):
    """nvcc builds one sm_90a GDN module (qwen4b, L = 16; conftest's session build); with JIT
    disabled the loader finds and loads it."""
    aot, modules = aot_split_modules
    spec, so_path = modules["gdn"]
    assert spec == gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=16)
    assert so_path == aot / spec.uri / f"{spec.uri}.so"
    manifest = json.loads((aot / spec.uri / "manifest.json").read_text())
    assert manifest["uri"] == spec.uri
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    assert build.find_prebuilt(spec) == so_path
    module = build.load_module(spec)  # loading needs only the CUDA runtime library, not a GPU
    assert callable(module.replay_step) and callable(module.conventional_step)
    assert not (jit_cache / "build").exists(), "the JIT cache must not be used"


# --- cache ------------------------------------------------------------------------------------


def test_cache_shapes_and_dtypes():
    c = GDNDecodeCache(
        6,
        num_k_heads=2,
        num_v_heads=6,
        head_k_dim=32,
        head_v_dim=16,
        window=4,
        drafts=2,
        state_dtype=torch.bfloat16,
        act_dtype=torch.float16,
        device="cpu",
    )
    assert c.state.shape == (6, 6, 16, 32) and c.state.dtype == torch.bfloat16
    assert list(c.rings) == ["rec_u", "rec_k", "rec_g"]  # the kernels' order
    assert c.rings["rec_u"].shape == (6, 6, 6, 16) and c.rings["rec_u"].dtype == torch.float32
    assert c.rings["rec_k"].shape == (6, 2, 6, 32) and c.rings["rec_k"].dtype == torch.float16
    assert c.rings["rec_g"].shape == (6, 6, 6) and c.rings["rec_g"].dtype == torch.float32
    assert c.cursors.shape == (6, 4) and c.cursors.dtype == torch.int32
    assert (c.window, c.drafts, c.act_dtype) == (4, 2, torch.float16)
    # the cache's tensors are the layout's, by name
    layout = gdn_layout(
        num_k_heads=2, num_v_heads=6, head_k_dim=32, head_v_dim=16, window=4, drafts=2,
        state_dtype="bf16", act_dtype="f16",
    )  # fmt: skip
    assert c.layout == layout and layout.capacity == 6
    assert {t.name: (t.shape(6), t.dtype) for t in layout.tensors()} == {
        name: (tuple(t.shape), t.dtype) for name, t in c.tensors.items()
    }
    assert layout.bytes_per_slot() == sum(
        t[0].numel() * t.element_size() for t in c.tensors.values()
    )


def test_cache_takes_short_dtype_names():
    c = GDNDecodeCache(2, **QWEN4B, state_dtype="bf16", act_dtype="f32", device="cpu")
    assert c.state.dtype == torch.bfloat16 and c.act_dtype == torch.float32
    assert c.rings["rec_k"].dtype == torch.float32


def test_cache_allocate_free_reset():
    c = GDNDecodeCache(5, **QWEN4B, window=4, device="cpu", pad_slot_id=0)
    slots = c.allocate(3)
    assert slots.dtype == torch.int32 and slots.tolist() == [1, 2, 3]  # slot 0 is the pad slot
    with pytest.raises(ValueError, match="count"):
        c.allocate(2)
    c.state[slots.long()] = 1.0
    c.cursors[slots.long()] = 7
    init = torch.full((2, 32, 128, 128), 2.0)
    c.reset(slots[:2], init)
    assert torch.equal(c.state[1], init[0]) and c.state[3].eq(1.0).all()
    assert c.cursors[1:3].eq(0).all() and c.cursors[3].eq(7).all()
    assert c.records_held(slots).tolist() == [0, 0, 7]
    with pytest.raises(ValueError, match="initial_state"):
        c.reset(slots, init)
    c.free(slots[:1])
    with pytest.raises(ValueError, match="slots"):
        c.free([0])  # the pad slot is never handed out
    again = c.allocate(2)
    assert sorted(again.tolist()) == [1, 4]
    assert c.state[1].eq(0).all() and c.cursors[1].eq(0).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_k_heads=3), ValueError, "num_k_heads"),
        (dict(num_v_heads=0), ValueError, "num_v_heads"),
        (dict(head_k_dim=-128), ValueError, "head_k_dim"),
        (dict(head_k_dim=12), ValueError, "head_k_dim"),  # 16-byte lane chunks
        *BAD_WINDOW_DRAFTS,
        (dict(pad_slot_id=1.5), TypeError, "pad_slot_id"),
        (dict(pad_slot_id=4), ValueError, "pad_slot_id"),
    ],
)
def test_cache_rejects_bad_dims(kwargs, error, match):
    with pytest.raises(error, match=rf"^{match}: expected"):
        GDNDecodeCache(4, **{**QWEN4B, **kwargs}, device="cpu")


def test_cache_rejects_bad_slot_counts():
    with pytest.raises(ValueError, match="^num_slots"):
        GDNDecodeCache(0, **QWEN4B, device="cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(state_dtype=torch.float64), "state_dtype"),
        (dict(act_dtype=torch.int8), "act_dtype"),
        (dict(state_dtype="bfloat16"), "state_dtype"),
        (dict(act_dtype="fp8"), "act_dtype"),
    ],
)
def test_cache_rejects_bad_dtypes(kwargs, match):
    names = (
        r"\['bf16', 'e4m3', 'f16', 'f32', 'nvfp4'\]"
        if match == "state_dtype"
        else r"\['bf16', 'f16', 'f32'\]"
    )
    with pytest.raises(TypeError, match=rf"^{match}: expected one of {names}"):
        GDNDecodeCache(4, **QWEN4B, **kwargs, device="cpu")


# --- the float64 reference against HF transformers' Qwen3-Next decode --------------------------


@pytest.mark.parametrize("L", [1, 4])
def test_reference_matches_hf_qwen3_next_decode(L, assert_rel):
    """Teacher-forced: the same q, k, v, g, beta into HF's torch decode path and into ours.

    K != V and 3 value heads per key head, so a transposed state or a wrong head mapping shows.
    """
    from support import hf_gdn

    H, HV, K, V, batch, tokens = 2, 6, 32, 16, 3, 9
    case = hf_gdn.teacher_forced(H=H, HV=HV, K=K, V=V, batch=batch, tokens=tokens, seed=3)
    state = case["state0"].double()
    seqs = [GDNSequence(case["state0"][i], L=L, T=1) for i in range(batch)]
    for t in range(tokens):
        tok = {name: case[name][:, t] for name in ("q", "k", "v", "g", "beta")}
        out, state = gdn_step(state, **tok)
        # HF computes in fp32: agreement to ~1e-7, bounded here at 1e-5.
        assert_rel(out, case["out"][:, t], 1e-5, f"token {t}: conventional output vs HF")
        assert_rel(state, case["states"][t], 1e-5, f"token {t}: state vs HF")
        for i, seq in enumerate(seqs):
            o = seq.step(**{name: x[i] for name, x in tok.items()})
            assert_rel(o, case["out"][i, t], 1e-5, f"token {t} row {i}: replay output vs HF")
    for i, seq in enumerate(seqs):
        assert_rel(seq.materialize(), case["states"][-1][i], 1e-5, f"row {i}: replay state vs HF")
