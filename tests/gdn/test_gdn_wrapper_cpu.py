"""GDN's wrapper and functional op on CPU tensors: plans, the validation messages of run() and
gdn_decode, and the PyTorch path they run."""

from __future__ import annotations

import math

import pytest
import torch
from support.gdn_shapes import QWEN4B

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    gdn_decode,
    gdn_layout,
    gdn_spec,
    mamba2_layout,
    plan_decode,
)
from replayssm_jit.families.spec import spec_tilings
from replayssm_jit.jit import build
from replayssm_jit.launch.policy import choose_launch

pytestmark = pytest.mark.usefixtures("no_launch_env")

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
