"""float64 proofs for the KDA reference: conventional and ReplaySSM forms agree (1e-12 rel)."""

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
    KDARecords,
    KDASequence,
    gdn_step,
    gdn_verify,
    kda_fold,
    kda_replay_output,
    kda_step,
    kda_step_pool,
    kda_verify,
)

pytestmark = pytest.mark.usefixtures("single_thread")


# Kimi-Linear style: 32 heads, K = V = 128 (no GVA); "_gva" adds HV/H = 2 at few heads
SHAPES = {
    "kimi": dict(H=32, HV=32, K=128, V=128),
    "kimi_r": dict(H=2, HV=2, K=128, V=128),
    "kimi_gva": dict(H=2, HV=4, K=128, V=128),
}


class Family:
    """Fresh token inputs and the conventional step for one KDA layer (gates precomputed)."""

    def __init__(self, gen, H, HV, K, V, scale=None):
        self.gen, self.H, self.HV, self.K, self.V, self.scale = gen, H, HV, K, V, scale

    def tokens(self, t, batch=None):
        lead = (t,) if batch is None else (batch, t)
        g, H, HV, K, V = self.gen, self.H, self.HV, self.K, self.V
        return dict(
            q=randn(g, *lead, H, K),
            k=randn(g, *lead, H, K),
            v=randn(g, *lead, HV, V),
            g=torch.log(rand(g, *lead, HV, K, lo=0.5, hi=1.0)),  # alpha per channel in [0.5, 1)
            beta=rand(g, *lead, HV),
        )

    def state(self, *lead):
        return randn(self.gen, *lead, self.HV, self.V, self.K) * 0.1

    def conv(self, state, q, k, v, g, beta):
        o, s = kda_step(state[None], q[None], k[None], v[None], g[None], beta[None], self.scale)
        return o[0], s[0]

    def sequence(self, checkpoint, L, T=4):
        return KDASequence(checkpoint, self.scale, L=L, T=T)


# ---------------------------------------------------------------------------------------------


def test_step_matches_naive_per_head_loop(assert_rel):
    gen = torch.Generator().manual_seed(2)
    H, HV, K, V, batch = 2, 4, 5, 3, 2
    fam = Family(gen, H=H, HV=HV, K=K, V=V)
    state = fam.state(batch) * 10
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=batch).items()}
    o, new = kda_step(state, **t)
    o_ref, new_ref = torch.empty_like(o), torch.empty_like(new)
    for b in range(batch):
        for hv in range(HV):
            hk = hv // 2
            q, k = t["q"][b, hk], t["k"][b, hk]
            q, k = q / torch.sqrt(q @ q + 1e-6) * K**-0.5, k / torch.sqrt(k @ k + 1e-6)
            s = state[b, hv] @ torch.diag(torch.exp(t["g"][b, hv]))  # S Diag(alpha)
            u = t["beta"][b, hv] * (t["v"][b, hv] - s @ k)
            s = s + torch.outer(u, k)
            new_ref[b, hv], o_ref[b, hv] = s, s @ q
    assert_rel(o, o_ref, 1e-14, "o")
    assert_rel(new, new_ref, 1e-14, "state")


def test_uniform_channel_decay_equals_gdn(assert_rel):
    """KDA with g equal across K is GDN: the step and a tree verify agree with the GDN ones."""
    gen = torch.Generator().manual_seed(4)
    fam = Family(gen, **SHAPES["kimi_gva"])
    state = fam.state(3)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=3).items()}
    g_head = t["g"][..., 0]
    o_k, s_k = kda_step(state, **{**t, "g": g_head[..., None].expand_as(t["g"])})
    o_g, s_g = gdn_step(state, **{**t, "g": g_head})
    assert_rel(o_k, o_g, 1e-14, "o")
    assert_rel(s_k, s_g, 1e-14, "state")
    d = fam.tokens(4)
    parents = [-1, 0, -1, 1]
    o_k, rk = kda_verify(
        state[0], None, **{**d, "g": d["g"][..., :1].expand_as(d["g"])}, parents=parents
    )
    o_g, rg = gdn_verify(state[0], None, **{**d, "g": d["g"][..., 0]}, parents=parents)
    assert_rel(o_k, o_g, 1e-14, "verify o")
    assert_rel(rk.u, rg.u, 1e-14, "verify u")


def test_replay_output_fold_and_verify_functions(assert_rel):
    gen = torch.Generator().manual_seed(3)
    fam = Family(gen, **SHAPES["kimi_gva"])
    s_c = fam.state()
    toks = fam.tokens(12)
    state, recs = s_c, None
    for j in range(12):
        tok = {k: v[j] for k, v in toks.items()}
        o_ref, state = fam.conv(state, **tok)
        o, rec = kda_replay_output(s_c, recs, **tok)
        assert isinstance(rec, KDARecords) and rec.g.shape == (1, 4, 128)
        recs = rec if recs is None else recs.cat(rec)
        assert_rel(o, o_ref, 1e-12, f"replay output {j}")
        assert_rel(kda_fold(s_c, recs), state, 1e-12, f"fold {j}")
    drafts = fam.tokens(5)
    o, drecs = kda_verify(s_c, recs[:5], **drafts, parents=[-1, 0, 0, -1, 2])
    base = kda_fold(s_c, recs[:5])
    for j, path in enumerate([[0], [0, 1], [0, 2], [3], [0, 2, 4]]):
        s = base
        for i in path:
            o_ref, s = fam.conv(s, **{k: v[i] for k, v in drafts.items()})
        assert_rel(o[j], o_ref, 1e-12, f"tree node {j}")
        assert_rel(kda_fold(s_c, recs[:5].cat(drecs[path])), s, 1e-12, f"path state {j}")


@pytest.mark.parametrize("L", [1, 4, 16, 64])
def test_long_random_schedule(L, run_schedule):
    gen = torch.Generator().manual_seed(500 + L)
    long_random_schedule(Family(gen, **SHAPES["kimi_gva"]), gen, L, run_schedule)


@pytest.mark.parametrize("L", [16, 64])
def test_spec_only_schedule_reaches_early_flush(L, run_schedule):
    gen = torch.Generator().manual_seed(600 + L)
    spec_only_schedule(Family(gen, **SHAPES["kimi_r"], scale=0.2), gen, L, run_schedule)


def test_full_head_shape(run_schedule):
    gen = torch.Generator().manual_seed(11)
    fam = Family(gen, **SHAPES["kimi"])
    full_head_schedule(fam, gen, run_schedule)


@pytest.mark.parametrize("shape", ["kimi"])
def test_full_head_shapes_batched_pool_vs_replay(shape, assert_rel):
    """Batch 3 (one padded row) through the pool step vs two per-sequence replays (L = 4)."""
    gen = torch.Generator().manual_seed(12)
    fam = Family(gen, **SHAPES[shape])
    batched_pool_vs_replay(fam, kda_step_pool, assert_rel)


@pytest.mark.parametrize("pool_dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("pad_slot_id", [-1, 0])
def test_pool_matches_step_and_leaves_other_slots(pool_dtype, pad_slot_id, assert_rel):
    gen = torch.Generator().manual_seed(5)
    fam = Family(gen, H=2, HV=4, K=16, V=8)
    pool = fam.state(7).to(pool_dtype)
    before = pool.clone()
    slots = torch.tensor([4, pad_slot_id, 2, 6, pad_slot_id, 1], dtype=torch.int32)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=6).items()}
    o = kda_step_pool(pool, slots, **t, pad_slot_id=pad_slot_id)
    assert o.dtype == F64 and pool.dtype == pool_dtype
    live = [0, 2, 3, 5]
    o_ref, new_ref = kda_step(before[slots[live].long()], **{k: v[live] for k, v in t.items()})
    assert torch.equal(o[[1, 4]], torch.zeros_like(o[[1, 4]]))
    assert_rel(o[live], o_ref, 1e-14, "pool o")
    assert torch.equal(pool[slots[live].long()], new_ref.to(pool_dtype))
    for s in {0, 3, 5} - {pad_slot_id}:
        assert torch.equal(pool[s], before[s]), f"slot {s} was touched"
    if pad_slot_id == 0:
        assert torch.equal(pool[0], before[0])


def test_bad_inputs_raise_naming_the_argument():
    gen = torch.Generator().manual_seed(8)
    fam = Family(gen, H=2, HV=4, K=16, V=8)
    state = fam.state(2)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=2).items()}
    with pytest.raises(ValueError, match=r"^g: expected shape \(2, 4, 16\)"):
        kda_step(state, **{**t, "g": t["g"][..., 0]})  # a GDN-shaped gate
    with pytest.raises(ValueError, match="^k: expected shape"):
        kda_step(state, **{**t, "k": t["k"][:, :1]})
    with pytest.raises(ValueError, match="^q: expected a floating dtype"):
        kda_step(state, **{**t, "q": t["q"].long()})
    with pytest.raises(ValueError, match=r"^slot_indices: expected values in \[0, 3\).* got -1"):
        kda_step_pool(fam.state(3), torch.tensor([-1, 0]), **t, pad_slot_id=0)
    _, rec = kda_replay_output(state[0], None, **{k: v[0] for k, v in t.items()})
    gdn_like = GDNRecords(rec.g[..., 0], rec.beta, rec.u, rec.v, rec.k)
    with pytest.raises(ValueError, match="^records: expected KDARecords"):
        kda_fold(state[0], gdn_like)
    with pytest.raises(ValueError, match=r"^records.g: expected shape \(1, 4, 16\)"):
        kda_fold(state[0], KDARecords(*gdn_like._fields()))
