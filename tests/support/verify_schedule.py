"""Randomized speculative schedules against a float64 snapshot oracle (shared by the verify tests).

The oracle is independent of ReplaySSM's unrolled form: it keeps every live slot's true state in
float64 and runs each draft as a conventional step from its parent's state (the per-draft
snapshot recurrence), batched over rows. A verify's outputs must match the drafts' conventional
outputs; after a commit the true state moves to the accepted node. Beside it an integer model of
the cursor (docs/speculative.md) predicts every slot's committed and pending counts and which
steps flush, so the test compares cursors and, right after each flush, the checkpoint itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from replayssm_jit import (
    commit_drafts,
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
    reset_slots,
)
from replayssm_jit.reference import gdn_gates, gdn_step, kda_gates, kda_step, mamba2_step
from support.checks import rel_err


class Mamba2Family:
    name = "mamba2"

    def __init__(self, heads, headdim, dstate, groups):
        self.H, self.P, self.N, self.G = heads, headdim, dstate, groups

    def layout(self, window, drafts, state_dtype, act_dtype=torch.bfloat16):
        return mamba2_layout(num_heads=self.H, headdim=self.P, dstate=self.N, ngroups=self.G,
                             window=window, drafts=drafts, state_dtype=state_dtype,
                             act_dtype=act_dtype)  # fmt: skip

    def params(self, gen, dev):
        H = self.H
        return dict(
            A=-(0.5 + 1.5 * torch.rand(H, generator=gen, device=dev)),
            D=torch.randn(H, generator=gen, device=dev),
            dt_bias=0.1 * torch.randn(H, generator=gen, device=dev),
        )

    def drafts(self, batch, T, gen, dev, act):
        H, P, N, G = self.H, self.P, self.N, self.G
        return dict(
            x=torch.randn(batch, T, H, P, generator=gen, device=dev).to(act),
            dt=torch.randn(batch, T, H, generator=gen, device=dev) * 0.5 - 1.0,
            B=(torch.randn(batch, T, G, N, generator=gen, device=dev) / N**0.25).to(act),
            C=(torch.randn(batch, T, G, N, generator=gen, device=dev) / N**0.25).to(act),
        )

    def verify(self, plan, tensors, params, drafts, slots, **kw):
        return mamba2_verify(plan, **tensors, **params, **drafts, slot_indices=slots, **kw)

    def snapshot(self, plan, state, params, drafts, slots, snaps, **kw):
        return mamba2_snapshot_verify(plan, state=state, **params, **drafts, slot_indices=slots,
                                      snapshot_slots=snaps, **kw)  # fmt: skip

    def state_shape(self):
        return (self.H, self.P, self.N)

    def decode_op(self):
        return mamba2_decode

    def oracle_step(self, states, params, drafts, j):
        return mamba2_step(states, drafts["x"][:, j], drafts["dt"][:, j], params["A"],
                           drafts["B"][:, j], drafts["C"][:, j], D=params["D"],
                           dt_bias=params["dt_bias"], dt_softplus=True)  # fmt: skip


class GDNFamily:
    name = "gdn"

    def __init__(self, k_heads, v_heads, kdim, vdim):
        self.H, self.HV, self.K, self.V = k_heads, v_heads, kdim, vdim

    def layout(self, window, drafts, state_dtype, act_dtype=torch.bfloat16):
        return gdn_layout(num_k_heads=self.H, num_v_heads=self.HV, head_k_dim=self.K,
                          head_v_dim=self.V, window=window, drafts=drafts,
                          state_dtype=state_dtype, act_dtype=act_dtype)  # fmt: skip

    def params(self, gen, dev):
        HV = self.HV
        return dict(
            A_log=torch.log(0.5 + torch.rand(HV, generator=gen, device=dev)),
            dt_bias=0.1 * torch.randn(HV, generator=gen, device=dev),
        )

    def drafts(self, batch, T, gen, dev, act):
        H, HV, K, V = self.H, self.HV, self.K, self.V
        return dict(
            q=torch.randn(batch, T, H, K, generator=gen, device=dev).to(act),
            k=torch.randn(batch, T, H, K, generator=gen, device=dev).to(act),
            v=torch.randn(batch, T, HV, V, generator=gen, device=dev).to(act),
            a=torch.randn(batch, T, HV, generator=gen, device=dev),
            b=torch.randn(batch, T, HV, generator=gen, device=dev),
        )

    def verify(self, plan, tensors, params, drafts, slots, **kw):
        return gdn_verify(plan, **tensors, **params, **drafts, slot_indices=slots, **kw)

    def snapshot(self, plan, state, params, drafts, slots, snaps, **kw):
        return gdn_snapshot_verify(plan, state=state, **params, **drafts, slot_indices=slots,
                                   snapshot_slots=snaps, **kw)  # fmt: skip

    def state_shape(self):
        return (self.HV, self.V, self.K)

    def decode_op(self):
        return gdn_decode

    def oracle_step(self, states, params, drafts, j):
        g, beta = gdn_gates(
            params["A_log"], drafts["a"][:, j], params["dt_bias"], drafts["b"][:, j]
        )
        return gdn_step(states, drafts["q"][:, j], drafts["k"][:, j], drafts["v"][:, j], g, beta)


class KDAFamily(GDNFamily):
    """KDA's inputs: GDN's with a per-channel raw gate a [batch, T, HV, K], dt_bias [HV K]."""

    def layout(self, window, drafts, state_dtype, act_dtype=torch.bfloat16):
        return kda_layout(num_k_heads=self.H, num_v_heads=self.HV, head_k_dim=self.K,
                          head_v_dim=self.V, window=window, drafts=drafts,
                          state_dtype=state_dtype, act_dtype=act_dtype)  # fmt: skip

    def params(self, gen, dev):
        # Decays near 1 (small A_log), so that the state term carries the output.
        return dict(
            A_log=torch.log(0.05 + 0.1 * torch.rand(self.HV, generator=gen, device=dev)),
            dt_bias=0.1 * torch.randn(self.HV * self.K, generator=gen, device=dev),
        )

    def drafts(self, batch, T, gen, dev, act):
        d = super().drafts(batch, T, gen, dev, act)
        d["a"] = torch.randn(batch, T, self.HV, self.K, generator=gen, device=dev)
        return d

    def decode_op(self):
        return kda_decode

    def verify(self, plan, tensors, params, drafts, slots, **kw):
        return kda_verify(plan, **tensors, **params, **drafts, slot_indices=slots, **kw)

    def snapshot(self, plan, state, params, drafts, slots, snaps, **kw):
        return kda_snapshot_verify(plan, state=state, **params, **drafts, slot_indices=slots,
                                   snapshot_slots=snaps, **kw)  # fmt: skip

    def oracle_step(self, states, params, drafts, j):
        g, beta = kda_gates(
            params["A_log"], drafts["a"][:, j], params["dt_bias"], drafts["b"][:, j]
        )
        return kda_step(states, drafts["q"][:, j], drafts["k"][:, j], drafts["v"][:, j], g, beta)


@dataclass
class Cursor:
    """The integer model of one slot's cursor (docs/speculative.md)."""

    held: int = 0
    pending: int = 0
    epoch: int = 0

    def verify(self, t, accepted, L, T) -> bool:
        self.held += min(max(accepted, 0), self.pending) if accepted is not None else 0
        flush = self.held + t >= L + T
        if flush:
            self.held, self.epoch = 0, self.epoch + 1
        self.pending = t
        return flush

    def commit(self, accepted):
        self.held += min(max(accepted, 0), self.pending)
        self.pending = 0


def random_tree(rng: random.Random, t: int, kind: str) -> list[int]:
    if kind == "chain":
        return list(range(-1, t - 1))
    if kind == "star":
        return [-1] + [0] * (t - 1)
    return [-1] + [rng.randrange(0, j) for j in range(1, t)]


def random_path(rng: random.Random, parents: list[int]) -> list[int]:
    """A random root-to-node path of the tree (root first), possibly empty."""
    if rng.random() < 0.15:
        return []
    node = rng.randrange(len(parents))
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def run_schedule(fam, *, device, batch, T, L, steps, seed, state_dtype=torch.float32,
                 act_dtype=torch.bfloat16, trees=False, fused=True, variable=False,
                 pad_slot_id=-1, tol=1e-5, config=None, verify_kernel=None) -> dict:  # fmt: skip
    """`steps` verify steps (with fused or explicit commits) of `batch` live rows (a pad row
    added where batch > 1) against the oracle. Returns the worst errors seen. verify_kernel:
    where given, the kernel the plan must have chosen."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rng = random.Random(seed)
    layout = fam.layout(L, T, state_dtype, act_dtype=act_dtype)
    rows = batch + (1 if batch > 1 else 0)
    num_slots = batch + 3
    tensors = layout.allocate(num_slots, dev)
    for name in layout.ring_names:  # a row that reads a ring row its cursor does not hold shows NaN
        tensors[name].fill_(float("nan"))
    live = list(range(1, batch + 1))  # slot 0 and the last two: never named
    tensors["state"].copy_(0.3 * torch.randn(tensors["state"].shape, generator=gen, device=dev))
    tensors["cursors"].copy_(torch.randint(-9, 9, tensors["cursors"].shape, generator=gen,
                                           device=dev))  # fmt: skip
    reset_slots(layout, tensors, torch.tensor(live, device=dev), tensors["state"][live].clone(),
                pad_slot_id=pad_slot_id)  # fmt: skip
    kept = {name: t[[0, num_slots - 2, num_slots - 1]].clone() for name, t in tensors.items()}
    truth = tensors["state"][live].double().clone()
    params = fam.params(gen, dev)
    plan = plan_decode(layout, rows, device=dev, pad_slot_id=pad_slot_id, config=config)
    if verify_kernel is not None:
        assert plan.verify_kernel == verify_kernel, (plan.verify_kernel, verify_kernel)
    cursors = [Cursor() for _ in live]
    accepted = None  # the previous verify's accepted counts (fused commit)
    worst = {"out": 0.0, "checkpoint": 0.0, "flushes": 0}
    act = layout.act_dtype
    for step in range(steps):
        order = list(range(batch))
        rng.shuffle(order)
        slot_row = [live[i] for i in order] + ([pad_slot_id] if rows > batch else [])
        pad_at = rng.randrange(rows) if rows > batch else None
        if pad_at is not None:  # the pad row anywhere in the batch
            slot_row.insert(pad_at, slot_row.pop())
        slots = torch.tensor(slot_row, dtype=torch.int32, device=dev)
        live_rows = [r for r, s in enumerate(slot_row) if s != pad_slot_id]
        seq_of_row = {r: live.index(slot_row[r]) for r in live_rows}
        t_row = [rng.randint(0, T) if variable else T for _ in range(rows)]
        kinds = [rng.choice(["chain", "star", "random"]) if trees else "chain" for _ in range(rows)]
        parents = [random_tree(rng, max(t, 1), k) + [-1] * (T - max(t, 1)) for t, k in
                   zip(t_row, kinds)]  # fmt: skip
        drafts = fam.drafts(rows, T, gen, dev, act)
        kw = {}
        if variable:
            kw["num_drafts"] = torch.tensor(t_row, dtype=torch.int32, device=dev)
        if trees:
            kw["parents"] = torch.tensor(parents, dtype=torch.int32, device=dev)
        fused_now = fused and accepted is not None
        if fused_now:
            kw["num_accepted"] = torch.tensor(
                [accepted.get(seq_of_row[r], 0) if r in seq_of_row else 0 for r in range(rows)],
                dtype=torch.int32, device=dev)  # fmt: skip
        # The oracle: each draft from its parent's state, conventionally, in float64.
        roots = torch.zeros((rows, *fam.state_shape()), dtype=torch.float64, device=dev)
        for r in live_rows:
            roots[r] = truth[seq_of_row[r]]
        d64 = {k: v.double() for k, v in drafts.items()}
        p64 = {k: v.double() for k, v in params.items()}
        nodes, outs = [], []
        for j in range(T):
            base = roots.clone()
            for r in range(rows):
                pj = parents[r][j] if j < len(parents[r]) else -1
                if pj >= 0:
                    base[r] = nodes[pj][r]
            y, s = fam.oracle_step(base, p64, d64, j)
            nodes.append(s)
            outs.append(y)
        flushed = {}
        prev_acc = accepted or {}
        for r in live_rows:
            q = seq_of_row[r]
            a = prev_acc.get(q, 0) if fused_now else None
            flushed[r] = cursors[q].verify(t_row[r], a, L, T)
        out = torch.full((rows, T, *fam.state_shape()[:2]), float("nan"), dtype=act, device=dev)
        state_before = tensors["state"].clone()
        fam.verify(plan, tensors, params, drafts, slots, out=out, **kw)
        # Outputs of every draft; zeros past a row's count and on the pad row.
        ref = torch.stack(outs, dim=1)
        mask = torch.zeros(rows, T, dtype=torch.bool, device=dev)
        for r in live_rows:
            mask[r, : t_row[r]] = True
        assert not out.isnan().any(), f"step {step}: NaN in the outputs"
        assert (out[~mask] == 0).all(), f"step {step}: pad or unused draft outputs not zero"
        if mask.any():
            e = rel_err(out[mask], ref[mask])
            worst["out"] = max(worst["out"], e)
            assert e < tol, f"step {step}: output relative error {e:.3g}"
        # Cursors, and the checkpoint of every row that flushed (= its committed true state).
        got = tensors["cursors"][[slot_row[r] for r in live_rows]].tolist()
        want = [[cursors[seq_of_row[r]].held, cursors[seq_of_row[r]].epoch, 0,
                 cursors[seq_of_row[r]].pending] for r in live_rows]  # fmt: skip
        assert got == want, f"step {step}: cursors {got} != {want}"
        for r in live_rows:
            slot = slot_row[r]
            if flushed[r]:
                worst["flushes"] += 1
                e = rel_err(tensors["state"][slot], roots[r])
                worst["checkpoint"] = max(worst["checkpoint"], e)
                assert e < tol, f"step {step}: checkpoint relative error {e:.3g} after a flush"
            else:
                assert torch.equal(tensors["state"][slot], state_before[slot]), "state written"
        # Accept: a root path per row (a chain prefix of length in [0, t]).
        accepted = {}
        paths = torch.zeros(rows, T, dtype=torch.int32, device=dev)
        counts = torch.zeros(rows, dtype=torch.int32, device=dev)
        for r in live_rows:
            q, t = seq_of_row[r], t_row[r]
            path = random_path(rng, parents[r][:t]) if t else []
            if not trees:
                path = list(range(rng.randint(0, t))) if t else []
            accepted[q] = len(path)
            counts[r] = len(path)
            paths[r, : len(path)] = torch.tensor(path, dtype=torch.int32)
            if path:
                truth[q] = nodes[path[-1]][r]
        if trees or not fused:  # the explicit commit (a tree needs its path)
            commit_drafts(plan, tensors, num_accepted=counts, slot_indices=slots,
                          accepted_path=paths if trees else None)  # fmt: skip
            for r in live_rows:
                cursors[seq_of_row[r]].commit(accepted[seq_of_row[r]])
            accepted = None
    for name, t in tensors.items():  # slots no row named: bit for bit
        index = [0, num_slots - 2, num_slots - 1]
        assert torch.equal(t[index].view(torch.uint8), kept[name].view(torch.uint8)), name
    return worst
