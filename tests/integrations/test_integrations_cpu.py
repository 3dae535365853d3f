"""The engine adapters (replayssm_jit/integrations) on the CPU path: each against the functional
op called directly (bit for bit) and against the float64 reference; pad rows write nothing."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import (
    gdn_decode,
    gdn_layout,
    gdn_verify,
    mamba2_decode,
    mamba2_layout,
    mamba2_verify,
    plan_decode,
)
from replayssm_jit.integrations import sglang, vllm
from replayssm_jit.reference import (
    GDNSequence,
    Mamba2Sequence,
    gdn_step_pool,
    mamba2_step_pool,
)

F32, F64, I32 = torch.float32, torch.float64, torch.int32
H, G, P, N = 4, 2, 8, 16  # Mamba-2 heads, groups, headdim, dstate
KH, HV, K, V = 2, 4, 16, 8  # GDN key heads, value heads, head dims
SLOTS, L = 8, 4

pytestmark = pytest.mark.usefixtures("no_launch_env")


def rel(actual, expected):
    a, e = actual.to(F64), expected.to(F64)
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))


def clone(pool):
    return {name: t.clone() for name, t in pool.items()}


def assert_same(a, b):
    for name in a:
        assert torch.equal(a[name], b[name]), name


def m2_layout(T=1):
    return mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, drafts=T,
                         act_dtype=F32)  # fmt: skip


def gdn_lay(T=1):
    return gdn_layout(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                      drafts=T, act_dtype=F32)  # fmt: skip


def m2_params(gen):
    A = -(0.5 + 1.5 * torch.rand(H, generator=gen))
    D = torch.randn(H, generator=gen)
    dt_bias = torch.rand(H, generator=gen) - 0.5
    return A, D, dt_bias


def expanded(A, D, dt_bias):
    """The head-expanded stride-0 forms mamba_ssm / transformers pass."""
    return A[:, None, None].expand(H, P, N), D[:, None].expand(H, P), dt_bias[:, None].expand(H, P)


def m2_tokens(gen, *lead):
    return dict(
        x=torch.randn(*lead, H, P, generator=gen),
        dt=(-3.0 + 3.5 * torch.rand(*lead, H, generator=gen)),
        B=0.5 * torch.randn(*lead, G, N, generator=gen),
        C=0.5 * torch.randn(*lead, G, N, generator=gen),
    )


def gdn_tokens(gen, *lead):
    q = torch.randn(*lead, KH, K, generator=gen)
    k = torch.randn(*lead, KH, K, generator=gen)
    v = torch.randn(*lead, HV, V, generator=gen)
    g = -torch.rand(*lead, HV, generator=gen)
    beta = torch.sigmoid(torch.randn(*lead, HV, generator=gen))
    return dict(q=q, k=k, v=v, g=g, beta=beta)


@pytest.mark.parametrize("pad, module", [(0, "vllm"), (-1, "sglang")])
def test_mamba2_step_matches_op_and_reference(pad, module):
    gen = torch.Generator().manual_seed(1)
    layout = m2_layout()
    slots = torch.tensor([3, pad, 1, 5], dtype=I32)
    plan = plan_decode(layout, 4, device="cpu", pad_slot_id=pad)
    pool = layout.allocate(SLOTS, "cpu")
    pool["state"].normal_(generator=gen)
    direct = clone(pool)
    ref = pool["state"].to(F64)
    A, D, dt_bias = m2_params(gen)
    eA, eD, edt_bias = expanded(A, D, dt_bias)
    for _ in range(2 * L + 1):  # crosses flushes
        before = clone(pool)
        tok = m2_tokens(gen, 4)
        dt16 = tok["dt"].to(torch.bfloat16)  # dt in the activation dtype, head-expanded
        dt_exp = dt16[:, :, None].expand(4, H, P)
        if module == "vllm":
            y = vllm.mamba2_selective_state_update(
                plan, pool, tok["x"], dt_exp, eA, tok["B"], tok["C"], eD, dt_bias=edt_bias,
                dt_softplus=True, state_batch_indices=slots, null_block_id=pad,
            )  # fmt: skip
        else:
            y = sglang.mamba2_decode_step(plan, pool, tok["x"], dt_exp, eA, tok["B"], tok["C"],
                                          eD, dt_bias=edt_bias, cache_indices=slots)  # fmt: skip
        args = {**tok, "dt": dt16.float()}
        y_op = mamba2_decode(plan, **direct, **args, A=A, D=D, dt_bias=dt_bias,
                             slot_indices=slots)  # fmt: skip
        assert torch.equal(y, y_op)
        assert_same(pool, direct)
        y_ref = mamba2_step_pool(ref, slots, **args, A=A, D=D, dt_bias=dt_bias, dt_softplus=True,
                                 pad_slot_id=pad)  # fmt: skip
        assert rel(y, y_ref) < 1e-5
        assert torch.equal(y[1], torch.zeros_like(y[1]))
        for s in {0, 2, 4, 6, 7} - {pad}:  # slots no row names (0 is vLLM's pad block)
            for name in pool:
                assert torch.equal(pool[name][s], before[name][s]), (name, s)


def test_mamba2_untied_params_rejected():
    gen = torch.Generator().manual_seed(2)
    layout = m2_layout()
    plan = plan_decode(layout, 2, device="cpu", pad_slot_id=0)
    pool = layout.allocate(SLOTS, "cpu")
    A, D, dt_bias = m2_params(gen)
    eA, eD, edt_bias = expanded(A, D, dt_bias)
    tok = m2_tokens(gen, 2)
    slots = torch.tensor([1, 2], dtype=I32)

    def call(**kw):
        args = dict(A=eA, D=eD, dt_bias=edt_bias, dt=tok["dt"])
        args.update(kw)
        return vllm.mamba2_selective_state_update(
            plan, pool, tok["x"], args["dt"], args["A"], tok["B"], tok["C"], args["D"],
            dt_bias=args["dt_bias"], state_batch_indices=slots,
        )  # fmt: skip

    y = call()
    # Materialised but tied copies are accepted (checked by value) and give the same output.
    pool_copy = layout.allocate(SLOTS, "cpu")
    y2 = vllm.mamba2_selective_state_update(
        plan, pool_copy, tok["x"], tok["dt"], eA.contiguous(), tok["B"], tok["C"], eD.contiguous(),
        dt_bias=edt_bias.contiguous(), state_batch_indices=slots,
    )  # fmt: skip
    assert torch.equal(y, y2)
    before = clone(pool)
    untied_A = eA.contiguous().clone()
    untied_A[0, 1, 0] += 1.0
    with pytest.raises(ValueError, match="^A: expected one value per head"):
        call(A=untied_A)
    untied_D = torch.randn(H, P, generator=gen)
    with pytest.raises(ValueError, match="^D: expected one value per head"):
        call(D=untied_D)
    with pytest.raises(ValueError, match="^dt_bias: expected one value per head"):
        call(dt_bias=torch.randn(H, P, generator=gen))
    untied_dt = torch.randn(2, H, P, generator=gen)
    with pytest.raises(ValueError, match="^dt: expected one value per head"):
        call(dt=untied_dt)
    with pytest.raises(ValueError, match="^A: expected stride 0"):
        vllm.per_head_params(eA.contiguous(), check_tied=False)
    with pytest.raises(ValueError, match="^null_block_id"):
        vllm.mamba2_selective_state_update(
            plan, pool, tok["x"], tok["dt"], eA, tok["B"], tok["C"], eD, dt_bias=edt_bias,
            state_batch_indices=slots, null_block_id=-1,
        )  # fmt: skip
    assert_same(pool, before)


@pytest.mark.parametrize("module", ["vllm", "sglang"])
def test_mamba2_spec_decode_num_accepted(module):
    gen = torch.Generator().manual_seed(3)
    T = 2
    pad = 0 if module == "vllm" else -1
    layout = m2_layout(T)
    plan = plan_decode(layout, 3, device="cpu", pad_slot_id=pad)
    pool = layout.allocate(SLOTS, "cpu")
    pool["state"].normal_(generator=gen)
    direct = clone(pool)
    slots = torch.tensor([2, pad, 4], dtype=I32)
    A, D, dt_bias = m2_params(gen)
    eA, eD, edt_bias = expanded(A, D, dt_bias)
    seqs = {b: Mamba2Sequence(pool["state"][s].to(F64), A, D, dt_bias, dt_softplus=True, L=L,
                              T=T) for b, s in ((0, 2), (2, 4))}  # fmt: skip
    accepted = None
    for step in range(5):
        tok = m2_tokens(gen, 3, T)
        dt_exp = tok["dt"][..., None].expand(3, T, H, P)
        if module == "vllm":
            y = vllm.mamba2_selective_state_update(
                plan, pool, tok["x"], dt_exp, eA, tok["B"], tok["C"], eD, dt_bias=edt_bias,
                state_batch_indices=slots, num_accepted_tokens=accepted,
            )  # fmt: skip
        else:
            y = sglang.mamba2_decode_step(
                plan, pool, tok["x"], dt_exp, eA, tok["B"], tok["C"], eD, dt_bias=edt_bias,
                cache_indices=slots, num_accepted_tokens=accepted,
            )  # fmt: skip
        y_op = mamba2_verify(plan, **direct, **tok, A=A, D=D, dt_bias=dt_bias,
                             slot_indices=slots, num_accepted=accepted)  # fmt: skip
        assert torch.equal(y, y_op)
        assert_same(pool, direct)
        assert torch.equal(y[1], torch.zeros_like(y[1]))
        for b, seq in seqs.items():
            if accepted is not None:
                seq.commit(int(accepted[b]))
            row = {name: t[b] for name, t in tok.items()}
            assert rel(y[b], seq.verify(**row)) < 1e-5
        accepted = torch.tensor([1 + step % 2, 0, 2 - step % 2], dtype=I32)
    # A standard-shape call after a verify commits num_accepted_tokens first.
    tok = m2_tokens(gen, 3)
    y = vllm.mamba2_selective_state_update(
        plan, pool, tok["x"], tok["dt"], eA, tok["B"], tok["C"], eD, dt_bias=edt_bias,
        state_batch_indices=slots, null_block_id=pad, num_accepted_tokens=accepted,
    ) if module == "vllm" else sglang.mamba2_decode_step(
        plan, pool, tok["x"], tok["dt"], eA, tok["B"], tok["C"], eD, dt_bias=edt_bias,
        cache_indices=slots, num_accepted_tokens=accepted,
    )  # fmt: skip
    for b, seq in seqs.items():
        seq.commit(int(accepted[b]))
        assert rel(y[b], seq.step(**{name: t[b] for name, t in tok.items()})) < 1e-5


def test_single_token_call_that_raises_keeps_the_cursors():
    """The single-token path commits num_accepted_tokens before its step: a step that then
    raises (here a wrong-dtype x) gives the cursors back, so the call changes nothing."""
    gen = torch.Generator().manual_seed(4)
    layout = m2_layout(2)
    plan = plan_decode(layout, 2, device="cpu", pad_slot_id=0)
    pool = layout.allocate(SLOTS, "cpu")
    slots = torch.tensor([2, 4], dtype=I32)
    A, D, dt_bias = m2_params(gen)
    eA, eD, edt_bias = expanded(A, D, dt_bias)
    tok = m2_tokens(gen, 2, 2)
    vllm.mamba2_selective_state_update(
        plan, pool, tok["x"], tok["dt"][..., None].expand(2, 2, H, P), eA, tok["B"], tok["C"], eD,
        dt_bias=edt_bias, state_batch_indices=slots,
    )  # fmt: skip
    before = clone(pool)
    tok = m2_tokens(gen, 2)
    with pytest.raises(TypeError, match="^x: "):
        vllm.mamba2_selective_state_update(
            plan, pool, tok["x"].double(), tok["dt"], eA, tok["B"], tok["C"], eD,
            dt_bias=edt_bias, state_batch_indices=slots,
            num_accepted_tokens=torch.tensor([2, 1], dtype=I32),
        )  # fmt: skip
    assert_same(pool, before)


@pytest.mark.parametrize("pad, varlen", [(0, False), (0, True), (-1, False)])
def test_gdn_step_matches_op_and_reference(pad, varlen):
    gen = torch.Generator().manual_seed(4)
    layout = gdn_lay()
    bs = 4
    plan = plan_decode(layout, bs, device="cpu", pad_slot_id=pad, gates_in_kernel=False)
    pool = layout.allocate(SLOTS, "cpu")
    pool["state"].normal_(generator=gen)
    direct = clone(pool)
    ref = pool["state"].to(F64)
    slots = torch.tensor([6, pad, 2, 3], dtype=I32)
    indices = torch.stack([slots, torch.full_like(slots, 7)], 1).long()  # [bs, 1 + T] form
    cu = torch.arange(bs + 1, dtype=I32) if varlen else None
    for _ in range(2 * L + 1):
        before = clone(pool)
        tok = gdn_tokens(gen, bs)
        shaped = {n: (t[None] if varlen else t[:, None]) for n, t in tok.items()}
        if pad == 0:
            o = vllm.gdn_fused_recurrent(plan, pool, **shaped, scale=K**-0.5,
                                         ssm_state_indices=indices, cu_seqlens=cu,
                                         use_qk_l2norm_in_kernel=True)  # fmt: skip
        else:
            o = sglang.gdn_decode_step(plan, pool, **shaped, cache_indices=slots)
        assert o.shape == (*shaped["q"].shape[:2], HV, V)
        o = o.reshape(bs, HV, V)
        o_op = gdn_decode(plan, **direct, **tok, slot_indices=slots)
        assert torch.equal(o, o_op)
        assert_same(pool, direct)
        o_ref = gdn_step_pool(ref, slots, **tok, pad_slot_id=pad)
        assert rel(o, o_ref) < 1e-5
        assert torch.equal(o[1], torch.zeros_like(o[1]))
        for s in {0, 1, 4, 5, 7} - {pad}:
            for name in pool:
                assert torch.equal(pool[name][s], before[name][s]), (name, s)


def test_gdn_spec_decode_num_accepted():
    gen = torch.Generator().manual_seed(5)
    T, bs = 3, 2
    layout = gdn_lay(T)
    plan = plan_decode(layout, bs, device="cpu", pad_slot_id=0, gates_in_kernel=False)
    pool = layout.allocate(SLOTS, "cpu")
    pool["state"].normal_(generator=gen)
    direct = clone(pool)
    slots = torch.tensor([5, 1], dtype=I32)
    seqs = [GDNSequence(pool["state"][int(s)].to(F64), L=L, T=T) for s in slots]
    cu = torch.arange(0, bs * T + 1, T, dtype=I32)
    accepted = None
    for step in range(5):
        tok = gdn_tokens(gen, bs, T)
        flat = {n: t.reshape(1, bs * T, *t.shape[2:]) for n, t in tok.items()}
        o = vllm.gdn_fused_recurrent(plan, pool, **flat, ssm_state_indices=slots, cu_seqlens=cu,
                                     num_accepted_tokens=accepted,
                                     use_qk_l2norm_in_kernel=True)  # fmt: skip
        o_op = gdn_verify(plan, **direct, **tok, slot_indices=slots, num_accepted=accepted)
        assert torch.equal(o.reshape(bs, T, HV, V), o_op)
        assert_same(pool, direct)
        for b, seq in enumerate(seqs):
            if accepted is not None:
                seq.commit(int(accepted[b]))
            assert rel(o_op[b], seq.verify(**{n: t[b] for n, t in tok.items()})) < 1e-5
        accepted = torch.tensor([step % 4, 3 - step % 4], dtype=I32)


def test_gdn_call_site_mismatches_rejected():
    layout = gdn_lay()
    pool = layout.allocate(SLOTS, "cpu")
    tok = {n: t[:, None] for n, t in gdn_tokens(torch.Generator().manual_seed(6), 2).items()}
    slots = torch.tensor([1, 2], dtype=I32)
    raw = plan_decode(layout, 2, device="cpu", pad_slot_id=0)
    with pytest.raises(ValueError, match="^plan: expected a plan with gates_in_kernel=False"):
        vllm.gdn_fused_recurrent(raw, pool, **tok, ssm_state_indices=slots,
                                 use_qk_l2norm_in_kernel=True)  # fmt: skip
    plan = plan_decode(layout, 2, device="cpu", pad_slot_id=0, gates_in_kernel=False)
    with pytest.raises(ValueError, match="^use_qk_l2norm_in_kernel"):
        vllm.gdn_fused_recurrent(plan, pool, **tok, ssm_state_indices=slots)
    with pytest.raises(ValueError, match="^scale"):
        vllm.gdn_fused_recurrent(plan, pool, **tok, scale=1.0, ssm_state_indices=slots,
                                 use_qk_l2norm_in_kernel=True)  # fmt: skip
    with pytest.raises(ValueError, match="^pad_id"):
        sglang.gdn_decode_step(plan, pool, **tok, cache_indices=slots)


def test_sglang_request_pool_mapping():
    req_to_slot = torch.tensor([4, 7, 2, 0], dtype=I32)
    req = torch.tensor([2, -1, 0, 3], dtype=torch.int64)
    slots = sglang.mamba_slots(req, req_to_slot)
    assert slots.dtype == I32
    assert slots.tolist() == [2, -1, 4, 0]


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_slot_tensor_specs_match_allocate(family):
    if family == "mamba2":
        config = dict(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, drafts=2)
        layout = mamba2_layout(**config)
    else:
        config = dict(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L)
        layout = gdn_layout(**config)
    specs = vllm.slot_tensor_specs(family, **config)
    assert specs == vllm.slot_tensor_specs(layout)
    allocated = layout.allocate(5, "cpu")
    assert [name for name, _, _ in specs] == list(allocated)
    for name, shape, dtype in specs:
        assert allocated[name].shape == (5, *shape) and allocated[name].dtype == dtype


def test_fla_state_layout_helpers():
    state = torch.randn(3, HV, V, K)
    view = vllm.fla_state_view(state)
    assert view.shape == (3, HV, K, V) and view.data_ptr() == state.data_ptr()
    fla = torch.randn(3, HV, K, V)
    ours = torch.empty(3, HV, V, K)
    vllm.copy_state_from_fla(ours, fla)
    assert ours.is_contiguous() and torch.equal(vllm.fla_state_view(ours), fla)
    with pytest.raises(ValueError, match="^fla_state"):
        vllm.copy_state_from_fla(ours, torch.randn(3, HV, V, K))


def test_per_head_params_are_views_of_the_expanded_tensors():
    A, D, dt_bias = m2_params(torch.Generator().manual_seed(7))
    rA, rD, rdt_bias = vllm.per_head_params(*expanded(A, D, dt_bias))
    for reduced, base in ((rA, A), (rD, D), (rdt_bias, dt_bias)):
        assert reduced.shape == (H,) and reduced.is_contiguous()
        assert reduced.data_ptr() == base.data_ptr()  # no copy: the stride-0 dims are dropped
