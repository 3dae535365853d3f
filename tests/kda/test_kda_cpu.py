"""Kimi Delta Attention on the CPU: specs and URIs, the layout, plan options, validation messages,
and the functional op and wrapper (the PyTorch path) against the float64 reference. The step's
semantics over flush cycles, pad rows and unnamed slots are in
tests/protocol/test_cpu_path_schedules.py (KDACase)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from support.aot_presets import PRESETS

from replayssm_jit import (
    KDADecodeCache,
    KDADecodeWrapper,
    LaunchConfig,
    gdn_layout,
    gdn_spec,
    kda_decode,
    kda_layout,
    kda_spec,
    plan_decode,
)
from replayssm_jit.jit import build
from replayssm_jit.jit.presets import preset_specs
from replayssm_jit.launch.policy import choose_launch, choose_verify_kernel
from replayssm_jit.ops import plan_handle
from replayssm_jit.reference import KDASequence, kda_gates

pytestmark = pytest.mark.usefixtures("no_launch_env")

KIMI = dict(num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=64)  # GVA, HV = 2H


def test_uri_and_layout():
    spec = kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1)
    assert spec.uri == "kda_k128_v128_vph1_L16_T1_act-bf16_state-f32_gates_in_kernel_qk_l2norm"
    ctx = spec.template_context()
    assert ctx["decay_per_channel"] and not ctx["verify"]
    gdn = gdn_layout(**KIMI, window=8).tensors()
    kda = kda_layout(**KIMI, window=8).tensors()
    assert [t.name for t in kda] == [t.name for t in gdn]
    shapes = {t.name: t.per_slot_shape for t in kda}
    assert shapes["rec_g"] == (8, 9, 128)  # [HV, CAP, K]: a log-decay per key channel
    assert all(t.per_slot_shape == shapes[t.name] for t in gdn if t.name != "rec_g")
    # The extra bytes per slot over GDN's: CAP x HV x (K - 1) floats of g.
    extra = kda_layout(**KIMI).bytes_per_slot() - gdn_layout(**KIMI).bytes_per_slot()
    assert extra == 17 * 8 * 127 * 4


@pytest.mark.parametrize("preset", ["kda-tests", "sanitizer"])
def test_preset_kda_specs_render(preset):
    """Every KDA spec of the presets renders GDN's template with the per-channel decay, the
    safe gate's lower bound in every binding (the two steps, and verify and snapshot with
    drafts), and the split step with per-channel decays."""
    specs = [s for s in preset_specs([preset], PRESETS) if s.family == "kda"]
    assert specs and any(s.drafts == 1 for s in specs)
    for spec in specs:
        text = build.render(spec)
        assert spec.uri in text and "{{" not in text and "{%" not in text
        assert "constexpr bool kPerChannel = true;" in text
        # (the binding's parameter lists are rendered and wrapped: count across line breaks)
        taken = re.findall(r"double lower_bound,\s+TensorView out", text)
        assert len(taken) == (2 if spec.drafts == 1 else 4)
        assert '#include "gdn/split_kernel.cuh"' in text
        assert "WARPS, kPerChannel," in text and "kPerChannel, read_t, kReadSR>;" in text


def test_kda_launches_as_gdn_and_verifies_per_item():
    spec = kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1)
    drafts = kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1, drafts=4)
    assert kda_layout(**KIMI, drafts=4).drafts == 4
    for batch in (1, 64, 256, 4096):  # no split verify for a decay per key channel
        for kernel in ("auto", "split"):
            config = LaunchConfig(kernel=kernel)
            assert choose_verify_kernel(drafts, batch, 32, 132, config) == "per-item"
    text = build.render(drafts)
    assert '#include "gdn/verify_kernel.cuh"' in text and "verify_split_kernel" not in text
    taken = re.findall(r"double lower_bound,\s+TensorView out", text)
    assert len(taken) == 4  # and verify, snapshot
    gdn = gdn_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1)
    for batch in (1, 5, 64, 256, 4096):  # the same policy as GDN's, split step included
        ours, theirs = (choose_launch(s, batch, 32, 132, replay=True) for s in (spec, gdn))
        assert (ours.kernel, ours.rows_per_cta, ours.flag_bits) == (
            theirs.kernel,
            theirs.rows_per_cta,
            theirs.flag_bits,
        )
    assert choose_launch(spec, 256, 32, 132, replay=True).kernel == "split"
    forced = choose_launch(spec, 5, 32, 132, replay=True, config=LaunchConfig(kernel="split"))
    assert forced.kernel == "split"


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(lower_bound=0.0), ValueError, r"lower_bound: expected a finite negative float, got 0.0"),
        (dict(lower_bound=math.inf), ValueError, "lower_bound: expected a finite negative"),
        (dict(lower_bound="-5"), TypeError, r"lower_bound: expected None or a float, got str"),
        (dict(lower_bound=True), TypeError, "lower_bound: expected None or a float"),
        (dict(lower_bound=-5.0, gates_in_kernel=False), ValueError,
         r"lower_bound: expected None with gates_in_kernel=False"),
        (dict(scale=math.nan), ValueError, "scale"),
        (dict(has_D=True), TypeError, r"plan\(\): expected options among"),
    ],
)  # fmt: skip
def test_plan_rejects_bad_options(options, error, match):
    with pytest.raises(error, match=rf"^{match}"):
        plan_decode(kda_layout(**KIMI), 2, device="cpu", **options)


def test_plan_options():
    layout = kda_layout(**KIMI)
    plan = plan_decode(layout, 2, device="cpu")
    assert plan.family_options == {"scale": 128**-0.5, "lower_bound": None}
    plan = plan_decode(layout, 2, device="cpu", lower_bound=-5, use_qk_l2norm=False)
    assert plan.family_options["lower_bound"] == -5.0 and plan.spec.flags == ("gates_in_kernel",)


# --- the functional op and the wrapper on CPU tensors --------------------------------------------


def cpu_setup(*, gates_in_kernel=True, batch=2, mode="replay", lower_bound=None):
    c = KDADecodeCache(6, **KIMI, window=4, act_dtype=torch.float32, device="cpu")
    w = KDADecodeWrapper(c, mode=mode)
    options = {} if lower_bound is None else {"lower_bound": lower_bound}
    w.plan(batch, gates_in_kernel=gates_in_kernel, **options)
    gen = torch.Generator().manual_seed(5)
    if gates_in_kernel:
        gates = dict(a=torch.randn(batch, 8, 128, generator=gen), b=torch.randn(batch, 8))
        gates.update(A_log=torch.rand(8, generator=gen) - 1.0, dt_bias=torch.randn(8 * 128))
    else:
        gates = dict(g=-torch.rand(batch, 8, 128, generator=gen), beta=torch.rand(batch, 8))
    args = dict(
        q=torch.randn(batch, 4, 128, generator=gen),
        k=torch.randn(batch, 4, 128, generator=gen),
        v=torch.randn(batch, 8, 64, generator=gen),
        slot_indices=torch.tensor([1, 3][:batch], dtype=torch.int32),
        **gates,
    )
    return c, w, args


def call(w, args, **override):
    a = {**args, **override}
    q, k, v, slots = (a.pop(name) for name in ("q", "k", "v", "slot_indices"))
    return w.run(q, k, v, slots, **a)


def _bad_cases(batch):
    f32 = torch.float32
    return [
        (dict(a=torch.randn(batch, 8)), ValueError, r"a: expected shape \[2, 8, 128\], got \[2, 8\]"),
        (dict(a=torch.randn(batch, 128, 8).transpose(1, 2)), ValueError, "a: expected"),  # K stride
        (dict(a=torch.randn(batch, 8, 128).to(torch.bfloat16)), TypeError,
         r"a: expected dtype torch.float32, got torch.bfloat16"),
        (dict(b=torch.randn(batch, 8, 128)), ValueError, r"b: expected shape \[2, 8\]"),
        (dict(dt_bias=torch.zeros(8)), ValueError, r"dt_bias: expected shape \[1024\], got \[8\]"),
        (dict(A_log=torch.zeros(8 * 128)), ValueError, r"A_log: expected shape \[8\], got \[1024\]"),
        (dict(A_log=None), ValueError, r"A_log: expected a tensor \(plan\(\) had gates_in_kernel"),
        (dict(g=torch.zeros(batch, 8, 128)), ValueError, "g: expected None"),
        (dict(k=torch.randn(batch, 4, 64)), ValueError, r"k: expected shape \[2, 4, 128\]"),
        (dict(v=torch.randn(batch, 8, 64, dtype=torch.float64)), TypeError, "v: expected dtype"),
        (dict(out=torch.empty(batch, 8, 64, dtype=torch.bfloat16)), TypeError, "out: expected"),
        (dict(slot_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "slot_indices"),
        (dict(q=torch.randn(batch, 4, 128, dtype=f32)[:1]), ValueError, "q: expected shape"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_bad_cases(2))))
def test_run_names_the_bad_argument(index):
    c, w, args = cpu_setup()
    override, error, match = _bad_cases(2)[index]
    before = {name: t.clone() for name, t in c.tensors.items()}
    with pytest.raises(error, match=rf"^{match}"):
        call(w, args, **override)
    assert all(torch.equal(c.tensors[n], t) for n, t in before.items())  # nothing touched


def test_precomputed_gates_are_per_channel():
    _, w, args = cpu_setup(gates_in_kernel=False)
    with pytest.raises(ValueError, match=r"^g: expected shape \[2, 8, 128\], got \[2, 8\]$"):
        call(w, args, g=torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"^dt_bias: expected None"):
        call(w, args, dt_bias=torch.zeros(8 * 128))
    assert call(w, args).isfinite().all()


def test_gdn_plan_is_refused_by_kda_decode():
    plan = plan_decode(gdn_layout(**KIMI), 2, device="cpu")
    with pytest.raises(ValueError, match=r"^plan: expected a kda plan, got a gdn plan$"):
        kda_decode(plan, state=None, q=None, k=None, v=None, slot_indices=None)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("mode", ["replay", "conventional"])
def test_wrapper_matches_the_reference(mode, lower_bound, jit_cache):
    """Nine steps through the wrapper (two flushes at window 4) against one float64 KDASequence
    per slot, from a random checkpoint; the pad row is 0 and unnamed slots keep their bits."""
    c, w, args = cpu_setup(mode=mode, batch=2, lower_bound=lower_bound)
    gen = torch.Generator().manual_seed(9)
    c.state.copy_(0.3 * torch.randn(c.state.shape, generator=gen))
    seqs = {s: KDASequence(c.state[s].double(), scale=128**-0.5, L=4 if mode == "replay" else 1)
            for s in (1, 3)}  # fmt: skip
    slots = torch.tensor([3, -1, 1], dtype=torch.int32)
    w.plan(3, **({} if lower_bound is None else {"lower_bound": lower_bound}))
    for step in range(9):
        before = {name: t.clone() for name, t in c.tensors.items()}
        a = torch.randn(3, 8, 128, generator=gen)
        b = torch.randn(3, 8, generator=gen)
        q, k = torch.randn(3, 4, 128, generator=gen), torch.randn(3, 4, 128, generator=gen)
        v = torch.randn(3, 8, 64, generator=gen)
        out = torch.full((3, 8, 64), math.nan)
        w.run(q, k, v, slots, a=a, b=b, A_log=args["A_log"], dt_bias=args["dt_bias"], out=out)
        g, beta = kda_gates(args["A_log"], a, args["dt_bias"], b, lower_bound)
        for row, s in ((0, 3), (2, 1)):
            want = seqs[s].step(q=q[row], k=k[row], v=v[row], g=g[row], beta=beta[row])
            err = float((out[row].double() - want).norm() / want.norm())
            assert err < 1e-5, f"step {step} row {row}: relative error {err:.2e}"
            if seqs[s].last_step_flushed or mode == "conventional":
                err = float((c.state[s].double() - seqs[s].checkpoint).norm()
                            / seqs[s].checkpoint.norm())  # fmt: skip
                assert err < 1e-5, f"step {step} state {s}: relative error {err:.2e}"
        assert out[1].eq(0).all()
        for name, t in c.tensors.items():
            for s in (0, 2, 4, 5):
                assert torch.equal(t[s], before[name][s]), f"step {step}: {name} of slot {s}"
    assert not build._LOADED and not jit_cache.exists()


def test_custom_op_matches_the_functional_op():
    """torch.ops.replayssm.kda_decode (for torch.compile) is kda_decode through a plan handle."""
    from replayssm_jit.ops import plan_handle, release_plan

    layout = kda_layout(**KIMI, window=4, act_dtype=torch.float32)
    plan = plan_decode(layout, 2, device="cpu")
    gen = torch.Generator().manual_seed(3)
    pools = []
    for _ in range(2):
        pool = layout.allocate(3, "cpu")
        pool["state"].copy_(0.3 * torch.randn(pool["state"].shape, generator=torch.Generator()))
        pools.append(pool)
    _, _, args = cpu_setup()
    args = {name: t for name, t in args.items() if name != "slot_indices"}
    slots = torch.tensor([2, 0], dtype=torch.int32)
    handle = plan_handle(plan)
    try:
        for _ in range(5):  # one flush at window 4
            out_op, out_fn = torch.empty(2, 8, 64), torch.empty(2, 8, 64)
            token = {**args, "v": torch.randn(2, 8, 64, generator=gen)}
            torch.ops.replayssm.kda_decode(handle, **pools[0], **token, slot_indices=slots,
                                           out=out_op)  # fmt: skip
            kda_decode(plan, **pools[1], **token, slot_indices=slots, out=out_fn)
            assert torch.equal(out_op, out_fn) and out_op.isfinite().all()
    finally:
        release_plan(handle)
    assert all(torch.equal(pools[0][n], pools[1][n]) for n in pools[0])


def test_kda_custom_ops_pass_opcheck():
    """torch.library.opcheck of KDA's decode, verify and snapshot ops on one small CPU pool."""
    gen = torch.Generator().manual_seed(3)
    layout = kda_layout(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, window=4,
                        drafts=2, act_dtype=torch.float32)  # fmt: skip
    pool = layout.allocate(6, "cpu")
    pool["state"].copy_(torch.randn(pool["state"].shape, generator=gen))
    handle = plan_handle(plan_decode(layout, 3, device="cpu"))
    slots = torch.tensor([1, -1, 3], dtype=torch.int32)

    def tokens(*lead):
        return dict(q=torch.randn(*lead, 2, 16, generator=gen),
                    k=torch.randn(*lead, 2, 16, generator=gen),
                    v=torch.randn(*lead, 4, 8, generator=gen),
                    a=torch.randn(*lead, 4, 16, generator=gen) - 2,
                    b=torch.randn(*lead, 4, generator=gen),
                    A_log=torch.full((4,), -1.0), dt_bias=torch.zeros(4 * 16),
                    slot_indices=slots)  # fmt: skip

    cases = [
        ("kda_decode", {**pool, **tokens(3), "out": torch.empty(3, 4, 8)}),
        ("kda_verify", {**pool, **tokens(3, 2), "out": torch.empty(3, 2, 4, 8)}),
        ("kda_snapshot_verify", dict(state=pool["state"], **tokens(3, 2),
                                     out=torch.empty(3, 2, 4, 8),
                                     snapshot_slots=torch.tensor([[0, 2], [0, 0], [4, 5]],
                                                                 dtype=torch.int32))),
    ]  # fmt: skip
    for name, kwargs in cases:
        torch.library.opcheck(getattr(torch.ops.replayssm, name).default, (handle,), kwargs)
