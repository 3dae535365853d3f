"""The torch path's random verify / commit / step schedule against a reference sequence per slot."""

from __future__ import annotations

import random

import pytest
import torch
from support.checks import same_bits
from support.verify_cpu import (
    I32,
    NUM_SLOTS,
    Plans,
    assert_rel,
    assert_slots_unchanged,
    clone,
    int32_rows,
    new_pool,
    over_families,
)

from replayssm_jit import commit_drafts
from replayssm_jit.reference import root_path

NAMED = (1, 2, 3, 4)  # slots the schedules name; 5..7 never (0 may be the pad slot)

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")  # tiny tensors


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
