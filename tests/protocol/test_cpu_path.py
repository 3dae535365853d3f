"""The torch path (replayssm_jit/ops/torch_path/) against the float64 oracles.

Every schedule runs on a pool of slots whose rings start poisoned with NaN (a read of a row that
was never written reaches the outputs) and whose outputs start as NaN: each step's named slots
are compared with a reference (ReplaySequence per slot, or the *_step_pool oracles in
conventional mode), the cursors with an independently kept expectation, the appended ring rows
with the inputs, and every slot no row names must stay bit for bit as it was.
"""

from __future__ import annotations

import ast
import math
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from replayssm_jit.core import codecs
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.torch_path.checkpoint import Copy
from replayssm_jit.ops.torch_path.protocol import Rows
from replayssm_jit.reference import (
    GDNSequence,
    KDASequence,
    Mamba2Sequence,
    gdn_gates,
    gdn_step_pool,
    kda_gates,
    kda_step_pool,
    mamba2_step_pool,
)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
SPARE = 4242  # cursor word 3 (pending drafts) before a slot's first step, which zeroes it
NUM_SLOTS = 6
SLOT_START = {1: 0, 2: 1, 3: 2, 4: 3}  # named slots, and the step each joins at (staggered)


# One intra-op thread (conftest's single_thread): tiny tensors, and threads contend on a busy box.
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """norm(actual - expected) / norm(expected) <= tol; fails on NaN / inf and on a zero
    reference."""
    a, e = actual.to(F64), expected.to(F64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert bool(torch.isfinite(a).all()), f"{what}: non-finite values"
    ref = float(torch.linalg.vector_norm(e))
    assert ref > 0 and math.isfinite(ref), f"{what}: reference norm {ref}"
    err = float(torch.linalg.vector_norm(a - e)) / ref
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (so that NaN compares equal to itself)."""
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.equal(raw(actual), raw(expected)), f"{what}: bits differ"


def uniform(gen, *shape, lo, hi):
    return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=F64)


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


# ---------------------------------------------------------------------------------------------
# Families: pool layout, fresh tokens, the torch-path call and the float64 oracles
# ---------------------------------------------------------------------------------------------


@dataclass
class Pool:
    state: torch.Tensor
    rings: dict[str, torch.Tensor]
    cursors: torch.Tensor

    def clone(self) -> Pool:
        return Pool(
            self.state.clone(),
            {k: v.clone() for k, v in self.rings.items()},
            self.cursors.clone(),
        )


def torch_pool(pool: Pool, replay: bool) -> torch_path.Pool:
    """The torch path's pool of `pool`: its state, and in replay mode its rings and cursors."""
    rings = pool.rings if replay else {name: None for name in pool.rings}
    return torch_path.Pool(Copy(pool.state), None, rings, pool.cursors if replay else None)


@dataclass(kw_only=True)
class Case:
    """What both families' cases share: the window and drafts (the rings' capacity), dtypes,
    flags, tolerances, and the layer parameters setup() draws."""

    window: int = 4
    drafts: int = 1
    state_dtype: torch.dtype = F32
    act_dtype: torch.dtype = F32
    flags: frozenset[str] = frozenset()
    tol_out: float = 1e-5
    tol_state: float = 1e-5
    params: dict = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.window + self.drafts


@dataclass(kw_only=True)
class Mamba2Case(Case):
    flags: frozenset[str] = frozenset({"d", "z", "dt_bias", "dt_softplus"})
    H: int = 4
    G: int = 2
    P: int = 8
    N: int = 16

    def setup(self, gen) -> None:
        # With softplus any bias will do; without it dt + bias must stay positive.
        lo, hi = (-1.0, 0.5) if "dt_softplus" in self.flags else (0.0, 0.1)
        self.params = dict(
            A=-uniform(gen, self.H, lo=0.5, hi=2.0).to(F32),
            D=randn(gen, self.H).to(F32) if "d" in self.flags else None,
            dt_bias=uniform(gen, self.H, lo=lo, hi=hi).to(F32) if "dt_bias" in self.flags else None,
        )

    def pool(self, gen) -> Pool:
        cap, act = self.capacity, self.act_dtype
        state = (0.5 * randn(gen, NUM_SLOTS, self.H, self.P, self.N)).to(self.state_dtype)
        rings = {
            "rec_x": torch.full((NUM_SLOTS, self.H, cap, self.P), math.nan, dtype=act),
            "rec_b": torch.full((NUM_SLOTS, self.G, cap, self.N), math.nan, dtype=act),
            "rec_dt": torch.full((NUM_SLOTS, self.H, cap), math.nan, dtype=F32),
        }
        return Pool(state, rings, new_cursors())

    def tokens(self, gen, batch: int) -> dict:
        act = self.act_dtype
        softplus = "dt_softplus" in self.flags
        dt = (
            uniform(gen, batch, self.H, lo=-3.0, hi=0.5)
            if softplus
            else uniform(gen, batch, self.H, lo=0.02, hi=0.3)
        )
        return dict(
            x=randn(gen, batch, self.H, self.P).to(act),
            z=randn(gen, batch, self.H, self.P).to(act) if "z" in self.flags else None,
            dt=dt.to(F32),
            B=(0.5 * randn(gen, batch, self.G, self.N)).to(act),
            C=(0.5 * randn(gen, batch, self.G, self.N)).to(act),
        )

    def out(self, batch: int) -> torch.Tensor:
        return torch.full((batch, self.H, self.P), math.nan, dtype=self.act_dtype)

    def run(self, pool, tok, out, slots, pad, *, replay, fes=False, seed=0, flags=None) -> None:
        setup = torch_path.StepScalars(replay, fes, self.window,
                              self.flags if flags is None else flags, pad, seed)  # fmt: skip
        tokens = torch_path.Mamba2Tokens(
            x=tok["x"], z=tok["z"], dt=tok["dt"], A=self.params["A"], D=self.params["D"],
            dt_bias=self.params["dt_bias"], B=tok["B"], C=tok["C"],
        )  # fmt: skip
        torch_path.mamba2_step(setup, torch_pool(pool, replay), tokens, Rows(slots, out))

    def sequence(self, checkpoint, L: int) -> Mamba2Sequence:
        p = self.params
        return Mamba2Sequence(
            checkpoint,
            p["A"],
            p["D"],
            p["dt_bias"],
            "dt_softplus" in self.flags,
            L=L,
            T=self.drafts,
        )

    def seq_step(self, seq, tok, b) -> torch.Tensor:
        z = None if tok["z"] is None else tok["z"][b]
        return seq.step(x=tok["x"][b], dt=tok["dt"][b], B=tok["B"][b], C=tok["C"][b], z=z)

    def check_record(self, pool, slot, n, tok, b, seq) -> None:
        """The appended ring row n: x, B exactly as given, dt after bias and softplus."""
        r = pool.rings
        assert_same_bits(r["rec_x"][slot, :, n], tok["x"][b], "x record")
        assert_same_bits(r["rec_b"][slot, :, n], tok["B"][b], "B record")
        assert_rel(r["rec_dt"][slot, :, n], seq.records.dt_eff[-1], 1e-6, "dt record")

    def pool_step(self, ref_state, slots, tok, pad) -> torch.Tensor:
        p = self.params
        return mamba2_step_pool(
            ref_state, slots, tok["x"], tok["dt"], p["A"], tok["B"], tok["C"], p["D"], tok["z"],
            p["dt_bias"], "dt_softplus" in self.flags, pad_slot_id=pad,
        )  # fmt: skip


@dataclass(kw_only=True)
class GDNCase(Case):
    flags: frozenset[str] = frozenset({"qk_l2norm", "gates_in_kernel"})
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 8

    def setup(self, gen) -> None:
        in_kernel = "gates_in_kernel" in self.flags
        self.params = dict(
            A_log=uniform(gen, self.HV, lo=-2.0, hi=0.5).to(F32) if in_kernel else None,
            dt_bias=uniform(gen, self.HV, lo=-1.0, hi=1.0).to(F32) if in_kernel else None,
            scale=self.K**-0.5,
        )

    def pool(self, gen) -> Pool:
        cap = self.capacity
        state = (0.5 * randn(gen, NUM_SLOTS, self.HV, self.V, self.K)).to(self.state_dtype)
        rings = {
            "rec_u": torch.full((NUM_SLOTS, self.HV, cap, self.V), math.nan, dtype=F32),
            "rec_k": torch.full((NUM_SLOTS, self.H, cap, self.K), math.nan, dtype=self.act_dtype),
            "rec_g": torch.full((NUM_SLOTS, self.HV, cap), math.nan, dtype=F32),
        }
        return Pool(state, rings, new_cursors())

    def tokens(self, gen, batch: int) -> dict:
        act = self.act_dtype
        # Unit-scale keys without the L2 norm too, so that the delta rule stays contractive.
        unit = 1.0 if "qk_l2norm" in self.flags else self.K**-0.5
        if "gates_in_kernel" in self.flags:
            ga, gb = randn(gen, batch, self.HV), 2.0 * randn(gen, batch, self.HV)
        else:
            ga = -uniform(gen, batch, self.HV, lo=0.02, hi=1.0)
            gb = uniform(gen, batch, self.HV, lo=0.1, hi=0.95)
        return dict(
            q=(unit * randn(gen, batch, self.H, self.K)).to(act),
            k=(unit * randn(gen, batch, self.H, self.K)).to(act),
            v=randn(gen, batch, self.HV, self.V).to(act),
            gate_a=ga.to(F32),
            gate_b=gb.to(F32),
        )

    def out(self, batch: int) -> torch.Tensor:
        return torch.full((batch, self.HV, self.V), math.nan, dtype=self.act_dtype)

    def run(self, pool, tok, out, slots, pad, *, replay, fes=False, seed=0, flags=None) -> None:
        p = self.params
        setup = torch_path.StepScalars(replay, fes, self.window,
                              self.flags if flags is None else flags, pad, seed)  # fmt: skip
        tokens = torch_path.DeltaTokens(
            q=tok["q"], k=tok["k"], v=tok["v"], gate_a=tok["gate_a"], gate_b=tok["gate_b"],
            A_log=p["A_log"], dt_bias=p["dt_bias"], scale=p["scale"],
        )  # fmt: skip
        torch_path.gdn_step(setup, torch_pool(pool, replay), tokens, Rows(slots, out))

    def gates(self, tok, b=None):
        ga, gb = tok["gate_a"], tok["gate_b"]
        if b is not None:
            ga, gb = ga[b], gb[b]
        if "gates_in_kernel" in self.flags:
            return gdn_gates(self.params["A_log"], ga, self.params["dt_bias"], gb)
        return ga, gb

    def sequence(self, checkpoint, L: int) -> GDNSequence:
        return GDNSequence(
            checkpoint,
            scale=self.params["scale"],
            use_qk_l2norm="qk_l2norm" in self.flags,
            L=L,
            T=self.drafts,
        )

    def seq_step(self, seq, tok, b) -> torch.Tensor:
        g, beta = self.gates(tok, b)
        return seq.step(q=tok["q"][b], k=tok["k"][b], v=tok["v"][b], g=g, beta=beta)

    def check_record(self, pool, slot, n, tok, b, seq) -> None:
        """The appended ring row n: raw k exactly, g, and u as the reference computed it."""
        r = pool.rings
        assert_same_bits(r["rec_k"][slot, :, n], tok["k"][b], "k record")
        assert_rel(r["rec_g"][slot, :, n], self.gates(tok, b)[0], 1e-6, "g record")
        assert_rel(r["rec_u"][slot, :, n], seq.records.u[-1], self.tol_state, "u record")

    def pool_step(self, ref_state, slots, tok, pad) -> torch.Tensor:
        g, beta = self.gates(tok)
        return gdn_step_pool(
            ref_state, slots, tok["q"], tok["k"], tok["v"], g, beta, self.params["scale"],
            "qk_l2norm" in self.flags, pad_slot_id=pad,
        )  # fmt: skip


@dataclass(kw_only=True)
class KDACase(GDNCase):
    """GDN's case with a decay per key channel: a, g [batch, HV, K], dt_bias [HV * K], rec_g
    [slots, HV, CAP, K], and optionally the safe gate's lower bound."""

    lower_bound: float | None = None

    def setup(self, gen) -> None:
        super().setup(gen)
        if "gates_in_kernel" in self.flags:
            self.params["dt_bias"] = uniform(gen, self.HV * self.K, lo=-1.0, hi=1.0).to(F32)

    def pool(self, gen) -> Pool:
        pool = super().pool(gen)
        pool.rings["rec_g"] = torch.full(
            (NUM_SLOTS, self.HV, self.capacity, self.K), math.nan, dtype=F32
        )
        return pool

    def tokens(self, gen, batch: int) -> dict:
        tok = super().tokens(gen, batch)
        if "gates_in_kernel" in self.flags:
            tok["gate_a"] = randn(gen, batch, self.HV, self.K).to(F32)
        else:
            tok["gate_a"] = -uniform(gen, batch, self.HV, self.K, lo=0.02, hi=1.0).to(F32)
        return tok

    def run(self, pool, tok, out, slots, pad, *, replay, fes=False, seed=0, flags=None) -> None:
        p = self.params
        setup = torch_path.StepScalars(replay, fes, self.window,
                              self.flags if flags is None else flags, pad, seed)  # fmt: skip
        tokens = torch_path.DeltaTokens(
            q=tok["q"], k=tok["k"], v=tok["v"], gate_a=tok["gate_a"], gate_b=tok["gate_b"],
            A_log=p["A_log"], dt_bias=p["dt_bias"], scale=p["scale"],
            lower_bound=self.lower_bound or 0.0,
        )  # fmt: skip
        torch_path.kda_step(setup, torch_pool(pool, replay), tokens, Rows(slots, out))

    def gates(self, tok, b=None):
        ga, gb = tok["gate_a"], tok["gate_b"]
        if b is not None:
            ga, gb = ga[b], gb[b]
        if "gates_in_kernel" in self.flags:
            p = self.params
            return kda_gates(p["A_log"], ga, p["dt_bias"], gb, self.lower_bound)
        return ga, gb

    def sequence(self, checkpoint, L: int) -> KDASequence:
        return KDASequence(
            checkpoint,
            scale=self.params["scale"],
            use_qk_l2norm="qk_l2norm" in self.flags,
            L=L,
            T=self.drafts,
        )

    def pool_step(self, ref_state, slots, tok, pad) -> torch.Tensor:
        g, beta = self.gates(tok)
        return kda_step_pool(
            ref_state, slots, tok["q"], tok["k"], tok["v"], g, beta, self.params["scale"],
            "qk_l2norm" in self.flags, pad_slot_id=pad,
        )  # fmt: skip


def new_cursors() -> torch.Tensor:
    cursors = torch.zeros((NUM_SLOTS, 4), dtype=torch.int32)
    cursors[:, 3] = SPARE
    return cursors


def fresh_pool(case, seed: int) -> tuple[torch.Generator, Pool]:
    """A generator seeded with `seed`, the case's parameters drawn from it, then a new pool."""
    gen = torch.Generator().manual_seed(seed)
    case.setup(gen)
    return gen, case.pool(gen)


def make_batch(rng: random.Random, step: int, pad: int) -> list[int]:
    """This step's slot per batch row: the slots that have joined (each skipped at random),
    shuffled, with up to two pad rows among them."""
    rows = [s for s, start in SLOT_START.items() if step >= start and rng.random() > 0.15]
    for _ in range(rng.randint(0, 2)):
        rows.insert(rng.randint(0, len(rows)), pad)
    rng.shuffle(rows)
    return rows


def _one_step(case, gen, pool, slots_list, pad=-1, **kw):
    """One call on fresh tokens (drawn from `gen`) for the batch rows `slots_list`."""
    tok = case.tokens(gen, len(slots_list))
    out = case.out(len(slots_list))
    case.run(pool, tok, out, torch.tensor(slots_list, dtype=torch.int32), pad, **kw)
    return tok, out


def check_untouched(pool: Pool, before: Pool, slot: int, what: str) -> None:
    assert_same_bits(pool.state[slot], before.state[slot], f"{what}: state")
    for name, ring in pool.rings.items():
        assert_same_bits(ring[slot], before.rings[name][slot], f"{what}: {name}")
    assert_same_bits(pool.cursors[slot], before.cursors[slot], f"{what}: cursors")


def check_rows(case, out, y_ref: dict[int, torch.Tensor], slots_list, pad, what) -> None:
    for b, s in enumerate(slots_list):
        if s == pad:
            assert bool((out[b] == 0).all()), f"{what}: pad row {b} not zero"
        else:
            assert_rel(out[b], y_ref[b], case.tol_out, f"{what}: output row {b} (slot {s})")


# ---------------------------------------------------------------------------------------------
# The schedule driver
# ---------------------------------------------------------------------------------------------


def drive_replay(
    case,
    *,
    steps: int,
    min_flushes: int,
    fes: bool = False,
    mixed: bool = False,
    pad: int = -1,
    seed: int = 0,
) -> None:
    """`steps` ReplaySSM steps (flush_every_step with `fes`) of staggered slots against one
    reference sequence per slot. With a 16-bit state the reference's checkpoint is rounded to
    that dtype after each flush as the pool's is, so that errors do not compound. Every named
    slot must flush at least `min_flushes` times; with `mixed`, some call must mix flushing and
    appending rows; with `fes`, nothing is appended."""
    gen, pool = fresh_pool(case, seed)
    rng = random.Random(seed)
    L = 1 if fes else case.window
    seqs = {s: case.sequence(pool.state[s], L) for s in SLOT_START}
    expect = {s: [0, 0, 0, SPARE] for s in range(NUM_SLOTS)}
    stats = dict(flushes=dict.fromkeys(SLOT_START, 0), mixed_calls=0, appends=0)
    for step in range(steps):
        slots_list = make_batch(rng, step, pad)
        before = pool.clone()
        tok, out = _one_step(case, gen, pool, slots_list, pad, replay=True, fes=fes, seed=seed)
        what = f"step {step}"
        y_ref, kinds = {}, set()
        for b, s in enumerate(slots_list):
            if s == pad:
                continue
            seq, n = seqs[s], seqs[s].n
            y_ref[b] = case.seq_step(seq, tok, b)
            flushed = seq.last_step_flushed
            kinds.add(flushed)
            # Cursor words, kept apart from the code under test (finish_step_cursor).
            if fes and n == 0:
                expect[s][1] += 1
            else:
                expect[s][0] = 0 if flushed else n + 1
                expect[s][1] += int(flushed)
                expect[s][2] = 0
            expect[s][3] = 0  # pending drafts dropped either way
            assert seq.n == expect[s][0]
            if flushed:
                stats["flushes"][s] += 1
                if case.state_dtype != F32:
                    seq.checkpoint = seq.checkpoint.to(case.state_dtype).to(F64)
                assert_rel(pool.state[s], seq.checkpoint, case.tol_state, f"{what}: state {s}")
                for name, ring in pool.rings.items():
                    assert_same_bits(ring[s], before.rings[name][s], f"{what}: {name} {s}")
            else:
                stats["appends"] += 1
                assert_same_bits(pool.state[s], before.state[s], f"{what}: state {s} (no flush)")
                case.check_record(pool, s, n, tok, b, seq)
                for name, ring in pool.rings.items():  # only row n was written
                    keep = [i for i in range(case.capacity) if i != n]
                    assert_same_bits(ring[s][:, keep], before.rings[name][s][:, keep], name)
        stats["mixed_calls"] += int(len(kinds) == 2)
        check_rows(case, out, y_ref, slots_list, pad, what)
        want = torch.tensor([expect[s] for s in range(NUM_SLOTS)], dtype=torch.int32)
        assert torch.equal(pool.cursors, want), f"{what}: cursors {pool.cursors} != {want}"
        for s in range(NUM_SLOTS):
            if s not in slots_list:
                check_untouched(pool, before, s, f"{what}: unnamed slot {s}")
    assert min(stats["flushes"].values()) >= min_flushes, stats
    if mixed:
        assert stats["mixed_calls"] > 0 and stats["appends"] > 0, stats
    if fes:
        assert stats["appends"] == 0, stats


def drive_conventional(case, *, steps: int = 12, pad: int = -1, seed: int = 0) -> None:
    """Conventional steps against the *_step_pool oracle on a float64 copy of the pool (or one
    of the pool's 16-bit dtype, which then rounds as the pool does)."""
    gen, pool = fresh_pool(case, seed)
    rng = random.Random(seed)
    ref_state = pool.state.to(F64 if case.state_dtype == F32 else case.state_dtype, copy=True)
    for step in range(steps):
        slots_list = make_batch(rng, step, pad)
        before = pool.clone()
        tok, out = _one_step(case, gen, pool, slots_list, pad, replay=False, seed=seed)
        slots = torch.tensor(slots_list, dtype=torch.int32)
        y = case.pool_step(ref_state, slots, tok, pad)
        what = f"conventional step {step}"
        check_rows(case, out, dict(enumerate(y)), slots_list, pad, what)
        for s in range(NUM_SLOTS):
            if s in slots_list and s != pad:
                assert_rel(pool.state[s], ref_state[s], case.tol_state, f"{what}: state {s}")
            else:
                check_untouched(pool, before, s, f"{what}: unnamed slot {s}")


# (state dtype, activation dtype, output and state tolerances) of both families' 16-bit runs
REPLAY_16BIT = [
    pytest.param((BF16, F32, 1e-3, 1e-3), id="state-bf16"),
    pytest.param((F16, F32, 1e-3, 1e-3), id="state-f16"),
    pytest.param((F32, BF16, 8e-3, 1e-5), id="act-bf16"),
    pytest.param((F32, F16, 1e-3, 1e-5), id="act-f16"),
]


def dtype_case(case_type, state_dtype, act_dtype, tol_out, tol_state):
    """A case of `case_type` with one REPLAY_16BIT entry's dtypes and tolerances."""
    return case_type(
        state_dtype=state_dtype, act_dtype=act_dtype, tol_out=tol_out, tol_state=tol_state
    )


# ---------------------------------------------------------------------------------------------
# Mamba-2
# ---------------------------------------------------------------------------------------------

MAMBA2_FLAG_SETS = {
    "all": frozenset({"d", "z", "dt_bias", "dt_softplus"}),
    "none": frozenset(),
    "d-softplus": frozenset({"d", "dt_softplus"}),
    "z-bias": frozenset({"z", "dt_bias"}),
}


@pytest.mark.parametrize("flags", list(MAMBA2_FLAG_SETS), ids=str)
@pytest.mark.parametrize("heads_groups", [(4, 2), (4, 4), (4, 1)], ids=["G2", "G4", "G1"])
def test_mamba2_replay_fp32(flags, heads_groups):
    H, G = heads_groups
    case = Mamba2Case(H=H, G=G, flags=MAMBA2_FLAG_SETS[flags])
    drive_replay(case, steps=24, seed=11, min_flushes=3, mixed=True)


@pytest.mark.parametrize(
    "dtypes", [*REPLAY_16BIT, pytest.param((BF16, BF16, 8e-3, 1e-3), id="both-bf16")]
)
def test_mamba2_replay_16bit(dtypes):
    drive_replay(dtype_case(Mamba2Case, *dtypes), steps=24, seed=12, min_flushes=3)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_mamba2_replay_windows(window):
    case = Mamba2Case(window=window, drafts=2)
    drive_replay(case, steps=22, pad=0, seed=13, min_flushes=2)


@pytest.mark.parametrize("flags", ["all", "none"])
def test_mamba2_flush_every_step(flags):
    case = Mamba2Case(flags=MAMBA2_FLAG_SETS[flags])
    drive_replay(case, steps=12, fes=True, seed=14, min_flushes=6)


@pytest.mark.parametrize(
    "flags, state_dtype, tol",
    [("all", F32, 1e-5), ("none", F32, 1e-5), ("all", BF16, 2e-3)],
    ids=["all-f32", "none-f32", "all-bf16"],
)
def test_mamba2_conventional(flags, state_dtype, tol):
    case = Mamba2Case(
        flags=MAMBA2_FLAG_SETS[flags], state_dtype=state_dtype, tol_out=tol, tol_state=tol
    )
    drive_conventional(case, pad=0, seed=15)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------

GDN_FLAG_SETS = {
    "l2-gates": frozenset({"qk_l2norm", "gates_in_kernel"}),
    "l2": frozenset({"qk_l2norm"}),
    "gates": frozenset({"gates_in_kernel"}),
    "none": frozenset(),
}


@pytest.mark.parametrize("flags", list(GDN_FLAG_SETS), ids=str)
@pytest.mark.parametrize("heads", [(2, 4), (4, 4), (1, 4)], ids=["H2HV4", "H4HV4", "H1HV4"])
def test_gdn_replay_fp32(flags, heads):
    H, HV = heads
    case = GDNCase(H=H, HV=HV, flags=GDN_FLAG_SETS[flags])
    drive_replay(case, steps=24, pad=0, seed=21, min_flushes=3, mixed=True)


@pytest.mark.parametrize("dtypes", REPLAY_16BIT)
def test_gdn_replay_16bit(dtypes):
    drive_replay(dtype_case(GDNCase, *dtypes), steps=24, seed=22, min_flushes=3)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_gdn_replay_windows(window):
    case = GDNCase(window=window, drafts=3)
    drive_replay(case, steps=22, seed=23, min_flushes=2)


@pytest.mark.parametrize("flags", ["l2-gates", "none"])
def test_gdn_flush_every_step(flags):
    case = GDNCase(flags=GDN_FLAG_SETS[flags])
    drive_replay(case, steps=12, fes=True, pad=0, seed=24, min_flushes=6)


@pytest.mark.parametrize(
    "flags, state_dtype, tol",
    [("l2-gates", F32, 1e-5), ("none", F32, 1e-5), ("l2", BF16, 3e-3), ("gates", F32, 1e-5)],
    ids=["l2-gates-f32", "none-f32", "l2-bf16", "gates-f32"],
)
def test_gdn_conventional(flags, state_dtype, tol):
    case = GDNCase(flags=GDN_FLAG_SETS[flags], state_dtype=state_dtype, tol_out=tol, tol_state=tol)
    drive_conventional(case, seed=25)


# ---------------------------------------------------------------------------------------------
# Kimi Delta Attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", list(GDN_FLAG_SETS), ids=str)
@pytest.mark.parametrize("heads", [(2, 4), (4, 4)], ids=["H2HV4", "H4HV4"])
def test_kda_replay_fp32(flags, heads):
    H, HV = heads
    case = KDACase(H=H, HV=HV, flags=GDN_FLAG_SETS[flags])
    drive_replay(case, steps=24, pad=0, seed=41, min_flushes=3, mixed=True)


def test_kda_replay_safe_gate():
    drive_replay(KDACase(lower_bound=-5.0), steps=24, seed=42, min_flushes=3, mixed=True)


@pytest.mark.parametrize("dtypes", REPLAY_16BIT)
def test_kda_replay_16bit(dtypes):
    drive_replay(dtype_case(KDACase, *dtypes), steps=24, seed=43, min_flushes=3)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_kda_replay_windows(window):
    drive_replay(KDACase(window=window), steps=22, seed=44, min_flushes=2)


def test_kda_flush_every_step():
    drive_replay(KDACase(), steps=12, fes=True, pad=0, seed=45, min_flushes=6)


@pytest.mark.parametrize(
    "flags, state_dtype, tol, bound",
    [("l2-gates", F32, 1e-5, None), ("none", F32, 1e-5, None), ("l2", BF16, 3e-3, None),
     ("l2-gates", F32, 1e-5, -5.0)],
    ids=["l2-gates-f32", "none-f32", "l2-bf16", "safe-gate-f32"],
)  # fmt: skip
def test_kda_conventional(flags, state_dtype, tol, bound):
    case = KDACase(flags=GDN_FLAG_SETS[flags], state_dtype=state_dtype, tol_out=tol,
                   tol_state=tol, lower_bound=bound)  # fmt: skip
    drive_conventional(case, seed=46)


def test_kda_decays_differ_per_channel():
    """The per-channel decay is exercised: g records vary along K (a scalar decay would pass
    tests whose channels all decay alike)."""
    case = KDACase()
    gen, pool = fresh_pool(case, 47)
    _one_step(case, gen, pool, [1, 2], replay=True)
    g = pool.rings["rec_g"][[1, 2], :, 0]  # [2, HV, K]
    assert bool(torch.isfinite(g).all()) and bool((g < 0).all())
    assert float((g.amax(-1) - g.amin(-1)).min()) > 1e-3


# ---------------------------------------------------------------------------------------------
# Cursors, switching modes, edge cases
# ---------------------------------------------------------------------------------------------

CASES = {"mamba2": Mamba2Case, "gdn": GDNCase, "kda": KDACase}


@pytest.mark.parametrize("family", list(CASES))
def test_cursor_words(family):
    """What finish_step_cursor leaves: flush_every_step without SR only advances the epoch of a
    slot that held nothing (words 0 and 2 as they were); every other step sets word 0, advances
    the epoch on a flush and clears the arrival word; every step zeroes word 3 (the pending
    drafts of a verify, dropped)."""
    case = CASES[family](state_dtype=BF16)
    gen, pool = fresh_pool(case, 31)
    pool.cursors[1] = torch.tensor([0, 5, 9, 77], dtype=torch.int32)
    pool.cursors[2] = torch.tensor([0, 2**31 - 1, 9, 77], dtype=torch.int32)
    _one_step(case, gen, pool, [1, 2], replay=True, fes=True)
    assert pool.cursors[1].tolist() == [0, 6, 9, 0]
    assert pool.cursors[2].tolist() == [0, -(2**31), 9, 0]  # the int32 epoch wraps
    pool.cursors[1, 3] = 77
    _one_step(case, gen, pool, [1], replay=True, fes=True, flags=case.flags | {"sr"})
    assert pool.cursors[1].tolist() == [0, 7, 0, 0]
    pool.cursors[1:3, 3] = 77
    _one_step(case, gen, pool, [1, 2], replay=True)  # window 4: append, held 1
    assert pool.cursors[1].tolist() == [1, 7, 0, 0]
    assert pool.cursors[2].tolist() == [1, -(2**31), 0, 0]
    _one_step(case, gen, pool, [1], replay=True, fes=True)  # held 1: folds, clears the words
    assert pool.cursors[1].tolist() == [0, 8, 0, 0]
    for _ in range(3):  # held 1 -> 2 -> 3 -> flush
        _one_step(case, gen, pool, [2], replay=True)
    assert pool.cursors[2].tolist() == [0, -(2**31) + 1, 0, 0]


@pytest.mark.parametrize("family", list(CASES))
def test_flush_every_step_folds_held_records(family):
    """A flush_every_step call on a slot that holds records (after ordinary ReplaySSM steps)
    folds them all with this token: state as the reference's flush, same outputs."""
    case = CASES[family]()
    gen, pool = fresh_pool(case, 32)
    seqs = {s: case.sequence(pool.state[s], case.window) for s in (1, 3)}
    for fes in (False, False, True, False, True):
        slots_list = [3, -1, 1]
        tok, out = _one_step(case, gen, pool, slots_list, replay=True, fes=fes)
        for b, s in enumerate(slots_list):
            if s < 0:
                assert bool((out[b] == 0).all())
                continue
            y = case.seq_step(seqs[s], tok, b)
            if fes:
                seqs[s].flush()
            assert_rel(out[b], y, case.tol_out, f"fes={fes}: output of slot {s}")
            assert int(pool.cursors[s, 0]) == seqs[s].n
        if fes:
            for s in (1, 3):
                assert_rel(pool.state[s], seqs[s].checkpoint, case.tol_state, f"state {s}")


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("replay", [True, False])
def test_pad_only_and_empty_batches(family, replay):
    case = CASES[family]()
    gen, pool = fresh_pool(case, 33)
    before = pool.clone()
    _, out = _one_step(case, gen, pool, [0, 0, 0], pad=0, replay=replay)
    assert bool((out == 0).all())
    _, out = _one_step(case, gen, pool, [], replay=replay)
    assert out.shape[0] == 0
    for s in range(NUM_SLOTS):
        check_untouched(pool, before, s, f"slot {s}")


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("corrupt", ["window", "capacity", "negative", "int32_max"])
def test_corrupted_cursor_faults_only_its_row(family, corrupt):
    """A held count no step leaves (outside [0, window)) gives that row NaN outputs and touches
    none of its slot's tensors, as the kernels' guard does; the other rows step as if alone."""
    case = CASES[family]()
    gen, pool = fresh_pool(case, 34)
    value = {"window": case.window, "capacity": case.capacity, "negative": -1,
             "int32_max": 2**31 - 1}[corrupt]  # fmt: skip
    pool.cursors[2, 0] = value
    alone = pool.clone()
    before = pool.clone()
    tok = case.tokens(gen, 3)
    out = case.out(3)
    case.run(pool, tok, out, torch.tensor([1, -1, 2], dtype=torch.int32), -1, replay=True)
    assert bool(torch.isnan(out[2]).all()) and bool((out[1] == 0).all())
    out_alone = case.out(1)
    tok_alone = {k: None if v is None else v[:1] for k, v in tok.items()}
    case.run(alone, tok_alone, out_alone, torch.tensor([1], dtype=torch.int32), -1, replay=True)
    assert torch.equal(out[0], out_alone[0])
    for s in range(NUM_SLOTS):
        check_untouched(pool, alone if s == 1 else before, s, f"slot {s}")


def _imports(path: Path) -> set[str]:
    """The modules `path` imports (absolute imports only)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_fast_path_imports_no_reference():
    """The torch path (ops/torch_path/) imports torch, the standard library, the leaf modules
    core/cursor_words.py and core/codecs.py, and itself only (never the float64 oracles); the
    two leaves import nothing of the package."""
    allowed = ("__future__.", "collections.abc.", "dataclasses.", "torch.",
               "replayssm_jit.core.cursor_words.", "replayssm_jit.core.codecs.",
               "replayssm_jit.ops.torch_path.")  # fmt: skip
    for path in sorted(Path(torch_path.__file__).parent.glob("*.py")):
        unexpected = {m for m in _imports(path) if not m.startswith(allowed) and m != "torch"}
        assert not unexpected, f"{path.name} imports {sorted(unexpected)}"
    core = Path(codecs.__file__).parent
    for leaf in ("cursor_words.py", "codecs.py"):
        assert not any(m.startswith("replayssm_jit") for m in _imports(core / leaf)), leaf


# ---------------------------------------------------------------------------------------------
# Stochastic rounding: rounding.cuh re-derived with Python integers and floats
# ---------------------------------------------------------------------------------------------

M64 = (1 << 64) - 1


def py_mix64(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


M32 = (1 << 32) - 1


def py_pair_bits(key: int, pair: int) -> int:
    x = (key & M32) ^ ((pair * 0x9E3779B9) & M32)
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    x ^= x >> 15
    return x ^ (key >> 32)


def py_rounding_bits(seed: int, stream: int, counter: int) -> int:
    """16 bits per element: one 32-bit hash per pair of elements, keyed once per stream."""
    key = py_mix64((seed & M64) ^ py_mix64(stream * 0x9E3779B97F4A7C15))
    return (py_pair_bits(key, (counter >> 1) & M32) >> (16 * (counter & 1))) & 0xFFFF


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def py_round_bf16(v: float, bits: int) -> int:
    """bf16 bit pattern of a finite FP32 value: add 16 random bits below the kept 16, truncate."""
    return ((f32_bits(v) + bits) >> 16) & 0xFFFF


def py_round_f16(v: float, bits: int) -> int:
    """fp16 bit pattern of a finite FP32 value, from its two FP16 neighbours in exact float64
    arithmetic: the upper one where the low 13 random bits reach the distance to it in 2^-13
    ulps (FP16 normals), or where the 16 bits as a fraction fall below (|v| - low) / ulp
    (subnormals); never past the largest finite value."""
    a = abs(v)
    if a >= 65504.0:
        res = 65504.0
    elif a == 0.0:
        res = 0.0
    else:
        exponent = math.frexp(a)[1] - 1  # a in [2^e, 2^(e+1))
        ulp = 2.0 ** (max(exponent, -14) - 10)
        low = math.floor(a / ulp) * ulp
        frac = (a - low) / ulp
        if exponent >= -14:
            up = (bits & 0x1FFF) + frac * 8192 >= 8192
        else:
            up = (bits & 0xFFFF) / 2.0**16 < frac
        res = low + ulp if up else low
    return struct.unpack("<H", struct.pack("<e", math.copysign(res, v)))[0]


def test_rounding_bits_match_python():
    rng = random.Random(41)
    seeds = [0, 1, 1234, 2**63 - 1, 2**64 - 1, *(rng.getrandbits(64) for _ in range(4))]
    streams = [0, 5 << 32, (3 << 32) | 7, M64, *(rng.getrandbits(64) for _ in range(4))]
    counters = [0, 1, 511, 2**40 + 3, *(rng.getrandbits(63) for _ in range(4))]
    to_i64 = codecs.signed64
    st = torch.tensor([to_i64(s) for s in streams])[:, None]
    ct = torch.tensor([to_i64(c) for c in counters])[None, :]
    for seed in seeds:
        got = codecs.rounding_bits(seed, st, ct)
        want = [[py_rounding_bits(seed, s, c) for c in counters] for s in streams]
        assert got.tolist() == want, f"seed {seed}"


def _sr_values(gen, dtype) -> torch.Tensor:
    spread = (-30.0, 30.0) if dtype == BF16 else (-9.0, 5.0)
    mags = 10.0 ** uniform(gen, 4000, lo=spread[0], hi=spread[1])
    v = (randn(gen, 4000) * mags).to(F32)
    edges = [0.0, -0.0, 1.0, -1.5, 1e-8, -1e-8, 3e-5, 65504.0, 65519.0, -65530.0, 7e4, 1e38]
    return torch.cat([v, torch.tensor(edges, dtype=F32)])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_round_stochastic_matches_python(dtype):
    gen = torch.Generator().manual_seed(42)
    v = _sr_values(gen, dtype)
    bits = torch.randint(0, 2**16, v.shape, generator=gen, dtype=torch.int64)
    bits[:8] = torch.tensor([0, 2**16 - 1, 2**15, 255, 256, 2**13 - 1, 2**13, 2**12])
    # Values halfway between two neighbours, with bits just below, at and above one half of the
    # dropped bits (16 for bf16, 13 for fp16): at it, the integer add carries to the upper one.
    half_bits = 2**15 if dtype == BF16 else 2**12
    half = 1.0 + 2.0 ** (-8 if dtype == BF16 else -11)
    ties = torch.tensor([half, -half] * 3, dtype=F32)
    tie_bits = torch.tensor([half_bits - 1] * 2 + [half_bits] * 2 + [half_bits + 1] * 2)
    v, bits = torch.cat([v, ties]), torch.cat([bits, tie_bits])
    got = codecs.round_stochastic(v, bits, dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    model = py_round_bf16 if dtype == BF16 else py_round_f16
    want = [model(float(x), int(r)) for x, r in zip(v.tolist(), bits.tolist())]
    assert got.tolist() == want
    # Specials round to nearest; FP32 passes through.
    specials = torch.tensor([math.inf, -math.inf, math.nan], dtype=F32)
    rounded = codecs.round_stochastic(specials, torch.full((3,), 2**16 - 1), dtype).to(F32)
    assert rounded[0] == math.inf and rounded[1] == -math.inf and torch.isnan(rounded[2])
    assert torch.equal(codecs.round_stochastic(v, bits, F32), v)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_round_stochastic_is_unbiased(dtype):
    """Each value rounds to one of its two neighbours, and on average to itself."""
    gen = torch.Generator().manual_seed(43)
    v = (randn(gen, 64) * 3.0).to(F32)
    bits = torch.randint(0, 2**16, (4096, 64), generator=gen, dtype=torch.int64)
    r = codecs.round_stochastic(v.expand(4096, 64), bits, dtype).to(F64)
    mantissa_bits = 7 if dtype == BF16 else 10
    ulp = torch.ldexp(torch.ones(64, dtype=F64), torch.frexp(v.to(F64))[1] - 1 - mantissa_bits)
    v64 = v.to(F64)
    low = torch.where(v64 >= 0, torch.floor(v64 / ulp), torch.ceil(v64 / ulp)) * ulp
    high = low + torch.sign(v64) * ulp
    assert bool(((r == low) | (r == high)).all())
    bias = (r.mean(0) - v64).abs() / ulp
    assert float(bias.max()) < 0.06, float(bias.max())  # 4096 draws: sigma <= 0.008 ulp


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("state_dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "conventional"])
def test_stochastic_rounding_key(family, state_dtype, replay):
    """A stochastically rounded flush stores round_stochastic(S, rounding_bits(seed, slot << 32
    | epoch, element)) of the FP32 fold S, the epoch as the step read it (0 in conventional
    mode): S comes from a twin pool with an FP32 state holding the same values, the bits from
    the Python model of rounding.cuh."""
    case = CASES[family](state_dtype=state_dtype, window=2)
    case.flags = case.flags | {"sr"}
    gen, pool = fresh_pool(case, 44)
    pool.cursors[1:4, 1] = torch.tensor([0, -5, 2**31 - 1], dtype=torch.int32)
    twin = pool.clone()
    twin.state = pool.state.to(F32)
    seed = 2**63 - 25
    model = py_round_bf16 if state_dtype == BF16 else py_round_f16
    for step in range(3):
        slots_list = [3, 1, -1, 2]
        batch = len(slots_list)
        tok = case.tokens(gen, batch)
        epochs = pool.cursors[:, 1].tolist()
        before = pool.state.clone()
        outs = [case.out(batch), case.out(batch)]
        for p, out in zip((pool, twin), outs):
            case.run(
                p,
                tok,
                out,
                torch.tensor(slots_list, dtype=torch.int32),
                -1,
                replay=replay,
                seed=seed,
            )
        assert torch.equal(raw(outs[0]), raw(outs[1])), "outputs differ from the FP32 twin's"
        flushed = not replay or step % 2 == 1  # window 2: held 0, 1, 0
        for s in (1, 2, 3):
            if not flushed:
                assert_same_bits(pool.state[s], before[s], f"step {step}: state {s}")
                continue
            epoch = epochs[s] if replay else 0
            stream = ((s << 32) | (epoch & M64)) & M64
            values = twin.state[s].flatten().tolist()
            want = [model(x, py_rounding_bits(seed, stream, i)) for i, x in enumerate(values)]
            got = (pool.state[s].flatten().view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
            assert got == want, f"step {step}: slot {s} bits"
            twin.state[s] = pool.state[s].to(F32)  # keep the twin on the rounded checkpoint
    # The same seed again gives the same bits; another seed, others.
    pools = [case.pool(torch.Generator().manual_seed(45)) for _ in range(3)]
    tok = case.tokens(gen, 1)
    for p, sd in zip(pools, (seed, seed + 1, seed)):
        one = torch.tensor([1], dtype=torch.int32)
        case.run(p, tok, case.out(1), one, -1, replay=False, seed=sd)
    assert not torch.equal(raw(pools[0].state[1]), raw(pools[1].state[1])), "seed ignored"
    assert_same_bits(pools[2].state[1], pools[0].state[1], "same seed")
