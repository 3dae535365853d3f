"""Shared scaffolding of the float64 reference tests (test_reference_*.py)."""

from __future__ import annotations

import torch

F64 = torch.float64


def rand(gen: torch.Generator, *shape: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=F64)


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def _schedule(
    fam, gen: torch.Generator, run_schedule, steps: int, *, L: int, T: int | None = None, **odds
) -> dict:
    """run_schedule's stats for `steps` tokens on a fresh sequence (window L, drafts T) of family
    `fam` (a test Family: state(), sequence(), conv, tokens), with run_schedule's p_* `odds`."""
    state = fam.state()
    seq = fam.sequence(state, L=L) if T is None else fam.sequence(state, L=L, T=T)
    return run_schedule(seq, state, fam.conv, fam.tokens, gen, steps, **odds)


def long_random_schedule(fam, gen: torch.Generator, L: int, run_schedule) -> None:
    """240 tokens of random flushes, verifies and commits on one sequence of family `fam`:
    every kind of event must occur."""
    stats = _schedule(fam, gen, run_schedule, 240, L=L, p_flush=min(0.03, 0.5 / L), p_spec=0.6)
    assert stats["tokens"] >= 200 and stats["window"] > 0 and stats["explicit"] > 0
    assert stats["chain"] > 0 and stats["tree"] > 0 and stats["accepted"] > 0
    assert stats["early"] > 0 or L > 4


def spec_only_schedule(fam, gen: torch.Generator, L: int, run_schedule) -> None:
    """Speculative steps only (no plain steps, no explicit flushes): the ring must still flush
    early when verified drafts would overflow it."""
    stats = _schedule(fam, gen, run_schedule, 100, L=L, p_flush=0.0, p_spec=1.0, p_tree=0.3)
    assert stats["early"] > 0 and stats["steps"] == 0


def full_head_schedule(fam, gen: torch.Generator, run_schedule) -> None:
    """A short speculative schedule (L = 4, T = 3) at a model's full head count."""
    stats = _schedule(fam, gen, run_schedule, 10, L=4, T=3, p_spec=0.4)
    assert stats["window"] + stats["early"] + stats["explicit"] > 0


def batched_pool_vs_replay(fam, step_pool, assert_rel) -> None:
    """Batch 3 (one padded row) through `step_pool` vs two per-sequence replays (L = 4), six
    steps: outputs and final checkpoints agree to 1e-12 and the padded row reads zero."""
    pool = fam.state(3)
    seqs = {0: fam.sequence(pool[2], L=4), 2: fam.sequence(pool[0], L=4)}
    slots = torch.tensor([2, -1, 0])
    for it in range(6):
        t = {k: v[:, 0] for k, v in fam.tokens(1, batch=3).items()}
        out = step_pool(pool, slots, **t)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        for b, seq in seqs.items():
            assert_rel(seq.step(**{k: v[b] for k, v in t.items()}), out[b], 1e-12, f"{it} row {b}")
    assert_rel(seqs[0].materialize(), pool[2], 1e-12, "slot 2")
    assert_rel(seqs[2].materialize(), pool[0], 1e-12, "slot 0")


def early_flush_boundary(fam, gen: torch.Generator, assert_rel, *, L: int = 4, T: int = 3) -> None:
    """The early flush of ``ReplaySequence.verify`` at its boundary, both ways, from n = L + 1
    committed records: n + t = L + T - 1 holds them (n and the checkpoint unchanged), n + t = L + T
    folds them (n = 0, the checkpoint is the conventional state). A verify whose commit never comes
    is dropped (``drop_pending``): nothing committed. Committing up to n = L + T - 1 leaves a
    state a standard step still replays (L + T records with its own token) and flushes."""
    state = fam.state()
    seq = fam.sequence(state, L=L, T=T)

    def accept(tokens, count):
        nonlocal state
        for i in range(count):
            _, state = fam.conv(state, **{k: v[i] for k, v in tokens.items()})

    def verify(t):
        drafts = fam.tokens(t)
        outs, s = seq.verify(**drafts), state
        for j in range(t):  # a chain: draft j follows the committed prefix and drafts 0..j-1
            y, s = fam.conv(s, **{k: v[j] for k, v in drafts.items()})
            assert_rel(outs[j], y, 1e-12, f"draft {j} of {t} at n = {seq.n}")
        return drafts

    for _ in range(L - 1):  # n = L - 1 without a flush
        tok = fam.tokens(1)
        seq.step(**{k: v[0] for k, v in tok.items()})
        accept(tok, 1)
    assert seq.n == L - 1 and not seq.last_step_flushed
    kept = seq.checkpoint.clone()
    accept(verify(T), 2)  # n + t = L + T - 1: no flush
    assert seq.n == L - 1 and torch.equal(seq.checkpoint, kept)
    seq.commit(2)
    assert seq.n == L + 1 and torch.equal(seq.checkpoint, kept)

    verify(T - 2)  # n + t = L + T - 1 again, now from n = L + 1: still no flush
    assert seq.n == L + 1 and torch.equal(seq.checkpoint, kept)
    seq.drop_pending()  # its commit never comes: nothing committed
    assert seq.n == L + 1 and torch.equal(seq.checkpoint, kept)
    seq.drop_pending()  # (a no-op without a pending verify)

    drafts = verify(T - 1)  # n + t = L + T: the committed records are folded, never the drafts
    assert seq.n == 0
    assert_rel(seq.checkpoint, state, 1e-12, "checkpoint after the early flush")
    seq.commit(T - 1)
    accept(drafts, T - 1)
    assert seq.n == T - 1
    assert_rel(seq.materialize(), state, 1e-12, "state after the commit")

    # Up to n = L + T - 1 committed records (no verify flushes below n + t = L + T) ...
    while seq.n < L + T - 1:
        t = min(T, L + T - 1 - seq.n)
        before = seq.n
        drafts = verify(t)
        assert seq.n == before
        seq.commit(t)
        accept(drafts, t)
    assert seq.n == L + T - 1
    # ... and a standard step replays all of them with its own token, then flushes.
    tok = fam.tokens(1)
    y = seq.step(**{k: v[0] for k, v in tok.items()})
    y_ref, state = fam.conv(state, **{k: v[0] for k, v in tok.items()})
    assert_rel(y, y_ref, 1e-12, "step at n = L + T - 1")
    assert seq.n == 0 and seq.last_step_flushed
    assert_rel(seq.checkpoint, state, 1e-12, "checkpoint after that step")
