"""float64 proofs for the GDN reference: conventional and ReplaySSM forms agree (1e-12 rel)."""

from __future__ import annotations

import pytest
import torch
from ref_helpers import (
    F64,
    batched_pool_vs_replay,
    full_head_schedule,
    long_random_schedule,
    rand,
    randn,
    spec_only_schedule,
)

from replayssm_jit.reference import (
    GDNRecords,
    GDNSequence,
    gdn_fold,
    gdn_gates,
    gdn_replay_output,
    gdn_step,
    gdn_step_pool,
    gdn_verify,
)

pytestmark = pytest.mark.usefixtures("single_thread")


# DESIGN §6 (H key heads, HV value heads); "_r" = few heads, same K, V and HV/H ratio
SHAPES = {
    "qwen4b": dict(H=16, HV=32, K=128, V=128),
    "qwen122b": dict(H=16, HV=64, K=128, V=128),
    "qwen4b_r": dict(H=2, HV=4, K=128, V=128),
    "qwen122b_r": dict(H=1, HV=4, K=128, V=128),
}


class Family:
    """Parameters, fresh token inputs and the conventional step for one GDN layer."""

    def __init__(self, gen, H, HV, K, V, use_qk_l2norm=True, scale=None):
        self.gen, self.H, self.HV, self.K, self.V = gen, H, HV, K, V
        self.A_log = torch.log(rand(gen, HV, lo=0.5, hi=1.5))
        self.dt_bias = rand(gen, HV, lo=-0.25, hi=0.25)
        self.use_qk_l2norm, self.scale = use_qk_l2norm, scale

    def tokens(self, t, batch=None):
        lead = (t,) if batch is None else (batch, t)
        g = self.gen
        q, k = randn(g, *lead, self.H, self.K), randn(g, *lead, self.H, self.K)
        if not self.use_qk_l2norm:  # the caller normalises: keeps the state bounded
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        # softplus(a + dt_bias) in [0.01, 0.39], exp(A_log) in [0.5, 1.5] -> alpha in [0.56, 1)
        gate, beta = gdn_gates(
            self.A_log,
            rand(g, *lead, self.HV, lo=-4.0, hi=-1.0),
            self.dt_bias,
            randn(g, *lead, self.HV),
        )
        return dict(q=q, k=k, v=randn(g, *lead, self.HV, self.V), g=gate, beta=beta)

    def state(self, *lead):
        return randn(self.gen, *lead, self.HV, self.V, self.K) * 0.1

    def conv(self, state, q, k, v, g, beta):
        o, s = gdn_step(
            state[None],
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            self.scale,
            self.use_qk_l2norm,
        )
        return o[0], s[0]

    def sequence(self, checkpoint, L, T=4):
        return GDNSequence(checkpoint, self.scale, self.use_qk_l2norm, L=L, T=T)


# ---------------------------------------------------------------------------------------------


def test_gates_formula():
    gen = torch.Generator().manual_seed(1)
    A_log, dt_bias = randn(gen, 4), randn(gen, 4)
    a, b = randn(gen, 3, 4) * 5, randn(gen, 3, 4)
    g, beta = gdn_gates(A_log.float(), a.float(), dt_bias.float(), b.float())
    assert g.dtype == F64 and beta.dtype == F64
    x = a.float().double() + dt_bias.float().double()
    ref_g = -torch.exp(A_log.float().double()) * torch.log1p(torch.exp(x))
    assert torch.allclose(g, ref_g, rtol=1e-13, atol=0)
    assert torch.allclose(beta, 1 / (1 + torch.exp(-b.float().double())), rtol=1e-14, atol=0)


@pytest.mark.parametrize("l2norm", [True, False])
def test_step_matches_naive_per_head_loop(l2norm, assert_rel):
    gen = torch.Generator().manual_seed(2)
    H, HV, K, V, batch = 2, 6, 5, 3, 2
    fam = Family(gen, H=H, HV=HV, K=K, V=V, use_qk_l2norm=l2norm, scale=None if l2norm else 0.7)
    state = fam.state(batch) * 10
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=batch).items()}
    o, new = gdn_step(state, t["q"], t["k"], t["v"], t["g"], t["beta"], fam.scale, l2norm)
    o_ref, new_ref = torch.empty_like(o), torch.empty_like(new)
    for b in range(batch):
        for hv in range(HV):
            hk = hv // 3  # HV / H = 3 value heads per key head
            q, k = t["q"][b, hk], t["k"][b, hk]
            if l2norm:
                q, k = q / torch.sqrt(q @ q + 1e-6), k / torch.sqrt(k @ k + 1e-6)
            q = q * (K**-0.5 if l2norm else 0.7)
            alpha = torch.exp(t["g"][b, hv])
            u = t["beta"][b, hv] * (t["v"][b, hv] - alpha * state[b, hv] @ k)
            s = alpha * state[b, hv] + torch.outer(u, k)
            new_ref[b, hv], o_ref[b, hv] = s, s @ q
    assert_rel(o, o_ref, 1e-14, "o")
    assert_rel(new, new_ref, 1e-14, "state")


def test_replay_output_fold_and_verify_functions(assert_rel):
    """The functional API without the sequence helper: 12 replayed tokens, then a tree."""
    gen = torch.Generator().manual_seed(3)
    fam = Family(gen, **SHAPES["qwen4b_r"])
    s_c = fam.state()
    toks = fam.tokens(12)
    state, recs = s_c, None
    for j in range(12):
        tok = {k: v[j] for k, v in toks.items()}
        o_ref, state = fam.conv(state, **tok)
        o, rec = gdn_replay_output(s_c, recs, **tok)
        assert isinstance(rec, GDNRecords) and rec.n == 1
        recs = rec if recs is None else recs.cat(rec)
        assert_rel(o, o_ref, 1e-12, f"replay output {j}")
        assert_rel(gdn_fold(s_c, recs), state, 1e-12, f"fold {j}")
    assert recs.n == 12 and recs.g.shape == (12, 4) and recs.k.shape == (12, 2, 128)
    parents = [-1, 0, 0, -1, 2]
    drafts = fam.tokens(5)
    o, drecs = gdn_verify(s_c, recs[:5], **drafts, parents=torch.tensor(parents))
    assert drecs.n == 5
    base = gdn_fold(s_c, recs[:5])
    for j, path in enumerate([[0], [0, 1], [0, 2], [3], [0, 2, 4]]):
        s = base
        for i in path:
            o_ref, s = fam.conv(s, **{k: v[i] for k, v in drafts.items()})
        assert_rel(o[j], o_ref, 1e-12, f"tree node {j}")
        assert_rel(gdn_fold(s_c, recs[:5].cat(drecs[path])), s, 1e-12, f"path state {j}")


@pytest.mark.parametrize("L", [1, 4, 16, 64])
def test_long_random_schedule(L, run_schedule):
    gen = torch.Generator().manual_seed(200 + L)
    long_random_schedule(Family(gen, **SHAPES["qwen4b_r"]), gen, L, run_schedule)


@pytest.mark.parametrize("L", [16, 64])
def test_spec_only_schedule_reaches_early_flush(L, run_schedule):
    gen = torch.Generator().manual_seed(300 + L)
    spec_only_schedule(Family(gen, **SHAPES["qwen4b_r"]), gen, L, run_schedule)


def test_long_random_schedule_qwen122b_ratio_no_l2norm(run_schedule):
    gen = torch.Generator().manual_seed(9)
    fam = Family(gen, **SHAPES["qwen122b_r"], use_qk_l2norm=False, scale=0.25)
    state = fam.state()
    stats = run_schedule(fam.sequence(state, L=16), state, fam.conv, fam.tokens, gen, 240)
    assert stats["window"] > 0 and stats["tree"] > 0


@pytest.mark.parametrize("shape", ["qwen4b", "qwen122b"])
def test_full_head_shapes(shape, run_schedule):
    gen = torch.Generator().manual_seed(11)
    fam = Family(gen, **SHAPES[shape])
    full_head_schedule(fam, gen, run_schedule)


@pytest.mark.parametrize("shape", ["qwen4b", "qwen122b"])
def test_full_head_shapes_batched_pool_vs_replay(shape, assert_rel):
    """Batch 3 (one padded row) through the pool step vs two per-sequence replays (L = 4)."""
    gen = torch.Generator().manual_seed(12)
    fam = Family(gen, **SHAPES[shape])
    batched_pool_vs_replay(fam, gdn_step_pool, assert_rel)


@pytest.mark.parametrize("pool_dtype", [F64, torch.float32])
@pytest.mark.parametrize("pad_slot_id", [-1, 0])
def test_pool_matches_step_and_leaves_other_slots(pool_dtype, pad_slot_id, assert_rel):
    gen = torch.Generator().manual_seed(5)
    fam = Family(gen, H=2, HV=4, K=16, V=8)
    pool = fam.state(7).to(pool_dtype)
    before = pool.clone()
    slots = torch.tensor([4, pad_slot_id, 2, 6, pad_slot_id, 1])
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=6).items()}
    o = gdn_step_pool(pool, slots, **t, pad_slot_id=pad_slot_id)
    assert o.dtype == F64 and pool.dtype == pool_dtype
    live = [0, 2, 3, 5]
    o_ref, new_ref = gdn_step(before[slots[live]], **{k: v[live] for k, v in t.items()})
    assert torch.equal(o[[1, 4]], torch.zeros_like(o[[1, 4]]))
    assert_rel(o[live], o_ref, 1e-14, "pool o")
    assert torch.equal(pool[slots[live]], new_ref.to(pool_dtype))
    for s in {0, 3, 5} - {pad_slot_id}:
        assert torch.equal(pool[s], before[s]), f"slot {s} was touched"
    if pad_slot_id == 0:
        assert torch.equal(pool[0], before[0])


def test_bad_inputs_raise_naming_the_argument():
    gen = torch.Generator().manual_seed(8)
    fam = Family(gen, H=2, HV=4, K=16, V=8)
    state = fam.state(2)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=2).items()}
    for name, bad in [
        ("k", t["k"][:, :, :8]),
        ("v", t["v"][:, :3]),
        ("g", t["g"][:, :, None]),
        ("beta", t["beta"][:1]),
    ]:
        with pytest.raises(ValueError, match=f"^{name}: expected shape"):
            gdn_step(state, **{**t, name: bad})
    with pytest.raises(ValueError, match=r"^k: key heads H \(3\) must divide 4"):
        gdn_step(state, randn(gen, 2, 3, 16), randn(gen, 2, 3, 16), t["v"], t["g"], t["beta"])
    with pytest.raises(ValueError, match="^state: expected shape"):
        gdn_step(state[0], **t)
    pool = fam.state(3)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"^slot_indices: expected values in \[0, 3\).* got 5"):
        gdn_step_pool(pool, torch.tensor([5, 0]), **t)
    with pytest.raises(ValueError, match="^slot_indices: slot 2 appears twice"):
        gdn_step_pool(pool, torch.tensor([2, 2]), **t)
    with pytest.raises(ValueError, match=r"^slot_indices: expected shape \(2,\)"):
        gdn_step_pool(pool, torch.tensor([0, 1, 2]), **t)
    assert torch.equal(pool, before)
    with pytest.raises(ValueError, match="^records: expected GDNRecords"):
        gdn_replay_output(state[0], "not records", **{k: v[0] for k, v in t.items()})
    with pytest.raises(ValueError, match="^dt_bias: expected shape"):
        gdn_gates(fam.A_log, t["g"], fam.dt_bias[:2], t["beta"])
    seq = fam.sequence(state[0], L=4, T=2)
    d = fam.tokens(2)
    seq.verify(parents=[-1, -1], **d)
    with pytest.raises(ValueError, match="^accepted: .* not a root-to-node path"):
        seq.commit([0, 1])
    seq.commit([1])
    assert seq.n == 1
