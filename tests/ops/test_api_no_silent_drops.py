"""Issue 35, section 8: one calling convention for every op, and no silent drops. Each case is
bad input or a misuse that used to return normally with a wrong answer; here it raises (in
eager mode) a ValueError / TypeError naming the argument, and changes nothing."""

from __future__ import annotations

import math

import pytest
import torch

from replayssm_jit import (
    commit_drafts,
    gdn_decode,
    gdn_layout,
    gdn_verify,
    kda_layout,
    kda_verify,
    mamba2_decode,
    mamba2_layout,
    mamba2_verify,
    materialize_slots,
    plan_decode,
    reset_slots,
)
from replayssm_jit.integrations import sglang, vllm

F32, I32 = torch.float32, torch.int32
H, G, P, N = 2, 1, 8, 32  # Mamba-2
KH, HV, K, V = 1, 2, 16, 8  # GDN / KDA
M2_OPTS = dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True)
DELTA_OPTS = dict(use_qk_l2norm=True, gates_in_kernel=False)

pytestmark = pytest.mark.usefixtures("no_launch_env")


def m2_layout(L=4, T=3, **kw):
    return mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, drafts=T,
                         act_dtype=F32, **kw)  # fmt: skip


def delta_layout(family, L=4, T=3):
    make = gdn_layout if family == "gdn" else kda_layout
    return make(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L, drafts=T,
                act_dtype=F32)  # fmt: skip


def pool_of(layout, slots=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = layout.allocate(slots, "cpu")
    pool["state"].copy_(0.3 * torch.randn(pool["state"].shape, generator=gen))
    return pool


def m2_params():
    return dict(A=-torch.ones(H), D=torch.ones(H), dt_bias=torch.zeros(H))


def m2_tokens(*lead, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*lead, H, P, generator=gen), dt=torch.rand(*lead, H, generator=gen),
                B=torch.randn(*lead, G, N, generator=gen),
                C=torch.randn(*lead, G, N, generator=gen))  # fmt: skip


def delta_tokens(family, *lead, seed=1):
    gen = torch.Generator().manual_seed(seed)
    g_shape = (*lead, HV, K) if family == "kda" else (*lead, HV)
    return dict(q=torch.randn(*lead, KH, K, generator=gen),
                k=torch.randn(*lead, KH, K, generator=gen),
                v=torch.randn(*lead, HV, V, generator=gen),
                g=-0.1 * torch.rand(g_shape, generator=gen),
                beta=torch.rand(*lead, HV, generator=gen))  # fmt: skip


def rows(*ids):
    return torch.tensor(ids, dtype=I32)


def snapshot(pool):
    return {k: v.clone() for k, v in pool.items()}


def unchanged(pool, before):
    return all(torch.equal(pool[k].view(torch.uint8), before[k].view(torch.uint8)) for k in pool)


def m2_verify_once(pool, plan, slots, **kw):
    return mamba2_verify(plan, **pool, **m2_params(), **m2_tokens(len(slots), 3),
                         slot_indices=rows(*slots), **kw)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# One calling convention
# ---------------------------------------------------------------------------------------------


def test_commit_drafts_takes_the_pool_as_keyword_tensors():
    """As verify and decode do: commit_drafts(plan, **pool, ...); the mapping form remains."""
    layout = m2_layout()
    pool, twin = pool_of(layout), pool_of(layout)
    plan = plan_decode(layout, 1, device="cpu", **M2_OPTS)
    for p in (pool, twin):
        m2_verify_once(p, plan, [1])
    commit_drafts(plan, **pool, num_accepted=rows(2), slot_indices=rows(1))
    commit_drafts(plan, twin, num_accepted=rows(2), slot_indices=rows(1))
    assert pool["cursors"][1].tolist() == twin["cursors"][1].tolist() == [2, 0, 0, 0]
    with pytest.raises(TypeError, match="tensors"):
        commit_drafts(plan, twin, **pool, num_accepted=rows(0), slot_indices=rows(1))


# ---------------------------------------------------------------------------------------------
# A plain step after a verify
# ---------------------------------------------------------------------------------------------


def test_plain_step_after_verify_refuses_to_drop_pending_drafts():
    layout = m2_layout()
    pool = pool_of(layout)
    vplan = plan_decode(layout, 1, device="cpu", **M2_OPTS)
    m2_verify_once(pool, vplan, [1])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="num_accepted: expected the accepted counts"):
        mamba2_decode(vplan, **pool, **m2_params(), **m2_tokens(1), slot_indices=rows(1))
    assert unchanged(pool, before)


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_plain_step_takes_the_fused_commit(family):
    """decode(num_accepted=a) == commit_drafts(a) then decode, bit for bit."""
    layout = m2_layout() if family == "mamba2" else delta_layout("gdn")
    opts = M2_OPTS if family == "mamba2" else DELTA_OPTS
    plan = plan_decode(layout, 1, device="cpu", **opts)
    pools = [pool_of(layout), pool_of(layout)]
    if family == "mamba2":
        verify, decode = mamba2_verify, mamba2_decode
        vt, st, params = m2_tokens(1, 3), m2_tokens(1, seed=2), m2_params()
    else:
        verify, decode = gdn_verify, gdn_decode
        vt, st, params = delta_tokens("gdn", 1, 3), delta_tokens("gdn", 1, seed=2), {}
    outs = []
    for i, pool in enumerate(pools):
        verify(plan, **pool, **params, **vt, slot_indices=rows(2))
        if i:
            commit_drafts(plan, **pool, num_accepted=rows(2), slot_indices=rows(2))
            outs.append(decode(plan, **pool, **params, **st, slot_indices=rows(2)))
        else:
            outs.append(decode(plan, **pool, **params, **st, slot_indices=rows(2),
                               num_accepted=rows(2)))  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    assert unchanged(pools[0], pools[1])
    assert pools[0]["cursors"][2].tolist() == [3, 0, 0, 0]


# ---------------------------------------------------------------------------------------------
# Tree paths, and the double commit
# ---------------------------------------------------------------------------------------------


def test_commit_rejects_a_path_that_is_not_a_root_path_of_the_tree():
    layout = m2_layout()
    pool = pool_of(layout)
    plan = plan_decode(layout, 1, device="cpu", **M2_OPTS)
    parents = torch.tensor([[-1, 0, 0]], dtype=I32)  # drafts 1 and 2 are siblings
    m2_verify_once(pool, plan, [1], parents=parents)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="accepted_path: expected row 0's first 3 entries"):
        commit_drafts(plan, **pool, num_accepted=rows(3), slot_indices=rows(1),
                      accepted_path=torch.tensor([[0, 1, 2]], dtype=I32),
                      parents=parents)  # fmt: skip
    assert unchanged(pool, before)
    commit_drafts(
        plan,
        **pool,
        num_accepted=rows(2),
        slot_indices=rows(1),
        accepted_path=torch.tensor([[0, 2, 0]], dtype=I32),
        parents=parents,
    )
    assert pool["cursors"][1].tolist() == [2, 0, 0, 0]


def test_the_readme_example_cannot_commit_twice():
    """The fused form (verify with num_accepted) and commit_drafts of the same drafts."""
    layout = m2_layout()
    pool = pool_of(layout)
    plan = plan_decode(layout, 1, device="cpu", **M2_OPTS)
    accepted = rows(2)
    m2_verify_once(pool, plan, [1])
    m2_verify_once(pool, plan, [1], num_accepted=accepted)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="would commit twice"):
        commit_drafts(plan, **pool, num_accepted=accepted, slot_indices=rows(1))
    assert unchanged(pool, before)
    m2_verify_once(pool, plan, [1], num_accepted=accepted)  # the fused form goes on
    assert pool["cursors"][1].tolist() == [0, 1, 0, 3]  # 4 committed + 3 drafts: folded


# ---------------------------------------------------------------------------------------------
# NaN containment on the torch path
# ---------------------------------------------------------------------------------------------


def _nan_in_draft_1(family, device="cpu"):
    """A tree [-1, 0, 0] with NaN inputs in draft 1, then commit of the path [0, 2]: returns
    (the verify's outputs, the committed state)."""
    layout = m2_layout() if family == "mamba2" else delta_layout(family)
    opts = M2_OPTS if family == "mamba2" else DELTA_OPTS
    pool = {k: v.to(device) for k, v in pool_of(layout).items()}
    plan = plan_decode(layout, 1, device=device, **opts)
    parents = torch.tensor([[-1, 0, 0]], dtype=I32, device=device)
    slots = rows(1).to(device)
    if family == "mamba2":
        tok, params, verify = m2_tokens(1, 3), m2_params(), mamba2_verify
        tok["x"][0, 1] = math.nan
    else:
        tok, params = delta_tokens(family, 1, 3), {}
        verify = gdn_verify if family == "gdn" else kda_verify
        tok["v"][0, 1] = math.nan
    tok = {k: v.to(device) for k, v in tok.items()}
    params = {k: v.to(device) for k, v in params.items()}
    out = verify(plan, **pool, **params, **tok, slot_indices=slots, parents=parents)
    commit_drafts(plan, **pool, num_accepted=rows(2).to(device), slot_indices=slots,
                  accepted_path=torch.tensor([[0, 2, 0]], dtype=I32, device=device),
                  parents=parents)  # fmt: skip
    fold = {"A": params["A"]} if family == "mamba2" else {}
    return out.cpu(), materialize_slots(plan, pool, [1], **fold).cpu()


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_nan_draft_reaches_no_other_draft_nor_the_committed_state(family):
    out, state = _nan_in_draft_1(family)
    assert bool(torch.isnan(out[0, 1]).any())
    assert bool(torch.isfinite(out[0, 0]).all()) and bool(torch.isfinite(out[0, 2]).all())
    assert bool(torch.isfinite(state).all())


# The torch path's other checkpoint formats: e4m3 / NVFP4 checkpoints and read copies (Mamba-2
# and GDN), with support.verify_formats' heads (wide enough for NVFP4's blocks).
NAN_FORMATS = [("e4m3", None), ("nvfp4", None), ("f32", "e4m3"), ("f32", "bf16"), ("f32", "nvfp4")]


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("state, read", NAN_FORMATS, ids=lambda d: str(d))
def test_a_nan_draft_is_contained_on_every_checkpoint_format(family, state, read):
    from support.verify_formats import FAMS

    if family == "kda" and read is not None:
        pytest.skip("KDA has no separate mode")
    fam = FAMS[family]()
    layout = fam.layout(state, read, 4, 3)
    pool = layout.allocate(4, "cpu")
    gen = torch.Generator().manual_seed(0)
    reset_slots(layout, pool, torch.arange(4), 0.3 * torch.randn(4, *fam.state_shape(),
                                                                  generator=gen))  # fmt: skip
    plan = plan_decode(layout, 1, device="cpu", **fam.options)
    params, tok = fam.params(gen), fam.drafts(gen, 1, 3)
    tok["x" if family == "mamba2" else "v"][0, 1] = math.nan
    parents, slots = torch.tensor([[-1, 0, 0]], dtype=I32), rows(1)
    before = {k: v.clone() for k, v in pool.items()}
    out = fam.verify_op(plan, **pool, **params, **tok, slot_indices=slots, parents=parents)
    commit_drafts(plan, **pool, num_accepted=rows(2), slot_indices=slots, parents=parents,
                  accepted_path=torch.tensor([[0, 2, 0]], dtype=I32))  # fmt: skip
    for a in (0, 3):  # the second verify's early flush folds them (and rewrites every copy)
        fam.verify_op(plan, **pool, **params, **fam.drafts(gen, 1, 3), slot_indices=slots,
                      num_accepted=rows(a))  # fmt: skip
    assert pool["cursors"][1, 1].item() == 1, "an early flush folded the accepted drafts"
    assert bool(torch.isnan(out[0, 1]).any())
    assert bool(torch.isfinite(out[0, 0]).all()) and bool(torch.isfinite(out[0, 2]).all())
    fold = {"A": params["A"]} if family == "mamba2" else {}
    assert bool(torch.isfinite(materialize_slots(plan, pool, [1], **fold)).all())
    for name in layout.checkpoint_names:  # every copy finite, slots no row named untouched
        if pool[name].dtype != torch.float4_e2m1fn_x2:
            assert bool(torch.isfinite(pool[name][1].float()).all()), name
        assert all(torch.equal(pool[name][s].view(torch.uint8), before[name][s].view(torch.uint8))
                   for s in (0, 2, 3)), name  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_nan_draft_is_contained_by_the_kernels(family):
    """The kernels' behaviour (measured on the GPU by the speculative-verify issue)."""
    out, state = _nan_in_draft_1(family, device="cuda")
    assert bool(torch.isfinite(out[0, 0]).all()) and bool(torch.isfinite(out[0, 2]).all())
    assert bool(torch.isfinite(state).all())


# ---------------------------------------------------------------------------------------------
# Outputs may not alias inputs
# ---------------------------------------------------------------------------------------------


def test_out_may_not_alias_an_input():
    layout = m2_layout()
    pool = pool_of(layout)
    plan = plan_decode(layout, 1, device="cpu", **M2_OPTS)
    tok = m2_tokens(1)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="out: expected memory disjoint from the input x"):
        mamba2_decode(plan, **pool, **m2_params(), **tok, slot_indices=rows(1), out=tok["x"])
    vt = m2_tokens(1, 3)
    with pytest.raises(ValueError, match="out: expected memory disjoint from the input x"):
        mamba2_verify(plan, **pool, **m2_params(), **vt, slot_indices=rows(1), out=vt["x"])
    gl = delta_layout("gdn")
    gpool = pool_of(gl)
    gplan = plan_decode(gl, 1, device="cpu", **DELTA_OPTS)
    gt = delta_tokens("gdn", 1)
    with pytest.raises(ValueError, match="out: expected memory disjoint from the input v"):
        gdn_decode(gplan, **gpool, **gt, slot_indices=rows(1), out=gt["v"])
    assert unchanged(pool, before)


# ---------------------------------------------------------------------------------------------
# Plans checked against the pool
# ---------------------------------------------------------------------------------------------


def test_a_plan_of_another_layout_is_refused():
    """L=5, T=2 and L=4, T=3 rings both hold 7 rows."""
    pool = pool_of(m2_layout(L=4, T=3))
    plan = plan_decode(m2_layout(L=4, T=3), 1, device="cpu", **M2_OPTS)
    other = plan_decode(m2_layout(L=5, T=2), 1, device="cpu", **M2_OPTS)
    m2_verify_once(pool, plan, [1])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="plan: expected a plan of the pool's layout"):
        commit_drafts(other, **pool, num_accepted=rows(2), slot_indices=rows(1))
    with pytest.raises(ValueError, match="plan: expected a plan of the pool's layout"):
        mamba2_decode(other, **pool, **m2_params(), **m2_tokens(1), slot_indices=rows(1),
                      num_accepted=rows(0))  # fmt: skip
    assert unchanged(pool, before)


def test_a_conventional_plan_on_a_pool_holding_records_is_refused():
    layout = m2_layout(T=1)
    pool = pool_of(layout)
    replay = plan_decode(layout, 1, device="cpu", **M2_OPTS)
    conv = plan_decode(layout, 1, device="cpu", mode="conventional", **M2_OPTS)
    mamba2_decode(replay, **pool, **m2_params(), **m2_tokens(1), slot_indices=rows(1))
    before = snapshot(pool)
    with pytest.raises(ValueError, match="plan: expected mode='replay' for slot 1"):
        mamba2_decode(conv, **pool, **m2_params(), **m2_tokens(1), slot_indices=rows(1))
    with pytest.raises(ValueError, match="plan: expected mode='replay' for slot 1"):
        materialize_slots(conv, pool, [1], A=m2_params()["A"])
    assert unchanged(pool, before)


def test_a_cursor_holding_L_plus_T_records_is_refused_in_eager_mode():
    L, T = 4, 3
    layout = m2_layout(L=L, T=T)
    pool = pool_of(layout)
    plan = plan_decode(layout, 1, device="cpu", **M2_OPTS)
    pool["cursors"][1, 0] = L + T
    before = snapshot(pool)
    with pytest.raises(ValueError, match="cursors: expected a cursor a step leaves in slot 1"):
        mamba2_decode(plan, **pool, **m2_params(), **m2_tokens(1), slot_indices=rows(1))
    with pytest.raises(ValueError, match="cursors: expected a cursor a step leaves in slot 1"):
        m2_verify_once(pool, plan, [1])
    assert unchanged(pool, before)


# ---------------------------------------------------------------------------------------------
# Non-finite initial states
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", ["f32", "e4m3", "nvfp4"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_reset_slots_refuses_non_finite_states(state_dtype, value):
    # (no drafts with these formats; NVFP4 tiles need whole 64-row heads)
    layout = mamba2_layout(num_heads=H, headdim=64, dstate=N, ngroups=G, window=4,
                           state_dtype=state_dtype)  # fmt: skip
    pool = layout.allocate(4, "cpu")
    initial = torch.zeros(1, H, 64, N)
    initial[0, 1, 2, 3] = value
    before = snapshot(pool)
    with pytest.raises(ValueError, match="initial_state: expected finite values"):
        reset_slots(layout, pool, [1], initial)
    assert unchanged(pool, before)


# ---------------------------------------------------------------------------------------------
# The engine adapters' casts
# ---------------------------------------------------------------------------------------------


def _adapter_call(module, indices, accepted):
    layout = m2_layout(T=1)
    pad = vllm.NULL_BLOCK_ID if module is vllm else sglang.PAD_SLOT_ID
    plan = plan_decode(layout, 1, device="cpu", pad_slot_id=pad, **M2_OPTS)
    pool = pool_of(layout)
    p = m2_params()
    tok = m2_tokens(1)
    kw = dict(D=p["D"], dt_bias=p["dt_bias"], num_accepted_tokens=accepted)
    if module is vllm:
        kw["state_batch_indices"] = indices
    else:
        kw["cache_indices"] = indices
    step = vllm.mamba2_selective_state_update if module is vllm else sglang.mamba2_decode_step
    before = snapshot(pool)
    try:
        step(plan, pool, tok["x"], tok["dt"], p["A"], tok["B"], tok["C"], **kw)
    finally:
        assert unchanged(pool, before)


@pytest.mark.parametrize("module", [vllm, sglang], ids=["vllm", "sglang"])
def test_adapters_refuse_int64_slot_ids_outside_int32(module):
    name = "state_batch_indices" if module is vllm else "cache_indices"
    with pytest.raises(ValueError, match=f"{name}: expected slot ids in the int32 range"):
        _adapter_call(module, torch.tensor([2**32 + 1]), None)


@pytest.mark.parametrize("module", [vllm, sglang], ids=["vllm", "sglang"])
def test_adapters_refuse_float_accepted_counts(module):
    with pytest.raises(TypeError, match="num_accepted_tokens: expected dtype int32 or int64"):
        _adapter_call(module, torch.tensor([1]), torch.tensor([1.7]))


def test_tensor_tags_forget_dead_tensors():
    """The per-pool tags (layouts, fused commits) keep nothing once a pool's tensors die."""
    import gc

    from replayssm_jit.core.checks import TensorTags

    tags = TensorTags()
    for i in range(50):
        tags.set(torch.zeros(4), i)
    gc.collect()
    assert tags._tags == {}
    live = torch.zeros(3)
    tags.set(live, "kept")
    assert tags.get(live.view(3)) == "kept"
