"""Speculative decoding on the torch path (replayssm_jit/ops/verify.py, ops/torch_path/) against the
float64 oracles, per docs/speculative.md.

Every schedule runs on a pool whose rings start poisoned with NaN (a read of a row no record was
written to reaches the outputs) and whose unnamed slots must stay bit for bit as they were. Each
named slot has its own reference sequence (Mamba2Sequence / GDNSequence); after every call the
outputs, the cursor words (records held, epoch, scratch, pending drafts) and the checkpoint are
compared with it, the epoch with a count kept apart from both.
"""

from __future__ import annotations

import math
import random
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    KDADecodeCache,
    KDADecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
    commit_drafts,
    commit_snapshots,
    gdn_decode,
    gdn_layout,
    gdn_snapshot_verify,
    gdn_verify,
    kda_decode,
    kda_layout,
    kda_snapshot_verify,
    kda_verify,
    mamba2_decode,
    mamba2_layout,
    mamba2_snapshot_verify,
    mamba2_verify,
    plan_decode,
)
from replayssm_jit.core import codecs
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.torch_path import Pool, Rows
from replayssm_jit.reference import (
    GDNSequence,
    KDASequence,
    Mamba2Sequence,
    gdn_gates,
    gdn_step,
    kda_gates,
    kda_step,
    mamba2_step,
    root_path,
)

F32, F64, I32 = torch.float32, torch.float64, torch.int32
NUM_SLOTS = 8
NAMED = (1, 2, 3, 4)  # slots the schedules name; 5..7 never (0 may be the pad slot)
TOL = 1e-5

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")  # tiny tensors


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def assert_rel(actual, expected, what, tol=TOL):
    a, e = actual.to(F64), expected.to(F64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert bool(torch.isfinite(a).all()), f"{what}: non-finite values"
    ref = float(torch.linalg.vector_norm(e))
    assert ref > 0 and math.isfinite(ref), f"{what}: reference norm {ref}"
    err = float(torch.linalg.vector_norm(a - e)) / ref
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that NaN compares equal to itself."""
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def clone(tensors: dict) -> dict:
    return {k: t.clone() for k, t in tensors.items()}


def assert_slots_unchanged(tensors, before, slots, what):
    for s in slots:
        for name, t in tensors.items():
            assert same_bits(t[s], before[name][s]), f"{what}: {name} of slot {s} changed"


def int32_rows(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=I32)


# ---------------------------------------------------------------------------------------------
# Families: layout, parameters, fresh inputs, the ops and the float64 oracles
# ---------------------------------------------------------------------------------------------


class Mamba2:
    name = "mamba2"
    options: ClassVar[dict] = dict(has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    verify_op, decode_op, snapshot_op = (staticmethod(mamba2_verify), staticmethod(mamba2_decode),
                                         staticmethod(mamba2_snapshot_verify))  # fmt: skip
    H, G, P, N = 4, 2, 8, 16
    out_row = (H, P)

    def layout(self, L, T, state_dtype=F32):
        return mamba2_layout(num_heads=self.H, headdim=self.P, dstate=self.N, ngroups=self.G,
                             window=L, drafts=T, act_dtype=F32,
                             state_dtype=state_dtype)  # fmt: skip

    def params(self, gen):
        self.A = -(0.5 + 1.5 * torch.rand(self.H, generator=gen))
        self.D = torch.randn(self.H, generator=gen)
        self.dt_bias = torch.rand(self.H, generator=gen) - 0.5

    def tokens(self, gen, *lead):
        H, G, P, N = self.H, self.G, self.P, self.N
        return dict(
            x=torch.randn(*lead, H, P, generator=gen),
            dt=-3.0 + 3.5 * torch.rand(*lead, H, generator=gen),
            B=0.5 * torch.randn(*lead, G, N, generator=gen),
            C=0.5 * torch.randn(*lead, G, N, generator=gen),
            z=torch.randn(*lead, H, P, generator=gen),
        )

    def layer(self):
        return dict(A=self.A, D=self.D, dt_bias=self.dt_bias)

    def ref_inputs(self, tok, index):
        return {k: v[index] for k, v in tok.items()}

    def sequence(self, checkpoint, L, T):
        return Mamba2Sequence(checkpoint, self.A, self.D, self.dt_bias, True, L=L, T=T)

    def conv(self, state, x, dt, B, C, z):
        y, s = mamba2_step(state[None], x[None], dt[None], self.A, B[None], C[None], self.D,
                           z[None], self.dt_bias, True)  # fmt: skip
        return y[0], s[0]


class GDN:
    name = "gdn"
    options: ClassVar[dict] = dict(use_qk_l2norm=True, gates_in_kernel=True)
    verify_op, decode_op, snapshot_op = (staticmethod(gdn_verify), staticmethod(gdn_decode),
                                         staticmethod(gdn_snapshot_verify))  # fmt: skip
    H, HV, K, V = 2, 4, 16, 8
    out_row = (HV, V)

    def layout(self, L, T, state_dtype=F32):
        return gdn_layout(num_k_heads=self.H, num_v_heads=self.HV, head_k_dim=self.K,
                          head_v_dim=self.V, window=L, drafts=T, act_dtype=F32,
                          state_dtype=state_dtype)  # fmt: skip

    def params(self, gen):
        self.A_log = torch.log(0.5 + torch.rand(self.HV, generator=gen))
        self.dt_bias = torch.rand(self.HV, generator=gen) - 0.5

    def tokens(self, gen, *lead):
        H, HV, K, V = self.H, self.HV, self.K, self.V
        return dict(
            q=torch.randn(*lead, H, K, generator=gen),
            k=torch.randn(*lead, H, K, generator=gen),
            v=torch.randn(*lead, HV, V, generator=gen),
            a=-3.0 + 3.0 * torch.rand(*lead, HV, generator=gen),
            b=2.0 * torch.randn(*lead, HV, generator=gen),
        )

    def layer(self):
        return dict(A_log=self.A_log, dt_bias=self.dt_bias)

    def ref_inputs(self, tok, index):
        g, beta = gdn_gates(self.A_log, tok["a"][index], self.dt_bias, tok["b"][index])
        return dict(q=tok["q"][index], k=tok["k"][index], v=tok["v"][index], g=g, beta=beta)

    def sequence(self, checkpoint, L, T):
        return GDNSequence(checkpoint, scale=self.K**-0.5, use_qk_l2norm=True, L=L, T=T)

    def conv(self, state, q, k, v, g, beta):
        o, s = gdn_step(state[None], q[None], k[None], v[None], g[None], beta[None])
        return o[0], s[0]


class KDA(GDN):
    """GDN's schedule with KDA's gates: a per key channel [..., HV, K], dt_bias [HV K], and
    decays near 1 (small A_log) so that the state carries the outputs."""

    name = "kda"
    verify_op, decode_op, snapshot_op = (staticmethod(kda_verify), staticmethod(kda_decode),
                                         staticmethod(kda_snapshot_verify))  # fmt: skip

    def layout(self, L, T, state_dtype=F32):
        return kda_layout(num_k_heads=self.H, num_v_heads=self.HV, head_k_dim=self.K,
                          head_v_dim=self.V, window=L, drafts=T, act_dtype=F32,
                          state_dtype=state_dtype)  # fmt: skip

    def params(self, gen):
        self.A_log = torch.log(0.05 + 0.2 * torch.rand(self.HV, generator=gen))
        self.dt_bias = 0.5 * torch.rand(self.HV * self.K, generator=gen) - 0.25

    def tokens(self, gen, *lead):
        tok = super().tokens(gen, *lead)
        tok["a"] = -3.0 + 3.0 * torch.rand(*lead, self.HV, self.K, generator=gen)
        return tok

    def ref_inputs(self, tok, index):
        g, beta = kda_gates(self.A_log, tok["a"][index], self.dt_bias, tok["b"][index])
        return dict(q=tok["q"][index], k=tok["k"][index], v=tok["v"][index], g=g, beta=beta)

    def sequence(self, checkpoint, L, T):
        return KDASequence(checkpoint, scale=self.K**-0.5, use_qk_l2norm=True, L=L, T=T)

    def conv(self, state, q, k, v, g, beta):
        o, s = kda_step(state[None], q[None], k[None], v[None], g[None], beta[None])
        return o[0], s[0]


FAMILIES = {"mamba2": Mamba2, "gdn": GDN, "kda": KDA}
over_families = pytest.mark.parametrize("fam", list(FAMILIES), indirect=True)


@pytest.fixture
def fam(request):
    return FAMILIES[request.param]()


def new_pool(fam, layout, gen) -> dict[str, torch.Tensor]:
    """Random checkpoints, rings poisoned with NaN, zero cursors."""
    tensors = layout.allocate(NUM_SLOTS, "cpu")
    tensors["state"].copy_(0.5 * torch.randn(tensors["state"].shape, generator=gen))
    for name in layout.ring_names:
        tensors[name].fill_(math.nan)
    return tensors


class Plans:
    """plan_decode per batch size (a plan fixes its batch)."""

    def __init__(self, fam, layout, pad, mode="replay"):
        self.fam, self.layout, self.pad, self.mode = fam, layout, pad, mode
        self.plans = {}

    def __call__(self, batch):
        if batch not in self.plans:
            self.plans[batch] = plan_decode(self.layout, batch, device="cpu", mode=self.mode,
                                            pad_slot_id=self.pad, **self.fam.options)  # fmt: skip
        return self.plans[batch]


def make_batch(rng: random.Random, pad: int) -> list[int]:
    rows = [s for s in NAMED if rng.random() > 0.25] or [rng.choice(NAMED)]
    for _ in range(rng.randint(0, 2)):
        rows.insert(rng.randint(0, len(rows)), pad)
    return rows


def random_parents(rng: random.Random, T: int) -> list[int]:
    return [rng.randint(-1, j - 1) for j in range(T)]


def chain_prefix(plist: list[int] | None, t: int) -> int:
    """The longest a such that drafts 0..a-1 are a root path (a fused commit is a chain)."""
    if plist is None:
        return t
    a = 0
    while a < t and plist[a] == a - 1:
        a += 1
    return a


# ---------------------------------------------------------------------------------------------
# The random schedule: verify (fused commit or not), commit (chain or tree), standard steps
# ---------------------------------------------------------------------------------------------


class Schedule:
    """One pool and one reference sequence per named slot, stepped side by side."""

    def __init__(self, fam, *, L, T, pad, seed):
        self.fam, self.L, self.T, self.pad = fam, L, T, pad
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        fam.params(self.gen)
        self.layout = fam.layout(L, T)
        self.tensors = new_pool(fam, self.layout, self.gen)
        self.plans = Plans(fam, self.layout, pad)
        self.seqs = {s: fam.sequence(self.tensors["state"][s], L, T) for s in NAMED}
        self.pending: dict[int, tuple[int, list[int] | None] | None] = dict.fromkeys(NAMED)
        self.epochs = dict.fromkeys(NAMED, 0)
        self.stats = dict(verify=0, fused=0, commit=0, tree_commit=0, step=0, early=0,
                          zero_drafts=0, step_flush=0, max_held=0)  # fmt: skip

    def check_slot(self, s, *, pending, flushed, before, what):
        seq = self.seqs[s]
        want = [seq.n, self.epochs[s], 0, pending]
        got = self.tensors["cursors"][s].tolist()
        assert got == want, f"{what}: cursor of slot {s} {got}, expected {want}"
        self.stats["max_held"] = max(self.stats["max_held"], seq.n)
        if flushed:
            assert_rel(self.tensors["state"][s], seq.checkpoint, f"{what}: checkpoint {s}")
        else:
            assert same_bits(self.tensors["state"][s], before["state"][s]), f"{what}: state {s}"

    def verify(self, it, rows):
        fam, T, L, rng = self.fam, self.T, self.L, self.rng
        batch = len(rows)
        fused = rng.random() < 0.5
        per_row = rng.random() < 0.7
        tree = rng.random() < 0.5
        drafts = [rng.choice([0, *range(1, T + 1), T]) if per_row else T for _ in rows]
        plists = [random_parents(rng, T) if tree and rng.random() < 0.8 else None for _ in rows]
        accepted = []
        for s in rows:  # (a pad row's count is never read: any value will do)
            p = self.pending.get(s)
            if s == self.pad:
                accepted.append(7)
            else:
                accepted.append(rng.randint(0, chain_prefix(p[1], p[0])) if p else 0)
        tok = fam.tokens(self.gen, batch, T)
        kwargs = {}
        if per_row:
            kwargs["num_drafts"] = torch.tensor(drafts, dtype=I32)
        if tree:
            kwargs["parents"] = int32_rows([p or list(range(-1, T - 1)) for p in plists])
        if fused:
            kwargs["num_accepted"] = torch.tensor(accepted, dtype=I32)
        before = clone(self.tensors)
        out = fam.verify_op(self.plans(batch), **self.tensors, **tok, **fam.layer(),
                            slot_indices=torch.tensor(rows, dtype=I32), **kwargs)  # fmt: skip
        what = f"iter {it} verify"
        self.stats["verify"] += 1
        self.stats["fused"] += int(fused)
        for b, s in enumerate(rows):
            if s == self.pad:
                assert bool((out[b] == 0).all()), f"{what}: pad row {b}"
                continue
            seq, t = self.seqs[s], drafts[b]
            if fused and self.pending[s]:
                seq.commit(list(range(accepted[b])))
            else:
                seq.drop_pending()
            early = seq.n + t >= L + T
            if t:
                ref_tok = fam.ref_inputs(tok, (b, slice(0, t)))
                plist = None if plists[b] is None else plists[b][:t]
                ys = seq.verify(parents=plist, **ref_tok)
                assert_rel(out[b, :t], ys, f"{what}: row {b} (slot {s}) drafts")
            assert bool((out[b, t:] == 0).all()), f"{what}: row {b} drafts past t = {t}"
            self.pending[s] = (t, plists[b][:t] if plists[b] else None) if t else None
            self.stats["zero_drafts"] += int(t == 0)
            self.stats["early"] += int(early)
            self.epochs[s] += int(early)
            self.check_slot(s, pending=t, flushed=early, before=before, what=what)
        return before

    def commit(self, it, rows):
        rng, T = self.rng, self.T
        paths = []
        for s in rows:
            p = self.pending.get(s)
            if not p:
                paths.append([])
            elif p[1] is None:
                paths.append(list(range(rng.randint(0, p[0]))))
            else:  # mostly a path that needs compaction (not drafts 0..a-1)
                moved = [j for j in range(p[0]) if root_path(p[1], j) != list(range(j + 1))]
                pick = moved and rng.random() < 0.7
                node = rng.choice(moved) if pick else rng.randint(-1, p[0] - 1)
                paths.append([] if node < 0 else root_path(p[1], node))
        use_path = any(self.pending.get(s) and self.pending[s][1] for s in rows) or (
            rng.random() < 0.3
        )
        kwargs = {}
        if use_path:
            filler = rng.choice([0, T - 1])  # entries past a are never read
            kwargs["accepted_path"] = int32_rows([p + [filler] * (T - len(p)) for p in paths])
        accepted = torch.tensor([len(p) for p in paths], dtype=I32)
        before = clone(self.tensors)
        commit_drafts(self.plans(len(rows)), self.tensors, num_accepted=accepted,
                      slot_indices=torch.tensor(rows, dtype=I32), **kwargs)  # fmt: skip
        what = f"iter {it} commit"
        self.stats["commit"] += 1
        for b, s in enumerate(rows):
            if s == self.pad:
                continue
            seq, path, n = self.seqs[s], paths[b], self.seqs[s].n
            if self.pending[s]:
                seq.commit(path)
                tree = self.pending[s][1] is not None
                self.stats["tree_commit"] += int(tree and path != list(range(len(path))))
            self.pending[s] = None
            self.check_slot(s, pending=0, flushed=False, before=before, what=what)
            for name in self.layout.ring_names:  # compaction: row n + i <- row n + path[i]
                ring, old = self.tensors[name][s], before[name][s]
                for i, j in enumerate(path):
                    assert same_bits(ring[:, n + i], old[:, n + j]), f"{what}: {name} row {n + i}"
                rest = [r for r in range(self.layout.capacity) if not n <= r < n + len(path)]
                assert same_bits(ring[:, rest], old[:, rest]), f"{what}: {name} other rows"
        return before

    def step(self, it, rows):
        fam = self.fam
        tok = fam.tokens(self.gen, len(rows))
        before = clone(self.tensors)
        # num_accepted=0: pending drafts rejected explicitly (a plain step refuses to drop them)
        out = fam.decode_op(self.plans(len(rows)), **self.tensors, **tok, **fam.layer(),
                            slot_indices=torch.tensor(rows, dtype=I32),
                            num_accepted=torch.zeros(len(rows), dtype=I32))  # fmt: skip
        what = f"iter {it} step"
        self.stats["step"] += 1
        for b, s in enumerate(rows):
            if s == self.pad:
                assert bool((out[b] == 0).all()), f"{what}: pad row {b}"
                continue
            seq = self.seqs[s]
            seq.drop_pending()  # a verify whose commit never came
            y = seq.step(**fam.ref_inputs(tok, b))
            assert_rel(out[b], y, f"{what}: row {b} (slot {s})")
            self.pending[s] = None
            self.epochs[s] += int(seq.last_step_flushed)
            self.stats["step_flush"] += int(seq.last_step_flushed)
            self.check_slot(s, pending=0, flushed=seq.last_step_flushed, before=before,
                            what=what)  # fmt: skip
        return before

    def run(self, steps):
        kind = "step"
        for it in range(steps):
            rows = make_batch(self.rng, self.pad)
            if kind == "verify" and self.rng.random() < 0.5:
                kind = "commit"  # (most verifies are followed by their commit)
            else:
                kind = self.rng.choice(["verify", "verify", "verify", "commit", "step"])
            before = getattr(self, kind)(it, rows)
            unnamed = [s for s in range(NUM_SLOTS) if s not in rows or s == self.pad]
            assert_slots_unchanged(self.tensors, before, unnamed, f"iter {it} {kind}")
        return self.stats


@over_families
@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("pad", [-1, 0])
def test_random_schedule_matches_reference(fam, L, T, pad):
    stats = Schedule(fam, L=L, T=T, pad=pad, seed=100 * L + 10 * T + pad).run(45)
    assert stats["verify"] and stats["fused"] and stats["commit"] and stats["step"], stats
    assert stats["early"] and stats["zero_drafts"] and stats["tree_commit"], stats
    assert stats["max_held"] >= L, stats  # commits beyond the window


# ---------------------------------------------------------------------------------------------
# Targeted cases
# ---------------------------------------------------------------------------------------------


def _setup(fam, L, T, seed, pad=-1):
    gen = torch.Generator().manual_seed(seed)
    fam.params(gen)
    layout = fam.layout(L, T)
    return gen, layout, new_pool(fam, layout, gen), Plans(fam, layout, pad)


def _verify(fam, plans, tensors, gen, rows, **kwargs):
    T = plans.layout.drafts
    tok = fam.tokens(gen, len(rows), T)
    out = fam.verify_op(plans(len(rows)), **tensors, **tok, **fam.layer(),
                        slot_indices=torch.tensor(rows, dtype=I32), **kwargs)  # fmt: skip
    return tok, out


@over_families
def test_early_flush_boundary_both_ways(fam):
    """From n = L + 1 committed records in two slots, one verify: t = T - 2 (n + t = L + T - 1)
    holds them, t = T - 1 (n + t = L + T) folds them first: cursor words, checkpoints and outputs
    as the reference's."""
    L, T = 4, 4
    gen, layout, tensors, plans = _setup(fam, L, T, 1)
    seqs = {s: fam.sequence(tensors["state"][s], L, T) for s in (1, 2)}
    for accept in (3, 2):  # n = 3, then 5 = L + 1
        tok, _ = _verify(fam, plans, tensors, gen, [1, 2])
        commit_drafts(plans(2), tensors, num_accepted=torch.tensor([accept, accept], dtype=I32),
                      slot_indices=torch.tensor([1, 2], dtype=I32))  # fmt: skip
        for b, s in enumerate((1, 2)):
            seqs[s].verify(**fam.ref_inputs(tok, (b, slice(0, T))))
            seqs[s].commit(accept)
    assert tensors["cursors"][1:3].tolist() == [[L + 1, 0, 0, 0]] * 2
    before = clone(tensors)
    drafts = torch.tensor([T - 2, T - 1], dtype=I32)
    tok, out = _verify(fam, plans, tensors, gen, [1, 2], num_drafts=drafts)
    for b, (s, t) in enumerate(((1, T - 2), (2, T - 1))):
        ys = seqs[s].verify(**fam.ref_inputs(tok, (b, slice(0, t))))
        assert_rel(out[b, :t], ys, f"slot {s} drafts")
        assert bool((out[b, t:] == 0).all())
    assert seqs[1].n == L + 1 and seqs[2].n == 0
    assert tensors["cursors"][1].tolist() == [L + 1, 0, 0, T - 2]  # held, no flush
    assert tensors["cursors"][2].tolist() == [0, 1, 0, T - 1]  # folded, epoch advanced
    assert same_bits(tensors["state"][1], before["state"][1])
    assert_rel(tensors["state"][2], seqs[2].checkpoint, "folded checkpoint")
    # The drafts' records at rows n + j: after the flush from row 0.
    name = layout.ring_names[-1]  # the scalar ring (dt or g) is written for every draft
    assert bool(torch.isfinite(tensors[name][1][:, L + 1 : L + T - 1]).all())
    assert same_bits(tensors[name][1][:, L + T - 1 :], before[name][1][:, L + T - 1 :])
    assert bool(torch.isfinite(tensors[name][2][:, : T - 1]).all())


@over_families
def test_tree_commit_compacts_the_path(fam):
    """A tree verify, then commit of the path 1 -> 2 -> 3 (draft 0 rejected): every ring's rows
    n + 1.. n + 3 move to n .. n + 2, nothing else moves; the next step sees exactly the path."""
    L, T = 4, 4
    gen, layout, tensors, plans = _setup(fam, L, T, 2)
    seq = fam.sequence(tensors["state"][3], L, T)
    tok, _ = _verify(fam, plans, tensors, gen, [3])  # a chain of 2 committed: n = 2
    seq.verify(**fam.ref_inputs(tok, (0, slice(0, T))))
    commit_drafts(plans(1), tensors, num_accepted=torch.tensor([2], dtype=I32),
                  slot_indices=torch.tensor([3], dtype=I32))  # fmt: skip
    seq.commit(2)
    parents = [-1, -1, 1, 2]
    tok, out = _verify(fam, plans, tensors, gen, [3], parents=int32_rows([parents]))
    assert_rel(out[0], seq.verify(parents=parents, **fam.ref_inputs(tok, 0)), "tree outputs")
    before = clone(tensors)
    commit_drafts(plans(1), tensors, num_accepted=torch.tensor([3], dtype=I32),
                  slot_indices=torch.tensor([3], dtype=I32),
                  accepted_path=int32_rows([[1, 2, 3, 0]]))  # fmt: skip
    seq.commit([1, 2, 3])
    assert tensors["cursors"][3].tolist() == [5, 0, 0, 0]
    for name in layout.ring_names:
        ring, old = tensors[name][3], before[name][3]
        assert same_bits(ring[:, 2:5], old[:, 3:6]), name
        assert same_bits(ring[:, :2], old[:, :2]) and same_bits(ring[:, 5:], old[:, 5:]), name
    step = fam.tokens(gen, 1)
    out = fam.decode_op(plans(1), **tensors, **step, **fam.layer(),
                        slot_indices=torch.tensor([3], dtype=I32))  # fmt: skip
    assert_rel(out[0], seq.step(**fam.ref_inputs(step, 0)), "step after the tree commit")
    assert tensors["cursors"][3].tolist() == [0, 1, 0, 0]  # 5 + 1 >= L: flushed
    assert_rel(tensors["state"][3], seq.checkpoint, "checkpoint")


@over_families
def test_uncommitted_verify_then_standard_step(fam):
    """A verify whose commit never comes: a plain step refuses to drop its drafts silently; with
    num_accepted=0 it rejects them (word 3 back to 0) and replays only the committed records."""
    L, T = 4, 3
    gen, _, tensors, plans = _setup(fam, L, T, 3, pad=0)
    seq = fam.sequence(tensors["state"][1], L, T)
    step = fam.tokens(gen, 2)
    fam.decode_op(plans(2), **tensors, **step, **fam.layer(),
                  slot_indices=torch.tensor([0, 1], dtype=I32))  # fmt: skip
    seq.step(**fam.ref_inputs(step, 1))
    tok, out = _verify(fam, plans, tensors, gen, [1, 0])
    assert bool((out[1] == 0).all())
    assert_rel(out[0], seq.verify(**fam.ref_inputs(tok, 0)), "drafts")
    assert tensors["cursors"][1].tolist() == [1, 0, 0, T]
    seq.drop_pending()
    step = fam.tokens(gen, 1)
    with pytest.raises(ValueError, match="num_accepted: expected the accepted counts"):
        fam.decode_op(plans(1), **tensors, **step, **fam.layer(),
                      slot_indices=torch.tensor([1], dtype=I32))  # fmt: skip
    for i in range(3):  # held 1 -> 2 -> 3 -> flush (n + 1 >= L)
        step = fam.tokens(gen, 1)
        reject = {"num_accepted": torch.zeros(1, dtype=I32)} if i == 0 else {}
        out = fam.decode_op(plans(1), **tensors, **step, **fam.layer(),
                            slot_indices=torch.tensor([1], dtype=I32), **reject)  # fmt: skip
        assert_rel(out[0], seq.step(**fam.ref_inputs(step, 0)), "step")
        assert tensors["cursors"][1].tolist() == [seq.n, int(seq.n == 0), 0, 0]
    assert_rel(tensors["state"][1], seq.checkpoint, "checkpoint")


@over_families
def test_corrupted_cursors_fault_only_their_rows(fam):
    """n outside [0, L + T), p outside [0, T], or n + p > L + T - 1: in eager mode the ops raise
    a ValueError naming cursors and change nothing; the CPU path itself (what runs inside a
    graph's kernels) gives those rows NaN outputs and touches nothing of their slots. n = L + T
    - 1 with p = 0 is a state commits leave, not a fault."""
    L, T = 2, 3
    gen, layout, tensors, plans = _setup(fam, L, T, 4)
    bad = {1: [L + T, 0], 2: [0, T + 1], 3: [L, T], 4: [-1, 0]}
    for s, (n, p) in bad.items():
        tensors["cursors"][s, 0], tensors["cursors"][s, 3] = n, p
    tensors["cursors"][5, 0] = L + T - 1  # valid: n + p = L + T - 1
    for name in layout.ring_names:  # records to hold (the steps below read slots 3 and 5's)
        tensors[name].copy_(0.3 * torch.randn(tensors[name].shape, generator=gen))
    before = clone(tensors)
    for s in bad:
        with pytest.raises(
            ValueError, match=rf"^cursors: expected a cursor a step leaves in slot {s}"
        ):
            _verify(fam, plans, tensors, gen, [s, 5], num_accepted=torch.zeros(2, dtype=I32))
        with pytest.raises(
            ValueError, match=rf"^cursors: expected a cursor a step leaves in slot {s}"
        ):
            commit_drafts(plans(1), tensors, num_accepted=torch.zeros(1, dtype=I32),
                          slot_indices=torch.tensor([s], dtype=I32))  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"
    rows = [1, 2, 3, 4, 5]
    setup = torch_path.StepScalars(True, False, L, frozenset(plans(5).spec.flags), -1, 0, T)
    op = {
        "mamba2": torch_path.mamba2_verify,
        "gdn": torch_path.gdn_verify,
        "kda": torch_path.kda_verify,
    }[fam.name]
    out = torch.empty(5, T, *fam.out_row)
    op(
        setup,
        _torch_pool(tensors, layout),
        _torch_inputs(fam, fam.tokens(gen, 5, T)),
        Rows(torch.tensor(rows, dtype=I32), out, num_accepted=torch.zeros(5, dtype=I32)),
    )
    assert bool(torch.isnan(out[:4]).all()) and bool(torch.isfinite(out[4]).all())
    assert_slots_unchanged(tensors, before, [1, 2, 3, 4, 6, 7], "verify")
    assert tensors["cursors"][5].tolist() == [0, 1, 0, T]  # L + T - 1 + T >= L + T: flushed
    before = clone(tensors)
    torch_path.commit(
        setup,
        _torch_pool(tensors, layout),
        Rows(torch.tensor(rows, dtype=I32), num_accepted=torch.tensor([0, 0, 0, 0, 1], dtype=I32)),
        None,
    )
    assert_slots_unchanged(tensors, before, [1, 2, 3, 4, 6, 7], "commit")
    assert tensors["cursors"][5].tolist() == [1, 1, 0, 0]


@over_families
def test_device_values_are_clamped_by_the_cpu_path(fam):
    """What the kernels do with values the eager checks would refuse: num_drafts clamped to
    [0, T], a parent outside [-1, j) read as -1, num_accepted clamped to [0, p], a path index
    clamped into [0, p)."""
    L, T = 4, 3
    gen, layout, tensors, plans = _setup(fam, L, T, 5)
    twin = clone(tensors)
    setup = torch_path.StepScalars(True, False, L, frozenset(plans(2).spec.flags), -1, 0, T)
    tok = fam.tokens(gen, 2, T)
    op = {
        "mamba2": torch_path.mamba2_verify,
        "gdn": torch_path.gdn_verify,
        "kda": torch_path.kda_verify,
    }[fam.name]
    inputs = _torch_inputs(fam, tok)
    outs = []
    for pool, nd, par in ((tensors, [9, -4], [[-1, 5, 1], [-1, 0, -7]]),
                          (twin, [T, 0], [[-1, -1, 1], [-1, 0, -1]])):  # fmt: skip
        out = torch.empty(2, T, *fam.out_row)
        op(setup, _torch_pool(pool, layout), inputs,
           Rows(torch.tensor([1, 2], dtype=I32), out, num_drafts=torch.tensor(nd, dtype=I32),
                parents=int32_rows(par)))  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert all(same_bits(tensors[k], twin[k]) for k in tensors)
    for pool, acc, path in ((tensors, [5, 3], [[2, 9, 0], [0, 0, 0]]),
                            (twin, [T, 0], [[2, 2, 0], [0, 0, 0]])):  # fmt: skip
        torch_path.commit(setup, _torch_pool(pool, layout),
                          Rows(torch.tensor([1, 2], dtype=I32),
                               num_accepted=torch.tensor(acc, dtype=I32)),
                          int32_rows(path))  # fmt: skip
    assert all(same_bits(tensors[k], twin[k]) for k in tensors)


def _torch_pool(tensors, layout) -> Pool:
    """The torch path's pool of a layout's tensors: state, rings and cursors."""
    return Pool.named({n: tensors[n] for n in ("state", *layout.ring_names, "cursors")})


def _torch_inputs(fam, tok):
    """The bindings' inputs by name (torch_path.*_verify) of the ops' token inputs."""
    if fam.name == "mamba2":
        return dict(x=tok["x"], z=tok["z"], dt=tok["dt"], A=fam.A, D=fam.D, dt_bias=fam.dt_bias,
                    B=tok["B"], C=tok["C"])  # fmt: skip
    extra = {"lower_bound": 0.0} if fam.name == "kda" else {}
    return dict(q=tok["q"], k=tok["k"], v=tok["v"], gate_a=tok["a"], gate_b=tok["b"],
                A_log=fam.A_log, dt_bias=fam.dt_bias, scale=fam.K**-0.5, **extra)  # fmt: skip


@over_families
def test_early_flush_rounds_stochastically_by_the_epoch_read_first(fam):
    """A bf16 checkpoint's early flush with "sr": round_stochastic of the FP32 fold (from a twin
    pool with an FP32 checkpoint of the same values) with rounding_bits(seed, slot << 32 |
    epoch, element), the epoch as the verify read it."""
    L, T, seed = 2, 2, 2**62 + 7
    gen = torch.Generator().manual_seed(6)
    fam.params(gen)
    if fam.name == "mamba2":  # (16-bit state rows: a whole row tile)
        fam.P = 16
    else:
        fam.V = 16
    pools, plans = [], []
    for dtype in (torch.bfloat16, F32):
        layout = fam.layout(L, T, state_dtype=dtype)
        pools.append(new_pool(fam, layout, torch.Generator().manual_seed(7)))
        opts = dict(fam.options, stochastic_rounding=dtype != F32)
        plans.append(plan_decode(layout, 1, device="cpu", seed=seed, **opts))
    pools[1]["state"].copy_(pools[0]["state"].to(F32))
    for pool in pools:
        pool["cursors"][2, 1] = -3  # any epoch (int32)
    toks = [fam.tokens(gen, 1, T) for _ in range(2)]
    for i, tok in enumerate(toks):  # the second verify commits 2: n + t = L + T, a flush first
        outs = []
        for pool, plan in zip(pools, plans):
            accept = torch.tensor([0 if i == 0 else 2], dtype=I32)
            outs.append(fam.verify_op(plan, **pool, **tok, **fam.layer(), num_accepted=accept,
                                      slot_indices=torch.tensor([2], dtype=I32)))  # fmt: skip
        assert torch.equal(outs[0], outs[1])
    assert pools[0]["cursors"][2].tolist() == [0, -2, 0, T]
    element = torch.arange(pools[1]["state"][2].numel(), dtype=torch.int64)
    stream = torch.tensor(2 << 32, dtype=torch.int64) | -3  # (an int32 epoch sign-extends)
    rbits = codecs.rounding_bits(seed, stream, element)
    want = codecs.round_stochastic(pools[1]["state"][2].flatten(), rbits, torch.bfloat16)
    assert same_bits(pools[0]["state"][2].flatten(), want)


# ---------------------------------------------------------------------------------------------
# The conventional spec baseline
# ---------------------------------------------------------------------------------------------


@over_families
@pytest.mark.parametrize("pad", [-1, 0])
def test_snapshot_matches_reference_conventional_steps(fam, pad):
    """Each row's t drafts as a chain of the reference conventional step from its slot: outputs,
    and the state after draft j in snapshot_slots[b, j]; the live slots, the snapshot slots past
    t and every other slot untouched."""
    T = 3
    gen = torch.Generator().manual_seed(8)
    fam.params(gen)
    layout = fam.layout(4, T)
    tensors = new_pool(fam, layout, gen)
    state = {"state": tensors["state"]}
    num_slots = 14
    state["state"] = 0.5 * torch.randn(num_slots, *tensors["state"].shape[1:], generator=gen)
    plans = Plans(fam, layout, pad, mode="conventional")
    rows = [1, pad, 2, 3]
    drafts = [T, 2, 0, 2]
    snaps = [[4, 5, 6], [pad, pad, pad], [7, 8, 9], [10, 11, 12]]
    tok = fam.tokens(gen, 4, T)
    before = clone(state)
    out = fam.snapshot_op(plans(4), **state, **tok, **fam.layer(),
                          slot_indices=torch.tensor(rows, dtype=I32),
                          snapshot_slots=int32_rows(snaps),
                          num_drafts=torch.tensor(drafts, dtype=I32))  # fmt: skip
    written = set()
    for b, s in enumerate(rows):
        if s == pad:
            assert bool((out[b] == 0).all())
            continue
        ref = before["state"][s].to(F64)
        for j in range(drafts[b]):
            y, ref = fam.conv(ref, **fam.ref_inputs(tok, (b, j)))
            assert_rel(out[b, j], y, f"row {b} draft {j}")
            assert_rel(state["state"][snaps[b][j]], ref, f"row {b} snapshot {j}")
            written.add(snaps[b][j])
        assert bool((out[b, drafts[b] :] == 0).all())
    others = [s for s in range(num_slots) if s not in written]
    assert_slots_unchanged(state, before, others, "snapshot")


@over_families
def test_snapshot_baseline_agrees_with_verify_and_commit(fam):
    """100 random steps of the same drafts and accepted counts through ReplaySSM (verify, then
    commit_drafts or the next verify's fused commit; standard steps) and the conventional
    baseline (snapshot_verify, commit_snapshots; conventional steps): same outputs to 1e-5."""
    L, T, pad = 4, 3, 0
    gen = torch.Generator().manual_seed(9)
    rng = random.Random(9)
    fam.params(gen)
    layout = fam.layout(L, T)
    live = [1, 2, 3]
    replay = new_pool(fam, layout, gen)
    base = {"state": torch.zeros(4 + len(live) * T, *replay["state"].shape[1:])}
    base["state"][: NUM_SLOTS // 2] = replay["state"][: NUM_SLOTS // 2]
    snaps = int32_rows([[4 + T * i + j for j in range(T)] for i in range(len(live))]
                       + [[pad] * T])  # fmt: skip
    rows = torch.tensor([*live, pad], dtype=I32)
    replay_plan = plan_decode(layout, 4, device="cpu", pad_slot_id=pad, **fam.options)
    conv_plan = plan_decode(layout, 4, device="cpu", mode="conventional", pad_slot_id=pad,
                            **fam.options)  # fmt: skip
    owed = None  # accepted counts of the last verify, not committed yet
    for it in range(100):
        if rng.random() < 0.15:  # a standard step (the replay side commits what it owes first)
            if owed is not None:
                commit_drafts(replay_plan, replay, num_accepted=owed, slot_indices=rows)
                owed = None
            tok = fam.tokens(gen, 4)
            y1 = fam.decode_op(replay_plan, **replay, **tok, **fam.layer(), slot_indices=rows)
            y2 = fam.decode_op(conv_plan, **base, **tok, **fam.layer(), slot_indices=rows)
            assert_rel(y1[:3], y2[:3], f"step {it}")
            continue
        drafts = torch.tensor([rng.randint(0, T) for _ in range(4)], dtype=I32)
        tok = fam.tokens(gen, 4, T)
        fused = {} if owed is None or rng.random() < 0.5 else {"num_accepted": owed}
        if owed is not None and not fused:
            commit_drafts(replay_plan, replay, num_accepted=owed, slot_indices=rows)
        y1 = fam.verify_op(replay_plan, **replay, **tok, **fam.layer(), slot_indices=rows,
                           num_drafts=drafts, **fused)  # fmt: skip
        y2 = fam.snapshot_op(conv_plan, **base, **tok, **fam.layer(), slot_indices=rows,
                             snapshot_slots=snaps, num_drafts=drafts)  # fmt: skip
        if int(drafts[:3].sum()):
            assert_rel(y1[:3], y2[:3], f"verify {it}")
        assert bool((y1[3] == 0).all()) and bool((y2[3] == 0).all())
        owed = torch.tensor([rng.randint(0, int(t)) for t in drafts], dtype=I32)
        commit_snapshots(conv_plan, state=base["state"], snapshot_slots=snaps, num_accepted=owed,
                         slot_indices=rows)  # fmt: skip
    tok = fam.tokens(gen, 4, T)
    y1 = fam.verify_op(replay_plan, **replay, **tok, **fam.layer(), slot_indices=rows,
                       **({} if owed is None else {"num_accepted": owed}))  # fmt: skip
    y2 = fam.snapshot_op(conv_plan, **base, **tok, **fam.layer(), slot_indices=rows,
                         snapshot_slots=snaps)  # fmt: skip
    assert_rel(y1[:3], y2[:3], "final verify")


@pytest.mark.parametrize("pad", [-1, 0])
def test_commit_snapshots_copies_only_accepted_rows(pad):
    """Rows with a >= 1 copy snapshot a - 1 into their slot; a = 0 rows and pad rows copy
    nothing (their identity copies leave every bit), nor does a batch where no row accepts."""
    fam = Mamba2()
    layout = fam.layout(4, 3)
    plan = plan_decode(layout, 4, device="cpu", mode="conventional", pad_slot_id=pad,
                       **fam.options)  # fmt: skip
    state = torch.randn(12, *layout.tensors()[0].per_slot_shape)
    state[11] = math.nan  # bits an identity copy must keep
    rows = torch.tensor([1, pad, 2, 3], dtype=I32)
    snaps = int32_rows([[4, 5, 6], [11, 11, 11], [7, 8, 9], [10, 11, 9]])
    before = state.clone()
    commit_snapshots(plan, state=state, snapshot_slots=snaps, slot_indices=rows,
                     num_accepted=torch.tensor([2, 3, 0, 1], dtype=I32))  # fmt: skip
    assert same_bits(state[1], before[5]) and same_bits(state[3], before[10])
    keep = [s for s in range(12) if s not in (1, 3)]
    assert same_bits(state[keep], before[keep])
    before = state.clone()
    commit_snapshots(plan, state=state, snapshot_slots=snaps, slot_indices=rows,
                     num_accepted=torch.zeros(4, dtype=I32))  # fmt: skip
    assert same_bits(state, before)


# ---------------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------------


def _wrapper_call(fam, wrapper, tok, slots, **kwargs):
    """wrapper.verify with the family's positional inputs, the rest by name."""
    if fam.name == "mamba2":
        return wrapper.verify(tok["x"], tok["dt"], fam.A, tok["B"], tok["C"], slots, z=tok["z"],
                              D=fam.D, dt_bias=fam.dt_bias, **kwargs)  # fmt: skip
    return wrapper.verify(tok["q"], tok["k"], tok["v"], slots, a=tok["a"], b=tok["b"],
                          A_log=fam.A_log, dt_bias=fam.dt_bias, **kwargs)  # fmt: skip


WRAPPERS = {
    "mamba2": (Mamba2DecodeCache, Mamba2DecodeWrapper,
               dict(num_heads=4, headdim=8, dstate=16, ngroups=2)),
    "gdn": (GDNDecodeCache, GDNDecodeWrapper,
            dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)),
    "kda": (KDADecodeCache, KDADecodeWrapper,
            dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)),
}  # fmt: skip


@over_families
@pytest.mark.parametrize("graph", [False, True])
def test_wrappers_verify_and_commit(fam, graph):
    """verify() and commit() on the family's wrapper give the ops' results; with use_cuda_graph
    every verify writes the buffer fixed at plan()."""
    gen = torch.Generator().manual_seed(10)
    fam.params(gen)
    cache_cls, wrapper_cls, shape = WRAPPERS[fam.name]
    cache = cache_cls(4, **shape, window=4, drafts=3, act_dtype=F32, device="cpu")
    wrapper = wrapper_cls(cache, use_cuda_graph=graph)
    with pytest.raises(RuntimeError, match="^verify"):
        _wrapper_call(fam, wrapper, fam.tokens(gen, 2, 3), torch.zeros(2, dtype=I32))
    with pytest.raises(RuntimeError, match="^commit"):
        wrapper.commit(torch.zeros(2, dtype=I32), torch.zeros(2, dtype=I32))
    wrapper.plan(2, **fam.options)
    slots = cache.allocate(2)
    cache.reset(slots, 0.5 * torch.randn(2, *cache.state.shape[1:], generator=gen))
    seqs = [fam.sequence(cache.state[int(s)], 4, 3) for s in slots]
    outs = []
    for _ in range(3):
        tok = fam.tokens(gen, 2, 3)
        out = _wrapper_call(fam, wrapper, tok, slots, num_drafts=torch.tensor([3, 2], dtype=I32))
        outs.append(out)
        for b, seq in enumerate(seqs):
            t = 3 - b
            ys = seq.verify(**fam.ref_inputs(tok, (b, slice(0, t))))
            assert_rel(out[b, :t], ys, f"{fam.name} wrapper row {b}")
        wrapper.commit(torch.tensor([1, 2], dtype=I32), slots)
        seqs[0].commit(1)
        seqs[1].commit(2)
    assert cache.records_held(slots).tolist() == [seqs[0].n, seqs[1].n]
    assert (outs[0] is outs[1]) == graph


# ---------------------------------------------------------------------------------------------
# Bad arguments: a ValueError / TypeError naming the argument, raised before anything changes
# ---------------------------------------------------------------------------------------------

_CONTEXT: dict[str, tuple] = {}


def _context(name):
    """A pool after one verify of T = 3 drafts on slots 1 (t = 3) and 2 (t = 1): pending drafts
    for the commit and fused-commit checks. Built once per family."""
    if name not in _CONTEXT:
        fam = FAMILIES[name]()
        gen, layout, tensors, plans = _setup(fam, 4, 3, 11)
        _verify(fam, plans, tensors, gen, [1, 2], num_drafts=torch.tensor([3, 1], dtype=I32))
        conv = Plans(fam, layout, -1, mode="conventional")
        _CONTEXT[name] = fam, layout, tensors, plans, conv, gen
    return _CONTEXT[name]


def _bad_verify(fam, T, kind, row, j):
    """(override of the verify call's arguments, error type, argument named)."""
    lead = fam.tokens(torch.Generator().manual_seed(0), 2, T)
    first = "x" if fam.name == "mamba2" else "q"
    gate = "dt" if fam.name == "mamba2" else "a"
    parents = [[-1, 0, 1], [-1, 0, 1]]
    cases = {
        "drafts_over_T": ({first: fam.tokens(torch.Generator(), 2, T + 1)[first]}, ValueError,
                          first),
        "gate_over_T": ({gate: torch.zeros(2, T + 1, lead[gate].shape[-1])}, ValueError, gate),
        "act_dtype": ({first: lead[first].to(torch.bfloat16)}, TypeError, first),
        "gate_dtype": ({gate: lead[gate].double()}, TypeError, gate),
        "num_drafts_over_T": ({"num_drafts": torch.tensor([T + 1 + j, 0], dtype=I32).roll(row)},
                              ValueError, "num_drafts"),
        "num_drafts_negative": ({"num_drafts": torch.tensor([-1 - j, 1], dtype=I32).roll(row)},
                                ValueError, "num_drafts"),
        "num_drafts_dtype": ({"num_drafts": torch.ones(2, dtype=torch.int64)}, TypeError,
                             "num_drafts"),
        "num_drafts_shape": ({"num_drafts": torch.ones(3, dtype=I32)}, ValueError, "num_drafts"),
        "parent_not_earlier": ({"parents": _set(parents, row, j, j)}, ValueError, "parents"),
        "parent_below_minus_one": ({"parents": _set(parents, row, j, -2)}, ValueError, "parents"),
        "parents_shape": ({"parents": torch.full((2, T - 1), -1, dtype=I32)}, ValueError,
                          "parents"),
        "parents_strided": ({"parents": torch.full((T, 2), -1, dtype=I32).t()}, ValueError,
                            "parents"),
        "accepted_over_pending": ({"num_accepted": torch.tensor([4, 1], dtype=I32) if row == 0
                                   else torch.tensor([0, 2], dtype=I32)}, ValueError,
                                  "num_accepted"),
        "accepted_negative": ({"num_accepted": torch.tensor([-1, 0], dtype=I32).roll(row)},
                              ValueError, "num_accepted"),
        "accepted_dtype": ({"num_accepted": torch.zeros(2)}, TypeError, "num_accepted"),
        "out_shape": ({"out": torch.zeros(2, *fam.out_row)}, ValueError, "out"),
        "slot_twice": ({"slot_indices": torch.tensor([1, 1], dtype=I32)}, ValueError,
                       "slot_indices"),
        "seed_float": ({"seed": 1.5}, TypeError, "seed"),
    }  # fmt: skip
    return cases[kind]


def _set(rows, r, j, value):
    rows = [list(x) for x in rows]
    rows[r][j] = value
    return int32_rows(rows)


VERIFY_BAD = [
    "drafts_over_T", "gate_over_T", "act_dtype", "gate_dtype", "num_drafts_over_T",
    "num_drafts_negative", "num_drafts_dtype", "num_drafts_shape", "parent_not_earlier",
    "parent_below_minus_one", "parents_shape", "parents_strided", "accepted_over_pending",
    "accepted_negative", "accepted_dtype", "out_shape", "slot_twice", "seed_float",
]  # fmt: skip


@given(
    name=st.sampled_from(list(FAMILIES)),
    kind=st.sampled_from(VERIFY_BAD),
    row=st.integers(0, 1),
    j=st.integers(1, 2),
)
def test_verify_names_the_bad_argument(name, kind, row, j):
    fam, layout, tensors, plans, _, gen = _context(name)
    T = layout.drafts
    tok = fam.tokens(gen, 2, T)
    override, error, arg = _bad_verify(fam, T, kind, row, j)
    before = clone(tensors)
    args = dict(**tensors, **tok, **fam.layer(), slot_indices=torch.tensor([1, 2], dtype=I32))
    args.update(override)
    with pytest.raises(error, match=rf"^{arg}: expected"):
        fam.verify_op(plans(2), **args)
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"


COMMIT_BAD = {
    # (num_accepted, accepted_path or None, argument named); slot 1 has p = 3, slot 2 p = 1
    "accepted_over_pending": ([1, 2], None, "num_accepted"),
    "accepted_over_T": ([4, 0], None, "num_accepted"),
    "path_not_increasing": ([2, 0], [[1, 1, 0], [0, 0, 0]], "accepted_path"),
    "path_decreasing": ([2, 1], [[2, 1, 0], [0, 0, 0]], "accepted_path"),
    "path_past_pending": ([1, 1], [[0, 0, 0], [1, 0, 0]], "accepted_path"),
    "path_negative": ([1, 0], [[-1, 0, 0], [0, 0, 0]], "accepted_path"),
}


@given(name=st.sampled_from(list(FAMILIES)), kind=st.sampled_from(sorted(COMMIT_BAD)))
def test_commit_names_the_bad_argument(name, kind):
    _, _, tensors, plans, _, _ = _context(name)
    accepted, path, arg = COMMIT_BAD[kind]
    before = clone(tensors)
    with pytest.raises(ValueError, match=rf"^{arg}: expected"):
        commit_drafts(plans(2), tensors, num_accepted=torch.tensor(accepted, dtype=I32),
                      slot_indices=torch.tensor([1, 2], dtype=I32),
                      accepted_path=None if path is None else int32_rows(path))  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"


SNAPSHOT_BAD = {
    # (snapshot_slots, num_drafts or None, argument named); the rows' slots are 1 and 2
    "live_slot": ([[3, 4, 1], [5, 6, 7]], None, "snapshot_slots"),
    "twice": ([[3, 4, 5], [5, 6, 7]], None, "snapshot_slots"),
    "out_of_range": ([[3, 4, 8], [5, 6, 7]], None, "snapshot_slots"),
    "pad_id": ([[3, 4, -1], [5, 6, 7]], None, "snapshot_slots"),
    "drafts_over_T": ([[3, 4, 5], [6, 7, 0]], [4, 0], "num_drafts"),
}


@given(
    name=st.sampled_from(list(FAMILIES)),
    kind=st.sampled_from([*sorted(SNAPSHOT_BAD), "dtype", "shape"]),
)
def test_snapshot_names_the_bad_argument(name, kind):
    fam, layout, tensors, _, conv, gen = _context(name)
    state = {"state": tensors["state"]}
    tok = fam.tokens(gen, 2, layout.drafts)
    drafts, arg = None, "snapshot_slots"
    if kind == "dtype":
        snaps, error = torch.zeros(2, 3, dtype=torch.int64), TypeError
    elif kind == "shape":
        snaps, error = torch.zeros(2, 2, dtype=I32), ValueError
    else:
        rows, drafts, arg = SNAPSHOT_BAD[kind]
        snaps, error = int32_rows(rows), ValueError
        drafts = None if drafts is None else torch.tensor(drafts, dtype=I32)
    before = clone(tensors)
    with pytest.raises(error, match=rf"^{arg}: expected"):
        fam.snapshot_op(conv(2), **state, **tok, **fam.layer(), snapshot_slots=snaps,
                        slot_indices=torch.tensor([1, 2], dtype=I32),
                        num_drafts=drafts)  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"
    with pytest.raises(ValueError, match=r"^num_accepted: expected values in \[0, 3\]"):
        commit_snapshots(conv(2), state=tensors["state"], snapshot_slots=int32_rows([[3, 4, 5],
                         [5, 6, 7]]), num_accepted=torch.tensor([4, 0], dtype=I32),
                         slot_indices=torch.tensor([1, 2], dtype=I32))  # fmt: skip
    with pytest.raises(ValueError, match="^snapshot_slots: expected .* no row's slot_indices"):
        commit_snapshots(conv(2), state=tensors["state"], snapshot_slots=int32_rows([[3, 2, 5],
                         [5, 6, 7]]), num_accepted=torch.tensor([2, 0], dtype=I32),
                         slot_indices=torch.tensor([1, 2], dtype=I32))  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"


@over_families
def test_plans_that_cannot_verify_are_refused(fam):
    """T = 1 layouts, conventional plans for verify and commit, the other family's plan: a
    ValueError naming plan, before anything is read. The baseline takes plans of either mode."""
    gen = torch.Generator().manual_seed(12)
    fam.params(gen)
    one = fam.layout(4, 1)
    tensors = new_pool(fam, one, gen)
    tok = fam.tokens(gen, 1, 1)
    slots = torch.tensor([1], dtype=I32)
    plan = plan_decode(one, 1, device="cpu", **fam.options)
    with pytest.raises(ValueError, match=r"^plan: expected a layout with drafts in \[2, 8\]"):
        fam.verify_op(plan, **tensors, **tok, **fam.layer(), slot_indices=slots)
    layout = fam.layout(4, 2)
    tensors = new_pool(fam, layout, gen)
    tok = fam.tokens(gen, 1, 2)
    conv = plan_decode(layout, 1, device="cpu", mode="conventional", **fam.options)
    replay = plan_decode(layout, 1, device="cpu", **fam.options)
    with pytest.raises(ValueError, match="^plan: expected a plan of mode='replay'"):
        fam.verify_op(conv, **tensors, **tok, **fam.layer(), slot_indices=slots)
    with pytest.raises(ValueError, match="^plan: expected a plan of mode='replay'"):
        commit_drafts(conv, tensors, num_accepted=torch.zeros(1, dtype=I32), slot_indices=slots)
    for plan in (conv, replay):
        out = fam.snapshot_op(plan, state=tensors["state"], **tok, **fam.layer(),
                              slot_indices=slots, snapshot_slots=int32_rows([[2, 3]]))  # fmt: skip
        assert bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match=r"^plan: expected a layout with drafts in \[2, 8\]"):
        fam.snapshot_op(plan_decode(one, 1, device="cpu", mode="conventional", **fam.options),
                        state=new_pool(fam, one, gen)["state"], **fam.tokens(gen, 1, 1),
                        **fam.layer(), slot_indices=slots,
                        snapshot_slots=int32_rows([[2]]))  # fmt: skip
    other = next(f for f in FAMILIES.values() if f is not type(fam))()
    other_plan = plan_decode(other.layout(4, 2), 1, device="cpu", **other.options)
    with pytest.raises(ValueError, match="^plan: expected a"):
        fam.verify_op(other_plan, **tensors, **tok, **fam.layer(), slot_indices=slots)
    with pytest.raises(ValueError, match="^tensors: expected the layout's 'cursors' tensor"):
        commit_drafts(replay, {k: v for k, v in tensors.items() if k != "cursors"},
                      num_accepted=torch.zeros(1, dtype=I32), slot_indices=slots)  # fmt: skip
