"""float64 proofs for the delta-rule references, GDN (reference/gdn.py) and KDA (reference/kda.py):
conventional and ReplaySSM forms agree (1e-12 rel). Each shared test runs once per family case;
the GDN gates and KDA's uniform-decay equivalence have no counterpart and run once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from support import ref_helpers
from support.ref_helpers import F64, rand, randn

from replayssm_jit import reference as ref

pytestmark = pytest.mark.usefixtures("single_thread")


# H key heads, HV value heads (docs/design.md, "The math"), K = V = 128. GDN: the Qwen3-Next
# layers; KDA: Kimi-Linear's (no GVA). "_r" = few heads, same HV/H; "kimi_gva": HV/H = 2, few heads.
SHAPES = {
    "qwen4b": dict(H=16, HV=32, K=128, V=128),
    "qwen122b": dict(H=16, HV=64, K=128, V=128),
    "qwen4b_r": dict(H=2, HV=4, K=128, V=128),
    "qwen122b_r": dict(H=1, HV=4, K=128, V=128),
    "kimi": dict(H=32, HV=32, K=128, V=128),
    "kimi_r": dict(H=2, HV=2, K=128, V=128),
    "kimi_gva": dict(H=2, HV=4, K=128, V=128),
}


def _gdn_params(gen, HV):
    return dict(
        A_log=torch.log(rand(gen, HV, lo=0.5, hi=1.5)), dt_bias=rand(gen, HV, lo=-0.25, hi=0.25)
    )


def _gdn_inputs(fam, lead):
    # softplus(a + dt_bias) in [0.01, 0.39], exp(A_log) in [0.5, 1.5] -> alpha in [0.56, 1)
    a, b = rand(fam.gen, *lead, fam.HV, lo=-4.0, hi=-1.0), randn(fam.gen, *lead, fam.HV)
    g, beta = ref.gdn_gates(fam.A_log, a, fam.dt_bias, b)
    return dict(v=randn(fam.gen, *lead, fam.HV, fam.V), g=g, beta=beta)


def _kda_inputs(fam, lead):
    v = randn(fam.gen, *lead, fam.HV, fam.V)
    g = torch.log(rand(fam.gen, *lead, fam.HV, fam.K, lo=0.5, hi=1.0))  # alpha per channel
    return dict(v=v, g=g, beta=rand(fam.gen, *lead, fam.HV))


@dataclass(frozen=True)
class Case:
    """One delta-rule family: its reference functions and classes, the shape of its decay g and
    how its tests draw parameters, token inputs, shapes and schedule seeds."""

    name: str
    step: Callable
    step_pool: Callable
    replay_output: Callable
    fold: Callable
    verify: Callable
    records: type
    sequence: type
    per_channel: bool  # g [..., HV, K] (KDA) or [..., HV] (GDN)
    params: Callable  # (gen, HV) -> layer parameters, drawn first
    inputs: Callable  # (family, lead) -> v, g, beta of fresh tokens, drawn after q and k
    reduced: str  # few-head shape of the functional and long-schedule tests
    spec_only: dict  # Family arguments of the speculative-only schedule
    full: tuple[str, ...]  # full-head shapes
    seed_offset: int  # added to the schedule tests' seeds: one stream per family

    def g_shape(self, *lead, HV, K):
        return (*lead, HV, K) if self.per_channel else (*lead, HV)


GDN = Case(
    "gdn",
    ref.gdn_step,
    ref.gdn_step_pool,
    ref.gdn_replay_output,
    ref.gdn_fold,
    ref.gdn_verify,
    ref.GDNRecords,
    ref.GDNSequence,
    per_channel=False,
    params=_gdn_params,
    inputs=_gdn_inputs,
    reduced="qwen4b_r",
    spec_only=SHAPES["qwen4b_r"],
    full=("qwen4b", "qwen122b"),
    seed_offset=0,
)
KDA = Case(
    "kda",
    ref.kda_step,
    ref.kda_step_pool,
    ref.kda_replay_output,
    ref.kda_fold,
    ref.kda_verify,
    ref.KDARecords,
    ref.KDASequence,
    per_channel=True,
    params=lambda gen, HV: {},
    inputs=_kda_inputs,
    reduced="kimi_gva",
    spec_only=dict(**SHAPES["kimi_r"], scale=0.2),
    full=("kimi",),
    seed_offset=300,
)
CASES = [GDN, KDA]
over_cases = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
over_full_shapes = pytest.mark.parametrize(
    "case, shape",
    [(c, s) for c in CASES for s in c.full],
    ids=[f"{c.name}-{s}" for c in CASES for s in c.full],
)


class Family:
    """Parameters, fresh token inputs and the conventional step for one layer of `case`."""

    def __init__(self, case, gen, H, HV, K, V, use_qk_l2norm=True, scale=None):
        self.case, self.gen, self.H, self.HV, self.K, self.V = case, gen, H, HV, K, V
        for name, value in case.params(gen, HV).items():
            setattr(self, name, value)
        self.use_qk_l2norm, self.scale = use_qk_l2norm, scale

    def tokens(self, t, batch=None):
        lead = (t,) if batch is None else (batch, t)
        q, k = randn(self.gen, *lead, self.H, self.K), randn(self.gen, *lead, self.H, self.K)
        if not self.use_qk_l2norm:  # the caller normalises: keeps the state bounded
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        return dict(q=q, k=k, **self.case.inputs(self, lead))

    def state(self, *lead):
        return randn(self.gen, *lead, self.HV, self.V, self.K) * 0.1

    def conv(self, state, q, k, v, g, beta):
        lead = (state[None], q[None], k[None], v[None], g[None], beta[None])
        o, s = self.case.step(*lead, self.scale, self.use_qk_l2norm)
        return o[0], s[0]

    def sequence(self, checkpoint, L, T=4):
        return self.case.sequence(checkpoint, self.scale, self.use_qk_l2norm, L=L, T=T)


# ---------------------------------------------------------------------------------------------
# Family-specific
# ---------------------------------------------------------------------------------------------


def test_gdn_gates_formula():
    gen = torch.Generator().manual_seed(1)
    A_log, dt_bias = randn(gen, 4), randn(gen, 4)
    a, b = randn(gen, 3, 4) * 5, randn(gen, 3, 4)
    g, beta = ref.gdn_gates(A_log.float(), a.float(), dt_bias.float(), b.float())
    assert g.dtype == F64 and beta.dtype == F64
    x = a.float().double() + dt_bias.float().double()
    ref_g = -torch.exp(A_log.float().double()) * torch.log1p(torch.exp(x))
    assert torch.allclose(g, ref_g, rtol=1e-13, atol=0)
    assert torch.allclose(beta, 1 / (1 + torch.exp(-b.float().double())), rtol=1e-14, atol=0)


def test_gdn_gates_bad_dt_bias_raises():
    gen = torch.Generator().manual_seed(8)
    A_log, dt_bias, a, b = randn(gen, 4), randn(gen, 4), randn(gen, 2, 4), randn(gen, 2, 4)
    with pytest.raises(ValueError, match="^dt_bias: expected shape"):
        ref.gdn_gates(A_log, a, dt_bias[:2], b)


def test_kda_uniform_channel_decay_equals_gdn(assert_rel):
    """KDA with g equal across K is GDN: the step and a tree verify agree with the GDN ones."""
    gen = torch.Generator().manual_seed(4)
    fam = Family(KDA, gen, **SHAPES["kimi_gva"])
    state = fam.state(3)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=3).items()}
    g_head = t["g"][..., 0]
    o_k, s_k = KDA.step(state, **{**t, "g": g_head[..., None].expand_as(t["g"])})
    o_g, s_g = GDN.step(state, **{**t, "g": g_head})
    assert_rel(o_k, o_g, 1e-14, "o")
    assert_rel(s_k, s_g, 1e-14, "state")
    d = fam.tokens(4)
    parents = [-1, 0, -1, 1]
    o_k, rk = KDA.verify(
        state[0], None, **{**d, "g": d["g"][..., :1].expand_as(d["g"])}, parents=parents
    )
    o_g, rg = GDN.verify(state[0], None, **{**d, "g": d["g"][..., 0]}, parents=parents)
    assert_rel(o_k, o_g, 1e-14, "verify o")
    assert_rel(rk.u, rg.u, 1e-14, "verify u")


# ---------------------------------------------------------------------------------------------
# Both families
# ---------------------------------------------------------------------------------------------


@over_cases
@pytest.mark.parametrize("l2norm", [True, False])
def test_step_matches_naive_per_head_loop(case, l2norm, assert_rel):
    gen = torch.Generator().manual_seed(2)
    H, HV, K, V, batch = 2, 6, 5, 3, 2
    scale = None if l2norm else 0.7
    fam = Family(case, gen, H=H, HV=HV, K=K, V=V, use_qk_l2norm=l2norm, scale=scale)
    state = fam.state(batch) * 10
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=batch).items()}
    assert t["g"].shape == case.g_shape(batch, HV=HV, K=K)
    o, new = case.step(state, t["q"], t["k"], t["v"], t["g"], t["beta"], scale, l2norm)
    o_ref, new_ref = torch.empty_like(o), torch.empty_like(new)
    for b in range(batch):
        for hv in range(HV):
            hk = hv // (HV // H)
            q, k = t["q"][b, hk], t["k"][b, hk]
            if l2norm:
                q, k = q / torch.sqrt(q @ q + 1e-6), k / torch.sqrt(k @ k + 1e-6)
            q = q * (K**-0.5 if l2norm else 0.7)
            s = state[b, hv] * torch.exp(t["g"][b, hv])  # alpha S (GDN) or S Diag(alpha) (KDA)
            u = t["beta"][b, hv] * (t["v"][b, hv] - s @ k)
            s = s + torch.outer(u, k)
            new_ref[b, hv], o_ref[b, hv] = s, s @ q
    assert_rel(o, o_ref, 1e-14, "o")
    assert_rel(new, new_ref, 1e-14, "state")


@over_cases
def test_replay_output_fold_and_verify_functions(case, assert_rel):
    """The functional API without the sequence helper: 12 replayed tokens, then a tree."""
    gen = torch.Generator().manual_seed(3)
    fam = Family(case, gen, **SHAPES[case.reduced])
    g_shape = case.g_shape(HV=fam.HV, K=fam.K)
    s_c = fam.state()
    toks = fam.tokens(12)
    state, recs = s_c, None
    for j in range(12):
        tok = {k: v[j] for k, v in toks.items()}
        o_ref, state = fam.conv(state, **tok)
        o, rec = case.replay_output(s_c, recs, **tok)
        assert type(rec) is case.records and rec.n == 1 and rec.g.shape == (1, *g_shape)
        recs = rec if recs is None else recs.cat(rec)
        assert_rel(o, o_ref, 1e-12, f"replay output {j}")
        assert_rel(case.fold(s_c, recs), state, 1e-12, f"fold {j}")
    assert recs.n == 12 and recs.g.shape == (12, *g_shape) and recs.k.shape == (12, 2, 128)
    parents = [-1, 0, 0, -1, 2]
    drafts = fam.tokens(5)
    o, drecs = case.verify(s_c, recs[:5], **drafts, parents=parents)
    assert drecs.n == 5 and type(drecs) is case.records
    o_t, drecs_t = case.verify(s_c, recs[:5], **drafts, parents=torch.tensor(parents))
    assert torch.equal(o_t, o) and torch.equal(drecs_t.u, drecs.u), "parents as a tensor"
    base = case.fold(s_c, recs[:5])
    for j, path in enumerate([[0], [0, 1], [0, 2], [3], [0, 2, 4]]):
        s = base
        for i in path:
            o_ref, s = fam.conv(s, **{k: v[i] for k, v in drafts.items()})
        assert_rel(o[j], o_ref, 1e-12, f"tree node {j}")
        assert_rel(case.fold(s_c, recs[:5].cat(drecs[path])), s, 1e-12, f"path state {j}")


@over_cases
@pytest.mark.parametrize("L", [1, 4, 16, 64])
def test_long_random_schedule(case, L, run_schedule):
    gen = torch.Generator().manual_seed(200 + case.seed_offset + L)
    ref_helpers.long_random_schedule(
        Family(case, gen, **SHAPES[case.reduced]), gen, L, run_schedule
    )


@over_cases
@pytest.mark.parametrize("L", [16, 64])
def test_spec_only_schedule_reaches_early_flush(case, L, run_schedule):
    gen = torch.Generator().manual_seed(300 + case.seed_offset + L)
    ref_helpers.spec_only_schedule(Family(case, gen, **case.spec_only), gen, L, run_schedule)


@over_cases
def test_long_random_schedule_qwen122b_ratio_no_l2norm(case, run_schedule):
    """Four value heads on one key head, q and k normalised by the caller, an explicit scale."""
    gen = torch.Generator().manual_seed(9)
    fam = Family(case, gen, **SHAPES["qwen122b_r"], use_qk_l2norm=False, scale=0.25)
    state = fam.state()
    stats = run_schedule(fam.sequence(state, L=16), state, fam.conv, fam.tokens, gen, 240)
    assert stats["window"] > 0 and stats["tree"] > 0


@over_full_shapes
def test_full_head_shapes(case, shape, run_schedule):
    gen = torch.Generator().manual_seed(11)
    ref_helpers.full_head_schedule(Family(case, gen, **SHAPES[shape]), gen, run_schedule)


@over_full_shapes
def test_full_head_shapes_batched_pool_vs_replay(case, shape, assert_rel):
    """Batch 3 (one padded row) through the pool step vs two per-sequence replays (L = 4)."""
    gen = torch.Generator().manual_seed(12)
    ref_helpers.batched_pool_vs_replay(
        Family(case, gen, **SHAPES[shape]), case.step_pool, assert_rel
    )


@over_cases
@pytest.mark.parametrize("pool_dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad_slot_id", [-1, 0])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_pool_matches_step_and_leaves_other_slots(
    case, pool_dtype, pad_slot_id, index_dtype, assert_rel
):
    gen = torch.Generator().manual_seed(5)
    fam = Family(case, gen, H=2, HV=4, K=16, V=8)
    pool = fam.state(7).to(pool_dtype)
    before = pool.clone()
    slots = torch.tensor([4, pad_slot_id, 2, 6, pad_slot_id, 1], dtype=index_dtype)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=6).items()}
    o = case.step_pool(pool, slots, **t, pad_slot_id=pad_slot_id)
    assert o.dtype == F64 and pool.dtype == pool_dtype
    live = [0, 2, 3, 5]
    live_slots = slots[live].long()
    o_ref, new_ref = case.step(before[live_slots], **{k: v[live] for k, v in t.items()})
    assert torch.equal(o[[1, 4]], torch.zeros_like(o[[1, 4]]))
    assert_rel(o[live], o_ref, 1e-14, "pool o")
    assert torch.equal(pool[live_slots], new_ref.to(pool_dtype))
    for s in {0, 3, 5} - {pad_slot_id}:
        assert torch.equal(pool[s], before[s]), f"slot {s} was touched"
    if pad_slot_id == 0:
        assert torch.equal(pool[0], before[0])


@over_cases
def test_bad_inputs_raise_naming_the_argument(case):
    gen = torch.Generator().manual_seed(8)
    fam = Family(case, gen, H=2, HV=4, K=16, V=8)
    state = fam.state(2)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=2).items()}
    g_shape = ", ".join(map(str, case.g_shape(2, HV=4, K=16)))
    # the other family's decay: per head where this one is per channel, and the reverse
    other_g = t["g"][..., 0] if case.per_channel else t["g"][..., None].expand(2, 4, 16)
    for name, bad, match in [
        ("k", t["k"][:, :, :8], "^k: expected shape"),
        ("k", t["k"][:, :1], "^k: expected shape"),
        ("v", t["v"][:, :3], "^v: expected shape"),
        ("g", t["g"][..., None], rf"^g: expected shape \[{g_shape}\]"),
        ("g", other_g, rf"^g: expected shape \[{g_shape}\]"),
        ("beta", t["beta"][:1], "^beta: expected shape"),
    ]:
        with pytest.raises(ValueError, match=match):
            case.step(state, **{**t, name: bad})
    with pytest.raises(TypeError, match="^q: expected a floating dtype"):
        case.step(state, **{**t, "q": t["q"].long()})
    with pytest.raises(ValueError, match=r"^k: key heads H \(3\) must divide 4"):
        case.step(state, randn(gen, 2, 3, 16), randn(gen, 2, 3, 16), t["v"], t["g"], t["beta"])
    with pytest.raises(ValueError, match="^state: expected shape"):
        case.step(state[0], **t)
    pool = fam.state(3)
    before = pool.clone()
    for slots, pad, match in [
        ([5, 0], -1, r"^slot_indices: expected values in \[0, 3\).* got 5"),
        ([-1, 0], 0, r"^slot_indices: expected values in \[0, 3\).* got -1"),
        ([2, 2], -1, "^slot_indices: slot 2 appears twice"),
        ([0, 1, 2], -1, r"^slot_indices: expected shape \(2,\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            case.step_pool(pool, torch.tensor(slots), **t, pad_slot_id=pad)
    assert torch.equal(pool, before)
    t0 = {k: v[0] for k, v in t.items()}
    with pytest.raises(ValueError, match=f"^records: expected {case.records.__name__}"):
        case.replay_output(state[0], "not records", **t0)
    _, rec = case.replay_output(state[0], None, **t0)
    other = next(c for c in CASES if c is not case)
    other_rec_g = rec.g[..., 0] if case.per_channel else rec.g[..., None].expand(1, 4, 16)
    foreign = other.records(other_rec_g, rec.beta, rec.u, rec.v, rec.k)
    with pytest.raises(ValueError, match=f"^records: expected {case.records.__name__}"):
        case.fold(state[0], foreign)
    rec_g_shape = ", ".join(map(str, case.g_shape(1, HV=4, K=16)))
    with pytest.raises(ValueError, match=rf"^records.g: expected shape \[{rec_g_shape}\]"):
        case.fold(state[0], case.records(*foreign._fields()))
    seq = fam.sequence(state[0], L=4, T=2)
    seq.verify(parents=[-1, -1], **fam.tokens(2))
    with pytest.raises(ValueError, match="^accepted: .* not a root-to-node path"):
        seq.commit([0, 1])
    seq.commit([1])
    assert seq.n == 1


@over_cases
def test_early_flush_boundary_and_drop_pending(case, assert_rel):
    gen = torch.Generator().manual_seed(13 + case.seed_offset)
    fam = Family(case, gen, H=2, HV=4, K=16, V=8)
    ref_helpers.early_flush_boundary(fam, gen, assert_rel)
