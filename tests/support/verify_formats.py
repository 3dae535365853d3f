"""Speculative schedules on e4m3 / NVFP4 checkpoints and read copies (the torch path), against a
float64 emulation that rounds only where the path stores a checkpoint.

The emulation keeps, per slot, the decoded carried copy and read copy (float64) and the committed
records since the last flush as float64 records: Mamba-2's (alpha, dt x, B) depend on the
inputs only; a delta-rule record keeps the u its verify computed, from the copy that verify read
(the read copy, or the folded carried state after an early flush). A verify replays from the copy
it reads (read copy in separate mode, else the checkpoint) through the committed records, then
runs each draft conventionally from its parent's state (the snapshot recurrence); an early flush
folds the committed records into the carried copy (separate delta: every u recomputed from it)
and the drafts run from that float64 state. After a flush the stored copies must be within one
code of the emulation's folded state, and the emulation continues from what was stored.
"""

from __future__ import annotations

import random

import torch

from replayssm_jit import (
    commit_drafts,
    gdn_decode,
    gdn_layout,
    gdn_verify,
    kda_decode,
    kda_layout,
    kda_verify,
    mamba2_decode,
    mamba2_layout,
    mamba2_verify,
    plan_decode,
    reset_slots,
)
from replayssm_jit.families.schema import commit_ring_roles
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.library import plan_handle
from replayssm_jit.ops.torch_path.checkpoint import Copy, load_state
from support.checks import rel_err
from support.verify_schedule import Cursor, random_path, random_tree

F32, F64, I32 = torch.float32, torch.float64, torch.int32
SEED = 5
OUT_TOL = 5e-5
DTYPES = {"f32": F32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
          "nvfp4": torch.float4_e2m1fn_x2}  # fmt: skip


def decoded(tensors, prefix: str, slots) -> torch.Tensor:
    """A copy ("state" or "read") of `slots` as float64 (the torch path's own decode: exact)."""
    return load_state(Copy.named(tensors, prefix), slots).to(F64)


def code_step(got: torch.Tensor, want: torch.Tensor, fmt: str, block=None) -> torch.Tensor:
    """One code of `fmt` at each value of float64 heads [..., rows, cols], at the larger of
    |got| and |want|: a bound on a stored value's distance from the FP32 value it encodes (RN:
    half a code, a tie possibly decided the other way by the FP32 value; SR: under one code).
    bf16 2^(e - 7); e4m3 the code's step at |value| / (row amax / 448) (subnormal below 2^-6),
    times that scale; NVFP4 the e2m1 gap (0.5 below 2, 1 below 4, else 2) at |value| / S,
    times S, the stored block multiplier (`block`, e4m3 block code times head scale). FP32 is
    no code but a fold's rounding: the kernels sum the records in another order than the
    emulation, so a value near zero may be a few FP32 steps of the row's largest away."""
    mag = torch.maximum(got.abs(), want.abs())
    if fmt == "f32":
        return 1e-5 * mag + 1e-6 * want.abs().amax(-1, keepdim=True)
    if fmt == "bf16":
        return torch.exp2(torch.floor(torch.log2(mag.clamp_min(2.0**-126))) - 7)
    if fmt == "e4m3":
        scale = want.abs().amax(-1, keepdim=True) / 448
        q = (mag / scale.clamp_min(1e-30)).clamp_min(2.0**-6)
        return 1.01 * torch.exp2(torch.floor(torch.log2(q)) - 3) * scale
    q = mag / block.clamp_min(1e-30)
    gap = torch.where(q < 2, 0.5, torch.where(q < 4, 1.0, 2.0))
    return 1.01 * gap * block


def stored_block(tensors, prefix: str, slot: int) -> torch.Tensor | None:
    """An NVFP4 copy's block multipliers of `slot`, one per value (None for other formats)."""
    blocks = tensors.get(f"{prefix}_block_scale")
    if blocks is None:
        return None
    head = tensors[f"{prefix}_scale"][slot].to(F64)[:, None, None]
    return (blocks[slot].to(F64) * head).repeat_interleave(16, dim=-1)


def assert_within_one_code(got, want, fmt, what, block=None):
    assert bool(torch.isfinite(got).all()), f"{what}: not finite"
    excess = ((got - want).abs() - code_step(got, want, fmt, block)).max().item()
    assert excess <= 0, f"{what}: a value is more than one {fmt} code away ({excess:.3e} over)"


def softplus(x):
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


class Mamba2Fam:
    name, nvfp4 = "mamba2", True
    H, G, P, N = 2, 1, 32, 32
    options = dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True)  # noqa: RUF012
    verify_op, decode_op = staticmethod(mamba2_verify), staticmethod(mamba2_decode)
    torch_verify = staticmethod(torch_path.mamba2_verify)

    def layout(self, state, read, L, T):
        return mamba2_layout(num_heads=self.H, headdim=self.P, dstate=self.N, ngroups=self.G,
                             window=L, drafts=T, act_dtype=F32, state_dtype=DTYPES[state],
                             read_dtype=read and DTYPES[read])  # fmt: skip

    def state_shape(self):
        return (self.H, self.P, self.N)

    def params(self, gen):
        H = self.H
        return dict(A=-(0.5 + torch.rand(H, generator=gen)), D=torch.randn(H, generator=gen),
                    dt_bias=0.1 * torch.randn(H, generator=gen))  # fmt: skip

    def drafts(self, gen, *lead):
        H, G, P, N = self.H, self.G, self.P, self.N
        return dict(x=torch.randn(*lead, H, P, generator=gen),
                    dt=torch.rand(*lead, H, generator=gen) * 2 - 2.5,
                    B=0.5 * torch.randn(*lead, G, N, generator=gen),
                    C=0.5 * torch.randn(*lead, G, N, generator=gen))  # fmt: skip

    def token(self, d, p, r, j):
        """Draft j of row r as float64: (alpha, value, key, query, skip)."""
        per = self.H // self.G
        dt = softplus(d["dt"][r, j].double() + p["dt_bias"].double())  # [H]
        alpha = torch.exp(dt * p["A"].double())[:, None, None]
        val = dt[:, None] * d["x"][r, j].double()
        key = d["B"][r, j].double().repeat_interleave(per, 0)
        query = d["C"][r, j].double().repeat_interleave(per, 0)
        return dict(alpha=alpha, val=val, key=key, q=query,
                    skip=p["D"].double()[:, None] * d["x"][r, j].double())  # fmt: skip

    def apply(self, s, rec):
        return rec["alpha"] * s + rec["val"][..., None] * rec["key"][:, None]

    def draft(self, s, tok):
        s = self.apply(s, tok)
        return (s @ tok["q"][..., None]).squeeze(-1) + tok["skip"], s, tok

    def refold(self, s, recs, separate):
        for rec in recs:
            s = self.apply(s, rec)
        return s


class DeltaFam:
    nvfp4 = True
    KH, HV, K, V = 1, 2, 32, 32
    options = dict(use_qk_l2norm=True, gates_in_kernel=False)  # noqa: RUF012

    def __init__(self, per_channel: bool):
        self.per_channel = per_channel
        self.name = "kda" if per_channel else "gdn"
        self.verify_op = kda_verify if per_channel else gdn_verify
        self.decode_op = kda_decode if per_channel else gdn_decode
        self.torch_verify = torch_path.kda_verify if per_channel else torch_path.gdn_verify

    def layout(self, state, read, L, T):
        make = kda_layout if self.per_channel else gdn_layout
        return make(num_k_heads=self.KH, num_v_heads=self.HV, head_k_dim=self.K,
                    head_v_dim=self.V, window=L, drafts=T, act_dtype=F32,
                    state_dtype=DTYPES[state], read_dtype=read and DTYPES[read])  # fmt: skip

    def state_shape(self):
        return (self.HV, self.V, self.K)

    def params(self, gen):
        return {}

    def drafts(self, gen, *lead):
        KH, HV, K, V = self.KH, self.HV, self.K, self.V
        gate = (*lead, HV, K) if self.per_channel else (*lead, HV)
        return dict(q=torch.randn(*lead, KH, K, generator=gen),
                    k=torch.randn(*lead, KH, K, generator=gen),
                    v=torch.randn(*lead, HV, V, generator=gen),
                    g=-0.3 * torch.rand(gate, generator=gen),
                    beta=torch.rand(*lead, HV, generator=gen))  # fmt: skip

    def token(self, d, p, r, j):
        per = self.HV // self.KH

        def unit(x):
            x = x.double().repeat_interleave(per, 0)
            return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

        g = d["g"][r, j].double()
        alpha = torch.exp(g)[:, None, :] if self.per_channel else torch.exp(g)[:, None, None]
        return dict(alpha=alpha, key=unit(d["k"][r, j]), q=unit(d["q"][r, j]) * self.K**-0.5,
                    v=d["v"][r, j].double(), beta=d["beta"][r, j].double()[:, None])  # fmt: skip

    def apply(self, s, rec):  # a committed record: its u as computed when it was a draft
        return rec["alpha"] * s + rec["u"][..., None] * rec["key"][:, None]

    def draft(self, s, tok):
        s = tok["alpha"] * s
        u = tok["beta"] * (tok["v"] - (s @ tok["key"][..., None]).squeeze(-1))
        rec = {**tok, "u": u}
        s = s + u[..., None] * tok["key"][:, None]
        return (s @ tok["q"][..., None]).squeeze(-1), s, rec

    def refold(self, s, recs, separate):
        for rec in recs:  # separate mode recomputes each u from the carried copy
            s = self.draft(s, rec)[1] if separate else self.apply(s, rec)
        return s


FAMS = {"mamba2": Mamba2Fam, "gdn": lambda: DeltaFam(False), "kda": lambda: DeltaFam(True)}


class SlotModel:
    """One slot's emulation: decoded copies, committed and pending float64 records."""

    def __init__(self, fam, tensors, slot, separate):
        self.fam, self.slot, self.separate = fam, slot, separate
        self.committed, self.pending = [], []
        self.reload(tensors)

    def reload(self, tensors):
        index = torch.tensor([self.slot])
        self.carried = decoded(tensors, "state", index)[0]
        self.read = decoded(tensors, "read", index)[0] if self.separate else self.carried

    def commit(self, path):
        self.committed += [self.pending[i] for i in path]
        self.pending = []

    def verify(self, toks, parents, flush):
        """The drafts' float64 outputs; with `flush` the folded carried state too (else None)."""
        folded = None
        if flush:
            folded = self.fam.refold(self.carried, self.committed, self.separate)
            base, self.committed = folded, []
        else:
            base = self.read
            for rec in self.committed:
                base = self.fam.apply(base, rec)
        states, outs, self.pending = [], [], []
        for j, tok in enumerate(toks):
            y, s, rec = self.fam.draft(base if parents[j] < 0 else states[parents[j]], tok)
            states.append(s)
            outs.append(y)
            self.pending.append(rec)
        return outs, folded


# ---------------------------------------------------------------------------------------------
# A schedule of verifies and commits, on the torch path or (device="cuda") the kernels
# ---------------------------------------------------------------------------------------------


def start(fam, state, read, L, T, slots=5, sr=False, device="cpu"):
    gen = torch.Generator().manual_seed(SEED)
    layout = fam.layout(state, read, L, T)
    tensors = layout.allocate(slots, device)
    for name in layout.ring_names:  # a read of a row no record was written to shows NaN
        tensors[name].fill_(float("nan"))
    init = 0.5 * torch.randn(slots, *fam.state_shape(), generator=gen)
    reset_slots(layout, tensors, torch.arange(slots, device=device), init.to(device))
    opts = dict(fam.options, stochastic_rounding=sr)
    return gen, layout, tensors, opts


def run_formats_schedule(
    case, *, trees, fused, sr=False, steps=14, L=4, T=3, via_op=False, device="cpu", config=None
):
    """Rows on slots 1 and 3 and a pad row, random draft counts, trees or chains, fused or
    explicit commits: outputs, cursors and flushed copies against the emulation; slots no row
    names, and checkpoints no flush wrote, bit for bit. On "cuda" with `config` (a
    LaunchConfig: the per-item or split verify kernel), the kernels against the same emulation."""
    name, state, read = case
    fam = FAMS[name]()
    gen, layout, tensors, opts = start(fam, state, read, L, T, sr=sr, device=device)
    rng = random.Random(SEED)
    plan = plan_decode(layout, 3, device=device, seed=SEED, config=config, **opts)
    params = {k: v.to(device) for k, v in fam.params(gen).items()}
    live = [1, 3]
    models = {s: SlotModel(fam, tensors, s, read is not None) for s in live}
    cursors = {s: Cursor() for s in live}
    accepted, flushes = None, 0
    for step in range(steps):
        slot_row = [3, -1, 1] if step % 2 else [1, 3, -1]
        slots = torch.tensor(slot_row, dtype=I32, device=device)
        t_row = [rng.randint(1, T) if s >= 0 else 0 for s in slot_row]
        trees_now = [random_tree(rng, t, rng.choice(["chain", "star", "random"])) if trees
                     else list(range(-1, t - 1)) for t in t_row]  # fmt: skip
        parents = [p + [-1] * (T - len(p)) for p in trees_now]
        drafts = {k: v.to(device) for k, v in fam.drafts(gen, 3, T).items()}
        kw = dict(num_drafts=torch.tensor(t_row, dtype=I32, device=device))
        if trees:
            kw["parents"] = torch.tensor(parents, dtype=I32, device=device)
        if fused and accepted is not None:
            kw["num_accepted"] = torch.tensor([accepted.get(s, 0) for s in slot_row], dtype=I32,
                                              device=device)  # fmt: skip
        before = {k: v.clone() for k, v in tensors.items()}
        want, folded = {}, {}
        for r, s in enumerate(slot_row):
            if s < 0:
                continue
            a = accepted.get(s, 0) if fused and accepted is not None else None
            if a is not None:
                models[s].commit(range(a))
            flush = cursors[s].verify(t_row[r], a, L, T)
            toks = [fam.token(drafts, params, r, j) for j in range(t_row[r])]
            want[r], folded[s] = models[s].verify(toks, parents[r], flush)
        out = torch.full((3, T, *fam.state_shape()[:2]), float("nan"), device=device)
        fam.verify_op(plan, **tensors, **params, **drafts, slot_indices=slots, out=out, **kw)
        assert (out[slot_row.index(-1)] == 0).all(), "pad row"
        for r, ys in want.items():
            e = rel_err(out[r, : len(ys)], torch.stack(ys))
            assert e < OUT_TOL, f"step {step} row {r}: output relative error {e:.2e}"
            assert (out[r, len(ys) :] == 0).all(), "unused drafts"
        got = tensors["cursors"][live].tolist()
        assert got == [[cursors[s].held, cursors[s].epoch, 0, cursors[s].pending] for s in live]
        for s in live:
            if folded[s] is None:  # no flush: no copy of the checkpoint written
                for n in layout.checkpoint_names:
                    assert torch.equal(tensors[n][s].view(torch.uint8),
                                       before[n][s].view(torch.uint8)), (step, n)  # fmt: skip
                continue
            flushes += 1
            index = torch.tensor([s])
            assert_within_one_code(decoded(tensors, "state", index)[0], folded[s], state,
                                   f"carried copy of slot {s} at step {step}",
                                   stored_block(tensors, "state", s))  # fmt: skip
            if read is not None:
                assert_within_one_code(decoded(tensors, "read", index)[0], folded[s], read,
                                       f"read copy of slot {s} at step {step}",
                                       stored_block(tensors, "read", s))  # fmt: skip
            models[s].reload(tensors)  # the emulation continues from what was stored
        accepted = {}
        paths = torch.zeros(3, T, dtype=I32, device=device)
        for r, s in enumerate(slot_row):
            if s < 0:
                continue
            t = t_row[r]
            path = random_path(rng, trees_now[r]) if trees else list(range(rng.randint(0, t)))
            accepted[s] = len(path)
            paths[r, : len(path)] = torch.tensor(path, dtype=I32, device=device)
            if not fused or trees:
                models[s].commit(path)
        if not fused or trees:
            counts = torch.tensor([accepted.get(s, 0) for s in slot_row], dtype=I32, device=device)
            args = dict(num_accepted=counts, slot_indices=slots,
                        accepted_path=paths if trees else None, parents=kw.get("parents"))  # fmt: skip
            if via_op:  # the registered op: rings by role, a read copy's after the three
                rings = {role: tensors[n] for role, n in commit_ring_roles(layout.ring_names)}
                torch.ops.replayssm.commit_drafts(plan_handle(plan), cursors=tensors["cursors"],
                                                  **rings, **args)  # fmt: skip
            else:
                commit_drafts(plan, **tensors, **args)
            for s in live:
                cursors[s].commit(accepted[s])
            accepted = None
    fresh = start(fam, state, read, L, T, sr=sr, device=device)[2]
    for s in (0, 2, 4):  # never named
        assert all(torch.equal(tensors[n][s].view(torch.uint8), fresh[n][s].view(torch.uint8))
                   for n in layout.checkpoint_names)  # fmt: skip
    assert flushes >= 2, "the schedule must fold committed records early"
