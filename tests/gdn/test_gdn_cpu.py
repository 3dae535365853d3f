"""GDN on the CPU: specs and URIs, presets, cache bookkeeping, validation messages, the
PyTorch path the wrapper and the functional op run on CPU tensors, and the float64 reference
against HF transformers' Qwen3-Next decode path."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.aot_presets import every_preset

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    gdn_decode,
    gdn_layout,
    gdn_spec,
    mamba2_layout,
    plan_decode,
)
from replayssm_jit.core.dtypes import CHUNK_VALUES
from replayssm_jit.core.tiles import rows_tilings
from replayssm_jit.families.spec import spec_tilings
from replayssm_jit.jit import build
from replayssm_jit.jit.presets import preset_specs
from replayssm_jit.launch.policy import choose_launch
from replayssm_jit.reference import GDNSequence, gdn_step

PRESETS = every_preset()

TEMPLATE = build.template_root() / "gdn" / "decode.cu.jinja"
needs_template = pytest.mark.skipif(
    not TEMPLATE.exists(), reason=f"GDN template {TEMPLATE} not written yet"
)

pytestmark = pytest.mark.usefixtures("no_launch_env")

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


# --- wrapper and op validation on CPU tensors ---------------------------------------------------


def cpu_setup(*, gates_in_kernel=True, batch=2, mode="replay", act=torch.bfloat16, **wrapper):
    c = GDNDecodeCache(6, **QWEN4B, window=4, act_dtype=act, device="cpu")
    w = GDNDecodeWrapper(c, mode=mode, **wrapper)
    spec = w.plan(batch, gates_in_kernel=gates_in_kernel)
    slots = c.allocate(batch)
    if gates_in_kernel:
        gates = dict(a=torch.randn(batch, 32), b=torch.randn(batch, 32))
        gates.update(A_log=torch.zeros(32), dt_bias=torch.zeros(32))
    else:
        gates = dict(g=-torch.rand(batch, 32), beta=torch.rand(batch, 32))
    args = dict(
        q=torch.randn(batch, 16, 128).to(act),
        k=torch.randn(batch, 16, 128).to(act),
        v=torch.randn(batch, 32, 128).to(act),
        slot_indices=slots,
        out=None,
        **gates,
    )
    return c, w, spec, args


def call(w, args, **override):
    a = {**args, **override}
    q, k, v, slots = (a.pop(name) for name in ("q", "k", "v", "slot_indices"))
    return w.run(q, k, v, slots, **a)


def snapshot(c):
    return {name: t.clone() for name, t in c.tensors.items()}


def unchanged(c, before):
    return all(torch.equal(c.tensors[name], t) for name, t in before.items())


def test_plan_builds_the_expected_spec(jit_cache):
    c, w, spec, _ = cpu_setup()
    assert spec.uri == "gdn_k128_v128_vph2_L4_T1_act-bf16_state-f32_gates_in_kernel_qk_l2norm"
    assert w.spec == spec and w.batch_size == 2
    # on CPU tensors: the PyTorch path, nothing compiled or loaded, no tile and no workspace
    plan = w.decode_plan
    assert plan.backend == "cpu" and w.kernel == plan.kernel == "per-item" and plan.module is None
    assert plan.rows_per_cta == 0 and plan.flag_bits == 0 and plan.workspace_floats == 0
    assert not build._LOADED and not jit_cache.exists()
    assert w.decode_plan.family_options["scale"] == 128**-0.5
    # the tile the CUDA plan of this spec would take is one the module compiles
    tile = choose_launch(spec, 2, 32, 132, replay=True).rows_per_cta
    assert tile in [r for r, _ in spec_tilings(spec)]
    spec = w.plan(4, use_qk_l2norm=False, gates_in_kernel=False, scale=0.5)
    assert spec.flags == () and w.decode_plan.family_options["scale"] == 0.5 and w.batch_size == 4
    conv = GDNDecodeWrapper(c, mode="conventional")
    assert conv.plan(2).window == 1 and conv.kernel == "conventional"  # no records held


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=2.0), TypeError, "batch_size"),
        (dict(scale=math.nan), ValueError, "scale"),
        (dict(scale="0.1"), TypeError, "scale"),
        (dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm"),
        (dict(stochastic_rounding=True), ValueError, "flags: 'sr'"),  # fp32 state
        (dict(seed=1.5), TypeError, "seed"),
    ],
)
def test_plan_rejects_bad_arguments(kwargs, error, match):
    c = GDNDecodeCache(4, **QWEN4B, device="cpu")
    w = GDNDecodeWrapper(c)
    kwargs = {"batch_size": 2, **kwargs}
    with pytest.raises(error, match=rf"^{match}"):
        w.plan(kwargs.pop("batch_size"), **kwargs)
    assert w.spec is None and w.batch_size == 0  # nothing planned


def test_run_before_plan():
    c = GDNDecodeCache(4, **QWEN4B, device="cpu")
    with pytest.raises(RuntimeError, match="plan"):
        GDNDecodeWrapper(c).run(*[torch.zeros(1)] * 4)


def test_wrapper_arguments_are_checked():
    c = GDNDecodeCache(4, **QWEN4B, device="cpu")
    with pytest.raises(ValueError, match="^mode"):
        GDNDecodeWrapper(c, mode="chunked")
    with pytest.raises(TypeError, match="^check_slot_values: expected a bool"):
        GDNDecodeWrapper(c, check_slot_values=None)
    with pytest.raises(TypeError, match="^use_cuda_graph: expected a bool"):
        GDNDecodeWrapper(c, use_cuda_graph=1)


def _bad_cases(batch):
    bf, f32 = torch.bfloat16, torch.float32
    misaligned = torch.zeros(batch, 16, 136, dtype=bf)[..., 1:129]
    return [
        # (override, error, argument named first in the message)
        (dict(q=torch.randn(batch + 1, 16, 128).to(bf)), ValueError, "q"),  # batch
        (dict(slot_indices=torch.tensor([1, 99], dtype=torch.int32)), ValueError, "slot_indices"),
        (dict(slot_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "slot_indices"),
        (dict(slot_indices=torch.tensor([1, 2])), TypeError, "slot_indices"),
        (dict(slot_indices=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, "slot_indices"),
        (dict(q=torch.randn(batch, 16, 128)), TypeError, "q"),
        (dict(q=torch.randn(batch, 8, 128).to(bf)), ValueError, "q"),
        (dict(k=torch.randn(batch, 16, 64).to(bf)), ValueError, "k"),
        (dict(k=torch.randn(batch, 16, 128).to(torch.float16)), TypeError, "k"),
        (dict(v=torch.randn(batch, 16, 128).to(bf)), ValueError, "v"),
        (dict(v=torch.randn(batch, 32, 128)), TypeError, "v"),
        (dict(a=torch.randn(batch, 32).to(bf)), TypeError, "a"),
        (dict(a=torch.randn(batch, 16)), ValueError, "a"),
        (dict(b=torch.randn(batch, 32, dtype=torch.float64)), TypeError, "b"),
        (dict(b=None), ValueError, "b"),
        (dict(A_log=None), ValueError, "A_log"),
        (dict(dt_bias=None), ValueError, "dt_bias"),
        (dict(A_log=torch.zeros(16)), ValueError, "A_log"),
        (dict(dt_bias=torch.zeros(32, dtype=bf)), TypeError, "dt_bias"),
        (dict(g=torch.zeros(batch, 32)), ValueError, "g"),  # planned gates_in_kernel=True
        (dict(out=torch.empty(batch, 32, 128, dtype=f32)), TypeError, "out"),
        (dict(out=torch.empty(batch, 128, 32, dtype=bf).transpose(1, 2)), ValueError, "out"),
        (dict(q=torch.randn(batch, 128, 16).to(bf).transpose(1, 2)), ValueError, "q"),
        (dict(v=torch.randn(batch, 32, 130).to(bf)[..., :128]), ValueError, "v"),  # row stride
        (dict(q=misaligned), ValueError, "q"),  # 16-byte rows
        (dict(seed=1.5), TypeError, "seed"),
        (dict(seed=torch.zeros(2, dtype=torch.int64)), ValueError, "seed"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_cases(2))))
def test_run_names_the_bad_argument(index):
    c, w, _, args = cpu_setup()
    override, error, name = _bad_cases(2)[index]
    before = snapshot(c)
    with pytest.raises(error, match=rf"^{name}: expected"):
        call(w, args, **override)
    assert unchanged(c, before)


def test_run_messages_spell_expected_and_actual():
    _, w, _, args = cpu_setup()
    with pytest.raises(ValueError, match=r"^k: expected shape \[2, 16, 128\], got \[2, 16, 64\]$"):
        call(w, args, k=args["k"][..., :64].contiguous())
    with pytest.raises(
        ValueError,
        match=r"^A_log: expected a tensor \(plan\(\) had gates_in_kernel=True: pass a, b, A_log, "
        r"dt_bias\), got None$",
    ):
        call(w, args, A_log=None)
    with pytest.raises(TypeError, match=r"^a: expected dtype torch.float32, got torch.bfloat16$"):
        call(w, args, a=args["a"].to(torch.bfloat16))
    with pytest.raises(
        ValueError, match=r"^slot_indices: expected values in \[0, 6\) or pad_slot_id=-1, got 99$"
    ):
        call(w, args, slot_indices=torch.tensor([1, 99], dtype=torch.int32))


def test_precomputed_gates_take_no_gate_parameters():
    c, w, _, args = cpu_setup(gates_in_kernel=False)
    before = snapshot(c)
    with pytest.raises(
        ValueError,
        match=r"^A_log: expected None \(plan\(\) had gates_in_kernel=False: pass g, beta\)",
    ):
        call(w, args, A_log=torch.zeros(32), dt_bias=torch.zeros(32))
    with pytest.raises(ValueError, match=r"^a: expected None"):
        call(w, args, a=torch.zeros(2, 32))
    with pytest.raises(ValueError, match=r"^g: expected shape \[2, 32\], got \[2, 31\]"):
        call(w, args, g=torch.zeros(2, 31))
    with pytest.raises(ValueError, match=r"^beta: expected a tensor"):
        call(w, args, beta=None)
    assert unchanged(c, before)
    out = call(w, args)  # every shape and dtype is right: the step runs
    assert out.shape == (2, 32, 128) and out.dtype == torch.bfloat16 and out.isfinite().all()


@pytest.mark.parametrize("mode", ["replay", "conventional"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_valid_cpu_arguments_run(mode, act):
    """Valid CPU arguments run the PyTorch path: finite outputs of the right shape, with any
    batch/head strides (unit stride in the last dim, 16-byte rows) and a pad row."""
    c, w, _, args = cpu_setup(mode=mode, act=act)
    out = call(w, args)
    assert out.shape == (2, 32, 128) and out.dtype == act and out.isfinite().all()
    assert out.abs().sum() > 0
    before = snapshot(c)
    strided = dict(
        q=torch.randn(16, 2, 128).to(act).transpose(0, 1),
        v=torch.randn(2, 64, 128).to(act)[:, ::2],
        out=torch.full((2, 32, 128), float("nan"), dtype=act),
        slot_indices=torch.tensor([-1, 1], dtype=torch.int32),
        a=torch.randn(2, 64)[:, 32:],  # b, a split from one projection
        b=torch.randn(32, 2).t(),
    )
    result = call(w, args, **strided)
    assert result is strided["out"] and result.isfinite().all()
    assert result[0].eq(0).all() and result[1].abs().sum() > 0  # the pad row's output is 0
    # only slot 1 moved: its cursor in replay mode (a record held), its state in conventional
    for name, t in c.tensors.items():
        assert torch.equal(t[[0, 2, 3, 4, 5]], before[name][[0, 2, 3, 4, 5]]), name
    if mode == "replay":
        assert c.records_held([0, 1]).tolist() == [1, 2]
    else:
        assert not torch.equal(c.state[1], before["state"][1])


def test_slot_value_check_can_be_skipped_but_not_the_layout_checks():
    """GDNDecodeWrapper takes check_slot_values as Mamba2DecodeWrapper does: the host read of
    the slot values is skipped (repeated ids are then the caller's responsibility), never the
    shape, dtype and device checks."""
    for kwargs in (dict(check_slot_values=False), dict(use_cuda_graph=True)):
        _, w, _, args = cpu_setup(**kwargs)
        assert w.decode_plan.check_slot_values is False
        # The CPU path reads its slot ids anyway (no sync to save): bad ones still raise.
        with pytest.raises(ValueError, match="^slot_indices: expected distinct slots"):
            call(w, args, slot_indices=torch.tensor([1, 1], dtype=torch.int32))
        with pytest.raises(TypeError, match="^slot_indices: expected dtype torch.int32"):
            call(w, args, slot_indices=torch.tensor([0, 1]))
    _, w, _, args = cpu_setup()
    assert w.decode_plan.check_slot_values is True
    with pytest.raises(ValueError, match="^slot_indices: expected distinct slots"):
        call(w, args, slot_indices=torch.tensor([1, 1], dtype=torch.int32))


def test_graph_mode_writes_a_buffer_fixed_at_plan():
    _, w, _, args = cpu_setup(use_cuda_graph=True)
    first = call(w, args)
    assert call(w, args) is first and first.shape == (2, 32, 128)


def test_functional_op_checks_the_state_pool():
    """gdn_decode on caller-owned tensors (the layout's): the slot pools are checked, each slot's
    block contiguous and 16-byte aligned; padded slots are fine."""
    layout = gdn_layout(
        num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=32, window=4, act_dtype="f32"
    )
    plan = plan_decode(layout, 3, device="cpu")
    assert plan.spec == gdn_spec(
        head_k_dim=64, head_v_dim=32, value_heads_per_key_head=2, window=4, act_dtype="f32"
    )
    tensors = layout.allocate(5, "cpu")
    args = dict(
        q=torch.randn(3, 2, 64),
        k=torch.randn(3, 2, 64),
        v=torch.randn(3, 4, 32),
        a=torch.randn(3, 4),
        b=torch.randn(3, 4),
        A_log=torch.zeros(4),
        dt_bias=torch.zeros(4),
        out=torch.empty(3, 4, 32),
        slot_indices=torch.tensor([0, 2, 4], dtype=torch.int32),
        **{k: v for k, v in tensors.items() if k != "state"},
    )
    with pytest.raises(ValueError, match=r"^state: expected shape \[\*, 4, 32, 64\]"):
        gdn_decode(plan, state=torch.zeros(5, 4, 64, 32), **args)
    with pytest.raises(TypeError, match="^state: expected dtype torch.float32"):
        gdn_decode(plan, state=torch.zeros(5, 4, 32, 64, dtype=torch.bfloat16), **args)
    transposed = torch.zeros(5, 4, 64, 32).transpose(2, 3)
    with pytest.raises(
        ValueError, match=r"^state: expected 16-byte aligned slots with contiguous \[4, 32, 64\]"
    ):
        gdn_decode(plan, state=transposed, **args)
    odd_slots = torch.zeros(5 * 4 * 32 * 64 + 5).as_strided(
        (5, 4, 32, 64), (4 * 32 * 64 + 1, 32 * 64, 64, 1)
    )
    with pytest.raises(ValueError, match="^state: expected 16-byte aligned slots"):
        gdn_decode(plan, state=odd_slots, **args)
    with pytest.raises(ValueError, match=r"^rec_u: expected 4 slots \(as state\), got 5"):
        gdn_decode(plan, state=torch.zeros(4, 4, 32, 64), **args)
    with pytest.raises(TypeError, match=r"^rec_g: expected a torch.Tensor, got NoneType"):
        gdn_decode(plan, state=tensors["state"], **{**args, "rec_g": None})
    padded_slots = torch.zeros(5, 4 * 32 * 64 + 4)[:, : 4 * 32 * 64].view(5, 4, 32, 64)
    out = gdn_decode(plan, state=padded_slots, **args)  # padded slots are fine
    assert out is args["out"] and out.isfinite().all()
    m2 = mamba2_layout(num_heads=4, headdim=8, dstate=16, ngroups=2)
    with pytest.raises(ValueError, match="^plan: expected a gdn plan, got a mamba2 plan"):
        gdn_decode(plan_decode(m2, 3, device="cpu"), state=padded_slots, **args)


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
