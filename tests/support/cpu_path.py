"""Shared scaffolding of the step tests on the torch path (test_cpu_path_*.py: replayssm_jit/ops/
torch_path/ against the float64 oracles): checks, the pool, and each family's case (layout, fresh
tokens, the torch-path call and the oracles).

Every schedule runs on a pool of slots whose rings start poisoned with NaN (a read of a row that
was never written reaches the outputs) and whose outputs start as NaN: each step's named slots
are compared with a reference (ReplaySequence per slot, or the *_step_pool oracles in
conventional mode), the cursors with an independently kept expectation, the appended ring rows
with the inputs, and every slot no row names must stay bit for bit as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
from support.checks import assert_rel, assert_same_bits

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
SPARE = 4242  # cursor word 3 (pending drafts) before a slot's first step, which zeroes it
NUM_SLOTS = 6


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


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
        assert_rel(r["rec_dt"][slot, :, n], seq.records.dt_eff[-1], "dt record", 1e-6)

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
        assert_rel(r["rec_g"][slot, :, n], self.gates(tok, b)[0], "g record", 1e-6)
        assert_rel(r["rec_u"][slot, :, n], seq.records.u[-1], "u record", self.tol_state)

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


def one_step(case, gen, pool, slots_list, pad=-1, **kw):
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


# Each family's case class, by the family's name
CASES = {"mamba2": Mamba2Case, "gdn": GDNCase, "kda": KDACase}
