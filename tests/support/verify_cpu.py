"""Shared scaffolding of the speculative tests on the torch path (test_verify_cpu_*.py: the ops of
replayssm_jit/ops/verify.py and ops/torch_path/ against the float64 oracles, per
docs/speculative.md): checks, the three families (layouts, parameters, fresh inputs, the ops and
the oracles), pools and plans.

Every schedule runs on a pool whose rings start poisoned with NaN (a read of a row no record was
written to reaches the outputs) and whose unnamed slots must stay bit for bit as they were. Each
named slot has its own reference sequence (Mamba2Sequence / GDNSequence); after every call the
outputs, the cursor words (records held, epoch, scratch, pending drafts) and the checkpoint are
compared with it, the epoch with a count kept apart from both.
"""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from replayssm_jit import (
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
from replayssm_jit.reference import (
    GDNSequence,
    KDASequence,
    Mamba2Sequence,
    gdn_gates,
    gdn_step,
    kda_gates,
    kda_step,
    mamba2_step,
)
from support import checks
from support.checks import same_bits

F32, F64, I32 = torch.float32, torch.float64, torch.int32
NUM_SLOTS = 8
TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def assert_rel(actual, expected, what, tol=TOL):
    """checks.assert_rel at the verify tests' tolerance unless told."""
    checks.assert_rel(actual, expected, what, tol)


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


def start_pool(fam, L, T, seed, pad=-1):
    """(generator, layout, pool, plans) of a family's fresh parameters drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    fam.params(gen)
    layout = fam.layout(L, T)
    return gen, layout, new_pool(fam, layout, gen), Plans(fam, layout, pad)


def verify_fresh(fam, plans, tensors, gen, rows, **kwargs):
    """One verify of T fresh drafts per row of `rows`: (tokens, outputs)."""
    T = plans.layout.drafts
    tok = fam.tokens(gen, len(rows), T)
    out = fam.verify_op(plans(len(rows)), **tensors, **tok, **fam.layer(),
                        slot_indices=torch.tensor(rows, dtype=I32), **kwargs)  # fmt: skip
    return tok, out
