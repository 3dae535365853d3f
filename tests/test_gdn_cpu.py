"""GDN on the CPU: specs and URIs, presets, cache bookkeeping, validation messages (shapes and
dtypes are checked before the device, so CPU tensors reach them), and the float64 reference
against HF transformers' Qwen3-Next decode path."""

from __future__ import annotations

import json
import math

import pytest
import torch

from replayssm_jit import GDNDecodeCache, GDNDecodeWrapper, gdn_spec
from replayssm_jit.jit import build
from replayssm_jit.jit.aot import PRESETS, build_aot, preset_specs
from replayssm_jit.ops import gdn as ops
from replayssm_jit.ops import tiling
from replayssm_jit.reference import GDNSequence, gdn_step
from replayssm_jit.spec import DTYPE_BYTES, gdn_tilings, rows_tilings
from replayssm_jit.wrappers import base

TEMPLATE = build.template_root() / "gdn" / "decode.cu.jinja"
needs_template = pytest.mark.skipif(
    not TEMPLATE.exists(), reason=f"GDN template {TEMPLATE} not written yet"
)

QWEN4B = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)


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


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=0), ValueError, "window"),
        (dict(drafts=0), ValueError, "drafts"),
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
        (dict(value_heads_per_key_head=2.0), ValueError, "value_heads_per_key_head"),
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
    assert ctx["tilings"] == rows_tilings(V, K, DTYPE_BYTES[state]) == gdn_tilings(V, K, state)
    assert ctx["tilings"] and all(
        V % rows == 0 and rows % warps == 0 for rows, warps in ctx["tilings"]
    )
    assert ctx["dims"] == {"k": K, "v": V, "vph": 2} and ctx["capacity"] == 17
    assert ctx["flags"] == {"gates_in_kernel", "qk_l2norm"}


def test_qwen_tilings():
    for state in ("f32", "bf16"):
        tilings = gdn_tilings(128, 128, state)
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
    for spec in preset_specs([preset]):
        if spec.family != "gdn":
            continue
        text = build.render(spec)
        assert spec.uri in text
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(replay_step" in text
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(conventional_step" in text
        assert "{{" not in text and "{%" not in text


@needs_template
@pytest.mark.nvcc
def test_gdn_aot_build_exports_both_steps(jit_cache, tmp_path, monkeypatch):
    """nvcc builds one sm_90a GDN module; with JIT disabled the loader finds and loads it."""
    spec = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=16)
    aot = tmp_path / "aot"
    (so_path,) = build_aot([spec], aot, jobs=1, archs=["9.0a"])
    assert so_path == aot / spec.uri / f"{spec.uri}.so"
    manifest = json.loads((aot / spec.uri / "manifest.json").read_text())
    assert manifest["uri"] == spec.uri
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    assert build.find_prebuilt(spec) == so_path
    module = build.load_module(spec)  # loading needs only the CUDA runtime library, not a GPU
    assert callable(module.replay_step) and callable(module.conventional_step)


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
    assert c.rings["u"].shape == (6, 6, 6, 16) and c.rings["u"].dtype == torch.float32
    assert c.rings["k"].shape == (6, 2, 6, 32) and c.rings["k"].dtype == torch.float16
    assert c.rings["g"].shape == (6, 6, 6) and c.rings["g"].dtype == torch.float32
    assert c.cursors.shape == (6, 4) and c.cursors.dtype == torch.int32
    assert (c.window, c.drafts, c.act_dtype) == (4, 2, torch.float16)


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
    "kwargs, match",
    [
        (dict(num_k_heads=3), "num_k_heads"),
        (dict(num_v_heads=0), "num_v_heads"),
        (dict(head_k_dim=-128), "head_k_dim"),
        (dict(window=0), "window"),
        (dict(drafts=0), "drafts"),
    ],
)
def test_cache_rejects_bad_dims(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GDNDecodeCache(4, **{**QWEN4B, **kwargs}, device="cpu")
    with pytest.raises(ValueError, match="num_slots"):
        GDNDecodeCache(0, **QWEN4B, device="cpu")


def test_cache_rejects_bad_dtypes():
    with pytest.raises(TypeError, match="state_dtype"):
        GDNDecodeCache(4, **QWEN4B, state_dtype=torch.float64, device="cpu")
    with pytest.raises(TypeError, match="act_dtype"):
        GDNDecodeCache(4, **QWEN4B, act_dtype=torch.int8, device="cpu")


# --- wrapper and op validation on CPU tensors ---------------------------------------------------


@pytest.fixture
def no_module(monkeypatch):
    """plan() without compiling or loading anything (the CPU checks never reach a launch)."""
    loaded = []
    monkeypatch.setattr(base, "load_module", lambda spec: loaded.append(spec) or object())
    return loaded


def cpu_setup(*, gates_in_kernel=True, batch=2, mode="replay", act=torch.bfloat16):
    c = GDNDecodeCache(6, **QWEN4B, window=4, act_dtype=act, device="cpu")
    w = GDNDecodeWrapper(c, mode=mode)
    spec = w.plan(batch, gates_in_kernel=gates_in_kernel)
    slots = c.allocate(batch)
    args = dict(
        q=torch.randn(batch, 16, 128).to(act),
        k=torch.randn(batch, 16, 128).to(act),
        v=torch.randn(batch, 32, 128).to(act),
        gate_a=torch.randn(batch, 32),
        gate_b=torch.randn(batch, 32),
        slot_indices=slots,
        A_log=torch.zeros(32) if gates_in_kernel else None,
        dt_bias=torch.zeros(32) if gates_in_kernel else None,
        out=None,
    )
    return c, w, spec, args


def call(w, args, **override):
    a = {**args, **override}
    return w.run(
        a["q"],
        a["k"],
        a["v"],
        a["gate_a"],
        a["gate_b"],
        a["slot_indices"],
        A_log=a["A_log"],
        dt_bias=a["dt_bias"],
        out=a["out"],
    )


def test_plan_builds_the_expected_spec(no_module):
    c, w, spec, _ = cpu_setup()
    assert spec.uri == "gdn_k128_v128_vph2_L4_T1_act-bf16_state-f32_gates_in_kernel_qk_l2norm"
    assert no_module == [spec] and w.spec == spec and w.batch_size == 2
    assert w.scale == 128**-0.5 and w.rows_per_cta in [r for r, _ in gdn_tilings(128, 128, "f32")]
    spec = w.plan(4, use_qk_l2norm=False, gates_in_kernel=False, scale=0.5)
    assert spec.flags == () and w.scale == 0.5 and w.batch_size == 4
    conv = GDNDecodeWrapper(c, mode="conventional")
    assert conv.plan(2).window == 1  # conventional kernels hold no records


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=2.0), ValueError, "batch_size"),
        (dict(scale=math.nan), ValueError, "scale"),
        (dict(scale="0.1"), ValueError, "scale"),
        (dict(stochastic_rounding=True), ValueError, "sr"),  # fp32 state
    ],
)
def test_plan_rejects_bad_arguments(no_module, kwargs, error, match):
    c = GDNDecodeCache(4, **QWEN4B, device="cpu")
    w = GDNDecodeWrapper(c)
    kwargs = {"batch_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        w.plan(kwargs.pop("batch_size"), **kwargs)
    assert no_module == []


def test_run_before_plan():
    c = GDNDecodeCache(4, **QWEN4B, device="cpu")
    with pytest.raises(RuntimeError, match="plan"):
        GDNDecodeWrapper(c).run(*[torch.zeros(1)] * 6)


def test_wrapper_mode_is_checked():
    c = GDNDecodeCache(4, **QWEN4B, device="cpu")
    with pytest.raises(ValueError, match="mode"):
        GDNDecodeWrapper(c, mode="chunked")


def _bad_cases(batch):
    bf, f32 = torch.bfloat16, torch.float32
    misaligned = torch.zeros(batch, 16, 136, dtype=bf)[..., 1:129]
    return [
        # (override, error, argument named first in the message)
        (dict(q=torch.randn(batch + 1, 16, 128).to(bf)), ValueError, "batch"),
        (dict(slot_indices=torch.tensor([1, 99], dtype=torch.int32)), ValueError, "slot_indices"),
        (dict(slot_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "slot_indices"),
        (dict(slot_indices=torch.tensor([1, 2])), TypeError, "slot_indices"),
        (dict(q=torch.randn(batch, 16, 128)), TypeError, "q"),
        (dict(q=torch.randn(batch, 8, 128).to(bf)), ValueError, "q"),
        (dict(k=torch.randn(batch, 16, 64).to(bf)), ValueError, "k"),
        (dict(k=torch.randn(batch, 16, 128).to(torch.float16)), TypeError, "k"),
        (dict(v=torch.randn(batch, 16, 128).to(bf)), ValueError, "v"),
        (dict(v=torch.randn(batch, 32, 128)), TypeError, "v"),
        (dict(gate_a=torch.randn(batch, 32).to(bf)), TypeError, "gate_a"),
        (dict(gate_a=torch.randn(batch, 16)), ValueError, "gate_a"),
        (dict(gate_b=torch.randn(batch, 32, dtype=torch.float64)), TypeError, "gate_b"),
        (dict(A_log=None), ValueError, "A_log"),
        (dict(dt_bias=None), ValueError, "dt_bias"),
        (dict(A_log=torch.zeros(16)), ValueError, "A_log"),
        (dict(dt_bias=torch.zeros(32, dtype=bf)), TypeError, "dt_bias"),
        (dict(out=torch.empty(batch, 32, 128, dtype=f32)), TypeError, "out"),
        (dict(out=torch.empty(batch, 128, 32, dtype=bf).transpose(1, 2)), ValueError, "out"),
        (dict(q=torch.randn(batch, 128, 16).to(bf).transpose(1, 2)), ValueError, "q"),
        (dict(v=torch.randn(batch, 32, 130).to(bf)[..., :128]), ValueError, "v"),  # row stride
        (dict(q=misaligned), ValueError, "q"),  # 16-byte rows
    ]


@pytest.mark.parametrize("index", range(len(_bad_cases(2))))
def test_run_names_the_bad_argument(no_module, index):
    c, w, _, args = cpu_setup()
    override, error, name = _bad_cases(2)[index]
    before = (c.state.clone(), c.cursors.clone(), {k: v.clone() for k, v in c.rings.items()})
    with pytest.raises(error, match=rf"^{name}\b"):
        call(w, args, **override)
    assert torch.equal(c.state, before[0]) and torch.equal(c.cursors, before[1])
    assert all(torch.equal(c.rings[k], v) for k, v in before[2].items())


def test_run_messages_spell_expected_and_actual(no_module):
    _, w, _, args = cpu_setup()
    with pytest.raises(ValueError, match=r"^k: expected shape \[2, 16, 128\], got \[2, 16, 64\]$"):
        call(w, args, k=args["k"][..., :64].contiguous())
    with pytest.raises(
        ValueError,
        match=r"^A_log: expected a tensor \(plan\(\) had gates_in_kernel=True\), got None$",
    ):
        call(w, args, A_log=None)
    with pytest.raises(
        TypeError, match=r"^gate_a \(a\): expected dtype torch.float32, got torch.bfloat16$"
    ):
        call(w, args, gate_a=args["gate_a"].to(torch.bfloat16))


def test_precomputed_gates_take_no_gate_parameters(no_module):
    _, w, _, args = cpu_setup(gates_in_kernel=False)
    with pytest.raises(
        ValueError, match=r"^A_log: expected None \(plan\(\) had gates_in_kernel=False\)"
    ):
        call(w, args, A_log=torch.zeros(32), dt_bias=torch.zeros(32))
    with pytest.raises(ValueError, match=r"^gate_a \(g\): expected shape"):
        call(w, args, gate_a=torch.zeros(2, 31))
    with pytest.raises(ValueError, match=r"^state: expected a CUDA tensor"):
        call(w, args)  # every shape and dtype is right: only the device is left


@pytest.mark.parametrize("mode", ["replay", "conventional"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_valid_cpu_arguments_fail_only_on_the_device(no_module, mode, act):
    _, w, _, args = cpu_setup(mode=mode, act=act)
    with pytest.raises(ValueError, match=r"^state: expected a CUDA tensor, got device cpu"):
        call(w, args)
    strided = dict(  # any batch/head strides, unit stride in the last dim, 16-byte rows
        q=torch.randn(16, 2, 128).to(act).transpose(0, 1),
        v=torch.randn(2, 64, 128).to(act)[:, ::2],
        out=torch.empty(2, 32, 128, dtype=act),
        slot_indices=torch.tensor([-1, 1], dtype=torch.int32),
        gate_a=torch.randn(2, 64)[:, 32:],  # b, a split from one projection
        gate_b=torch.randn(32, 2).t(),
    )
    with pytest.raises(ValueError, match=r"^state: expected a CUDA tensor"):
        call(w, args, **strided)


def test_validate_step_checks_the_state_pool():
    spec = gdn_spec(head_k_dim=64, head_v_dim=32, value_heads_per_key_head=2, act_dtype="f32")
    dims = ops.dims_of(spec, num_v_heads=4)
    assert dims == ops.GDNDims(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=32)
    args = dict(
        q=torch.randn(3, 2, 64),
        k=torch.randn(3, 2, 64),
        v=torch.randn(3, 4, 32),
        gate_a=torch.randn(3, 4),
        gate_b=torch.randn(3, 4),
        A_log=torch.zeros(4),
        dt_bias=torch.zeros(4),
        out=torch.empty(3, 4, 32),
    )
    with pytest.raises(ValueError, match=r"^state: expected shape \[\*, 4, 32, 64\]"):
        ops.validate_step(spec, dims, state=torch.zeros(5, 4, 64, 32), **args)
    with pytest.raises(TypeError, match="^state: expected dtype torch.float32"):
        ops.validate_step(spec, dims, state=torch.zeros(5, 4, 32, 64, dtype=torch.bfloat16), **args)
    transposed = torch.zeros(5, 4, 64, 32).transpose(2, 3)
    with pytest.raises(
        ValueError, match=r"^state: expected 16-byte aligned slots with contiguous \[HV, V, K\]"
    ):
        ops.validate_step(spec, dims, state=transposed, **args)
    odd_slots = torch.zeros(5 * 4 * 32 * 64 + 5).as_strided(
        (5, 4, 32, 64), (4 * 32 * 64 + 1, 32 * 64, 64, 1)
    )
    with pytest.raises(ValueError, match="^state: expected 16-byte aligned slots"):
        ops.validate_step(spec, dims, state=odd_slots, **args)
    padded_slots = torch.zeros(5, 4 * 32 * 64 + 4)[:, : 4 * 32 * 64].view(5, 4, 32, 64)
    with pytest.raises(ValueError, match="^state: expected a CUDA tensor"):
        ops.validate_step(spec, dims, state=padded_slots, **args)  # padded slots are fine


def test_rows_per_cta_override(monkeypatch):
    spec = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2)
    cpu = torch.device("cpu")
    tilings = gdn_tilings(128, 128, "f32")
    options = [r for r, _ in tilings]
    four_warp = [r for r, w in tilings if w == 4]  # the heuristic prefers 4-warp tiles
    assert (
        tiling.choose_launch(spec, 256, 32, cpu, replay=False)[0] == four_warp[0]
    )  # plenty of CTAs: big tiles
    assert (
        tiling.choose_launch(spec, 1, 32, cpu, replay=False)[0] == four_warp[-1]
    )  # one sequence: split rows
    monkeypatch.setenv(ops.ROWS_ENV, str(options[1]))
    assert tiling.choose_launch(spec, 256, 32, cpu, replay=False)[0] == options[1]
    monkeypatch.setenv(ops.ROWS_ENV, "24")
    with pytest.raises(ValueError, match=ops.ROWS_ENV):
        tiling.choose_launch(spec, 256, 32, cpu, replay=False)[0]


# --- the float64 reference against HF transformers' Qwen3-Next decode --------------------------


@pytest.mark.parametrize("L", [1, 4])
def test_reference_matches_hf_qwen3_next_decode(L, assert_rel):
    """Teacher-forced: the same q, k, v, g, beta into HF's torch decode path and into ours.

    K != V and 3 value heads per key head, so a transposed state or a wrong head mapping shows.
    """
    import hf_gdn

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
