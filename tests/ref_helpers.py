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
