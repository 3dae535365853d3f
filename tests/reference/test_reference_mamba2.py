"""float64 proofs for the Mamba-2 reference: conventional and ReplaySSM forms agree (1e-12 rel)."""

from __future__ import annotations

import pytest
import torch
from support import ref_helpers
from support.ref_helpers import F64, rand, randn

from replayssm_jit.reference import (
    Mamba2Records,
    Mamba2Sequence,
    decays_to_end,
    mamba2_fold,
    mamba2_make_record,
    mamba2_replay_output,
    mamba2_step,
    mamba2_step_pool,
    mamba2_verify,
    segment_decays,
)

pytestmark = pytest.mark.usefixtures("single_thread")


# Model shapes (README; H = value heads, G = groups); "_r" = few heads, same P, N and H/G ratio
SHAPES = {
    "nano4b": dict(H=96, P=80, N=128, G=8),
    "super120b": dict(H=128, P=64, N=128, G=8),
    "nano4b_r": dict(H=24, P=80, N=128, G=2),
    "super120b_r": dict(H=16, P=64, N=128, G=1),
}


class Family:
    """Parameters, fresh token inputs and the conventional step for one Mamba-2 layer."""

    def __init__(self, gen, H, P, N, G, dt_softplus=True):
        self.gen, self.H, self.P, self.N, self.G = gen, H, P, N, G
        self.A = -rand(gen, H, lo=0.5, hi=1.5)
        self.D = randn(gen, H)
        self.dt_bias = rand(gen, H, lo=-0.25, hi=0.25)
        self.dt_softplus = dt_softplus  # softplus(dt + bias) in [0.01, 0.39] -> alpha in [0.56, 1)

    def tokens(self, t, batch=None):
        lead = (t,) if batch is None else (batch, t)
        g, H, P, N, G = self.gen, self.H, self.P, self.N, self.G
        return dict(
            x=randn(g, *lead, H, P),
            dt=rand(g, *lead, H, lo=-4.0, hi=-1.0),
            B=randn(g, *lead, G, N) * N**-0.5,
            C=randn(g, *lead, G, N) * N**-0.5,
            z=randn(g, *lead, H, P),
        )

    def state(self, *lead):
        return randn(self.gen, *lead, self.H, self.P, self.N)

    def conv(self, state, x, dt, B, C, z):
        y, s = mamba2_step(
            state[None],
            x[None],
            dt[None],
            self.A,
            B[None],
            C[None],
            self.D,
            z[None],
            self.dt_bias,
            self.dt_softplus,
        )
        return y[0], s[0]

    def sequence(self, checkpoint, L, T=4):
        return Mamba2Sequence(checkpoint, self.A, self.D, self.dt_bias, self.dt_softplus, L=L, T=T)


# ---------------------------------------------------------------------------------------------


def test_segment_decays_match_direct_products():
    gen = torch.Generator().manual_seed(1)
    for rest in [(3,), (2, 5)]:  # scalar per head (Mamba-2/GDN), per channel (KDA)
        la = torch.log(rand(gen, 7, *rest, lo=0.5, hi=1.0))
        seg = segment_decays(la)
        assert seg.shape == (8, 8, *rest) and seg.dtype == F64
        alpha = torch.exp(la)
        for j in range(8):
            for i in range(8):
                if i > j:
                    assert torch.equal(seg[j, i], torch.zeros(rest, dtype=F64))
                    continue
                direct = torch.ones(rest, dtype=F64)
                for m in range(i + 1, j + 1):  # a(i+1:j), records are 1-based
                    direct = direct * alpha[m - 1]
                assert torch.allclose(seg[j, i], direct, rtol=1e-14, atol=0)
        assert torch.allclose(decays_to_end(la), seg[7], rtol=1e-14, atol=0)
    assert torch.equal(decays_to_end(torch.zeros(0, 3, dtype=F64)), torch.ones(1, 3, dtype=F64))


@pytest.mark.parametrize("gated", [True, False])
def test_step_matches_naive_per_head_loop(gated, assert_rel):
    gen = torch.Generator().manual_seed(2)
    fam = Family(gen, H=6, P=3, N=4, G=3, dt_softplus=gated)
    batch = 2
    state = fam.state(batch)
    tok = {k: v[:, 0] for k, v in fam.tokens(1, batch=batch).items()}
    D, z, bias = (fam.D, tok["z"], fam.dt_bias) if gated else (None, None, None)
    y, new = mamba2_step(state, tok["x"], tok["dt"], fam.A, tok["B"], tok["C"], D, z, bias, gated)
    y_ref, new_ref = torch.empty_like(y), torch.empty_like(new)
    for b in range(batch):
        for h in range(6):
            grp = h // 2  # H / G = 2 heads per group
            dt = tok["dt"][b, h] + (fam.dt_bias[h] if gated else 0.0)
            dt = torch.log1p(torch.exp(dt)) if gated else dt
            s = torch.exp(dt * fam.A[h]) * state[b, h] + torch.outer(
                dt * tok["x"][b, h], tok["B"][b, grp]
            )
            out = s @ tok["C"][b, grp]
            if gated:
                out = (out + fam.D[h] * tok["x"][b, h]) * z[b, h] * torch.sigmoid(z[b, h])
            new_ref[b, h], y_ref[b, h] = s, out
    assert_rel(y, y_ref, 1e-14, "y")
    assert_rel(new, new_ref, 1e-14, "state")
    assert not torch.equal(new, state)


def test_replay_output_fold_and_verify_functions(assert_rel):
    """The functional API without the sequence helper: prefixes of 12 records, then a tree."""
    gen = torch.Generator().manual_seed(3)
    fam = Family(gen, **SHAPES["nano4b_r"])
    s_c = fam.state()
    toks = fam.tokens(12)
    recs = mamba2_make_record(toks["x"], toks["dt"], fam.A, toks["B"], fam.dt_bias, True)
    assert isinstance(recs, Mamba2Records) and recs.n == 12
    state = s_c
    for j in range(12):
        one = mamba2_make_record(
            toks["x"][j], toks["dt"][j], fam.A, toks["B"][j], fam.dt_bias, True
        )
        assert one.n == 1 and torch.allclose(one.log_alpha, recs[j].log_alpha, rtol=1e-15)
        y_ref, state = fam.conv(state, **{k: v[j] for k, v in toks.items()})
        y = mamba2_replay_output(
            s_c, recs[: j + 1], toks["C"][j], toks["x"][j], fam.D, toks["z"][j]
        )
        assert_rel(y, y_ref, 1e-12, f"replay output {j}")
        assert_rel(mamba2_fold(s_c, recs[: j + 1]), state, 1e-12, f"fold {j}")
    # tree verify on top of 5 committed records: node j sees committed + its root path
    parents = [-1, 0, 0, -1, 2]
    drafts = fam.tokens(5)
    drecs = mamba2_make_record(drafts["x"], drafts["dt"], fam.A, drafts["B"], fam.dt_bias, True)
    ys = mamba2_verify(
        s_c, recs[:5], drecs, drafts["C"], drafts["x"], fam.D, drafts["z"], torch.tensor(parents)
    )
    base = mamba2_fold(s_c, recs[:5])
    for j, path in enumerate([[0], [0, 1], [0, 2], [3], [0, 2, 4]]):
        s = base
        for i in path:
            y_ref, s = fam.conv(s, **{k: v[i] for k, v in drafts.items()})
        assert_rel(ys[j], y_ref, 1e-12, f"tree node {j}")


@pytest.mark.parametrize("L", [1, 4, 16, 64])
def test_long_random_schedule(L, run_schedule):
    gen = torch.Generator().manual_seed(100 + L)
    ref_helpers.long_random_schedule(Family(gen, **SHAPES["nano4b_r"]), gen, L, run_schedule)


@pytest.mark.parametrize("L", [16, 64])
def test_spec_only_schedule_reaches_early_flush(L, run_schedule):
    gen = torch.Generator().manual_seed(400 + L)
    ref_helpers.spec_only_schedule(Family(gen, **SHAPES["nano4b_r"]), gen, L, run_schedule)


def test_long_random_schedule_super120b_ratio(run_schedule):
    gen = torch.Generator().manual_seed(7)
    fam = Family(gen, **SHAPES["super120b_r"])
    state = fam.state()
    stats = run_schedule(fam.sequence(state, L=16), state, fam.conv, fam.tokens, gen, 240)
    assert stats["window"] > 0 and stats["tree"] > 0


@pytest.mark.parametrize("shape", ["nano4b", "super120b"])
def test_full_head_shapes(shape, run_schedule):
    gen = torch.Generator().manual_seed(11)
    fam = Family(gen, **SHAPES[shape])
    ref_helpers.full_head_schedule(fam, gen, run_schedule)


@pytest.mark.parametrize("shape", ["nano4b", "super120b"])
def test_full_head_shapes_batched_pool_vs_replay(shape, assert_rel):
    """Batch 3 (one padded row) through the pool step vs two per-sequence replays (L = 4)."""
    gen = torch.Generator().manual_seed(12)
    fam = Family(gen, **SHAPES[shape])

    def step_pool(pool, slots, x, dt, B, C, z):
        return mamba2_step_pool(pool, slots, x, dt, fam.A, B, C, fam.D, z, fam.dt_bias, True)

    ref_helpers.batched_pool_vs_replay(fam, step_pool, assert_rel)


@pytest.mark.parametrize("pool_dtype", [F64, torch.float32])
@pytest.mark.parametrize("pad_slot_id", [-1, 0])
def test_pool_matches_step_and_leaves_other_slots(pool_dtype, pad_slot_id, assert_rel):
    gen = torch.Generator().manual_seed(5)
    fam = Family(gen, H=8, P=16, N=32, G=2)
    pool = fam.state(7).to(pool_dtype)
    before = pool.clone()
    slots = torch.tensor([4, pad_slot_id, 2, 6, pad_slot_id, 1])
    tok = {k: v[:, 0] for k, v in fam.tokens(1, batch=6).items()}
    args = (fam.A, tok["B"], tok["C"], fam.D, tok["z"], fam.dt_bias, True)
    y = mamba2_step_pool(pool, slots, tok["x"], tok["dt"], *args, pad_slot_id=pad_slot_id)
    assert y.dtype == F64 and pool.dtype == pool_dtype
    live = [0, 2, 3, 5]
    y_ref, new_ref = mamba2_step(
        before[slots[live]],
        *(tok[k][live] for k in ("x", "dt")),
        fam.A,
        *(tok[k][live] for k in ("B", "C")),
        fam.D,
        tok["z"][live],
        fam.dt_bias,
        True,
    )
    assert torch.equal(y[[1, 4]], torch.zeros_like(y[[1, 4]]))
    assert_rel(y[live], y_ref, 1e-14, "pool y")
    assert torch.equal(pool[slots[live]], new_ref.to(pool_dtype))
    for s in {0, 3, 5} - {pad_slot_id}:
        assert torch.equal(pool[s], before[s]), f"slot {s} was touched"
    if pad_slot_id == 0:
        assert torch.equal(pool[0], before[0])


def test_low_precision_inputs_compute_in_float64(assert_rel):
    gen = torch.Generator().manual_seed(6)
    fam = Family(gen, H=4, P=8, N=16, G=2)
    s32 = fam.state(1).float()
    tok = {k: v[:, 0].float() for k, v in fam.tokens(1, batch=1).items()}
    y, new = mamba2_step(s32, tok["x"], tok["dt"], fam.A.float(), tok["B"], tok["C"])
    assert y.dtype == F64 and new.dtype == F64
    y64, _ = mamba2_step(
        s32.double(),
        *(tok[k].double() for k in ("x", "dt")),
        fam.A.float(),
        *(tok[k].double() for k in ("B", "C")),
    )
    assert_rel(y, y64, 1e-15, "fp32 inputs")
    rec = mamba2_make_record(tok["x"][0], tok["dt"][0], fam.A, tok["B"][0])
    assert all(t.dtype == F64 for t in (rec.dt_eff, rec.log_alpha, rec.x, rec.B))


def test_bad_inputs_raise_naming_the_argument():
    gen = torch.Generator().manual_seed(8)
    fam = Family(gen, H=4, P=8, N=16, G=2)
    state = fam.state(2)
    t = {k: v[:, 0] for k, v in fam.tokens(1, batch=2).items()}
    with pytest.raises(ValueError, match="^x: expected shape"):
        mamba2_step(state, t["x"][:, :, :4], t["dt"], fam.A, t["B"], t["C"])
    with pytest.raises(ValueError, match="^dt: expected shape"):
        mamba2_step(state, t["x"], t["dt"][:, :3], fam.A, t["B"], t["C"])
    with pytest.raises(ValueError, match="^B: ngroups G"):
        mamba2_step(state, t["x"], t["dt"], fam.A, randn(gen, 2, 3, 16), randn(gen, 2, 3, 16))
    with pytest.raises(ValueError, match="^D: expected shape"):
        mamba2_step(state, t["x"], t["dt"], fam.A, t["B"], t["C"], D=fam.D[:2])
    pool = fam.state(3)
    before = pool.clone()
    args = (t["x"], t["dt"], fam.A, t["B"], t["C"])
    with pytest.raises(ValueError, match=r"^slot_indices: expected values in \[0, 3\).* got 3"):
        mamba2_step_pool(pool, torch.tensor([0, 3]), *args)
    with pytest.raises(ValueError, match="^slot_indices: expected values.* got -2"):
        mamba2_step_pool(pool, torch.tensor([-2, 1]), *args)
    with pytest.raises(ValueError, match="^slot_indices: slot 1 appears twice"):
        mamba2_step_pool(pool, torch.tensor([1, 1]), *args)
    with pytest.raises(ValueError, match="^slot_indices: expected an integer dtype"):
        mamba2_step_pool(pool, torch.tensor([0.0, 1.0]), *args)
    assert torch.equal(pool, before)
    # padding may repeat; two pad rows leave the pool untouched and give zeros
    y = mamba2_step_pool(pool, torch.tensor([-1, -1]), *args)
    assert torch.equal(pool, before) and torch.equal(y, torch.zeros_like(y))

    seq = fam.sequence(state[0], L=4, T=3)
    d = fam.tokens(3)
    with pytest.raises(ValueError, match="^drafts: expected 1..3"):
        seq.verify(**fam.tokens(4))
    with pytest.raises(ValueError, match=r"^parents: parents\[1\]"):
        seq.verify(parents=[-1, 1, 0], **d)
    seq.verify(**d)
    with pytest.raises(RuntimeError):
        seq.step(**{k: v[0] for k, v in d.items()})
    with pytest.raises(ValueError, match="^accepted: expected a count in"):
        seq.commit(4)
    with pytest.raises(ValueError, match="^accepted: .* not a root-to-node path"):
        seq.commit([0, 2])
    seq.commit(3)
    assert seq.n == 3
    seq.verify(parents=[-1, 0, -1], **d)
    with pytest.raises(ValueError, match="^accepted: a tree verify needs"):
        seq.commit(1)
    with pytest.raises(ValueError, match="^accepted: .* not a root-to-node path"):
        seq.commit([1])
    seq.commit([2])
    assert seq.n == 4
    with pytest.raises(RuntimeError):
        seq.commit(0)


def test_early_flush_boundary_and_drop_pending(assert_rel):
    gen = torch.Generator().manual_seed(13)
    ref_helpers.early_flush_boundary(Family(gen, H=4, P=8, N=16, G=2), gen, assert_rel)
