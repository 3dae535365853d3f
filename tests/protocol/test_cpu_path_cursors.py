"""Torch-path cursor words, flush_every_step folds, pad-only batches, bad cursors and imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from support.cpu_path import (
    BF16,
    CASES,
    NUM_SLOTS,
    assert_rel,
    check_untouched,
    fresh_pool,
    one_step,
)

from replayssm_jit.core import codecs
from replayssm_jit.ops import torch_path

# One intra-op thread (conftest's single_thread): tiny tensors, and threads contend on a busy box.
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# Cursors, switching modes, edge cases
# ---------------------------------------------------------------------------------------------


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
    one_step(case, gen, pool, [1, 2], replay=True, fes=True)
    assert pool.cursors[1].tolist() == [0, 6, 9, 0]
    assert pool.cursors[2].tolist() == [0, -(2**31), 9, 0]  # the int32 epoch wraps
    pool.cursors[1, 3] = 77
    one_step(case, gen, pool, [1], replay=True, fes=True, flags=case.flags | {"sr"})
    assert pool.cursors[1].tolist() == [0, 7, 0, 0]
    pool.cursors[1:3, 3] = 77
    one_step(case, gen, pool, [1, 2], replay=True)  # window 4: append, held 1
    assert pool.cursors[1].tolist() == [1, 7, 0, 0]
    assert pool.cursors[2].tolist() == [1, -(2**31), 0, 0]
    one_step(case, gen, pool, [1], replay=True, fes=True)  # held 1: folds, clears the words
    assert pool.cursors[1].tolist() == [0, 8, 0, 0]
    for _ in range(3):  # held 1 -> 2 -> 3 -> flush
        one_step(case, gen, pool, [2], replay=True)
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
        tok, out = one_step(case, gen, pool, slots_list, replay=True, fes=fes)
        for b, s in enumerate(slots_list):
            if s < 0:
                assert bool((out[b] == 0).all())
                continue
            y = case.seq_step(seqs[s], tok, b)
            if fes:
                seqs[s].flush()
            assert_rel(out[b], y, f"fes={fes}: output of slot {s}", case.tol_out)
            assert int(pool.cursors[s, 0]) == seqs[s].n
        if fes:
            for s in (1, 3):
                assert_rel(pool.state[s], seqs[s].checkpoint, f"state {s}", case.tol_state)


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("replay", [True, False])
def test_pad_only_and_empty_batches(family, replay):
    case = CASES[family]()
    gen, pool = fresh_pool(case, 33)
    before = pool.clone()
    _, out = one_step(case, gen, pool, [0, 0, 0], pad=0, replay=replay)
    assert bool((out == 0).all())
    _, out = one_step(case, gen, pool, [], replay=replay)
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
