"""Speculative verify and commit on e4m3 / NVFP4 checkpoints and separate mode's read copies, on
the torch path (docs/speculative.md, docs/precision.md), and the CUDA modules' refusal of them.

Bounds (support/verify_formats.py emulates in float64 what the path stores):
  - outputs: relative error 5e-5 against the emulation, which starts from the copy a verify reads,
    decoded exactly; only FP32 arithmetic separates them (the decode tests' 2e-5, with margin for
    the longer windows of a verify: L + T records);
  - the copies stored by an early flush: within one code of the emulation's folded float64 state
    (RN rounds the FP32 value, half a code, a tie possibly the other way; SR under one code);
  - against the same accepted tokens run as plain decode steps (a flush mask forcing the flush
    where the verify flushed early): the same bits wherever the records do not depend on the
    state's rounding order (Mamba-2, any mode; the delta rule in separate mode, whose flush
    recomputes every u from the carried copy); the delta rule's one-copy runs differ (below).
"""

from __future__ import annotations

import random

import pytest
import torch
from support.verify_formats import (
    DTYPES,
    FAMS,
    SlotModel,
    assert_within_one_code,
    decoded,
    rel_err,
    stored_block,
)
from support.verify_schedule import Cursor, random_path, random_tree

from replayssm_jit import (
    commit_drafts,
    commit_snapshots,
    mamba2_snapshot_verify,
    plan_decode,
    reset_slots,
)
from replayssm_jit.families.schema import COMMIT_READ_RING_PARAMS
from replayssm_jit.families.spec import check_cuda_spec, make_spec
from replayssm_jit.jit.build import load_module, render
from replayssm_jit.ops.library import COMMIT_RING_ARGS, plan_handle

I32 = torch.int32
SEED = 5
OUT_TOL = 5e-5

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")

# (family, state, read copy) for every family's formats (NVFP4 and separate where built)
CASES = [
    *[(f, "e4m3", None) for f in ("mamba2", "gdn", "kda")],
    *[(f, "nvfp4", None) for f in ("mamba2", "gdn", "kda")],
    *[(f, "f32", r) for f in ("mamba2", "gdn") for r in ("e4m3", "bf16", "nvfp4")],
]


def _id(case):
    fam, state, read = case
    return f"{fam}-{state}" + (f"+{read}" if read else "")


def start(fam, state, read, L, T, slots=5, sr=False):
    gen = torch.Generator().manual_seed(SEED)
    layout = fam.layout(state, read, L, T)
    tensors = layout.allocate(slots, "cpu")
    for name in layout.ring_names:  # a read of a row no record was written to shows NaN
        tensors[name].fill_(float("nan"))
    init = 0.5 * torch.randn(slots, *fam.state_shape(), generator=gen)
    reset_slots(layout, tensors, torch.arange(slots), init)
    opts = dict(fam.options, stochastic_rounding=sr)
    return gen, layout, tensors, opts


def run_formats_schedule(case, *, trees, fused, sr=False, steps=14, L=4, T=3, via_op=False):
    """Rows on slots 1 and 3 and a pad row, random draft counts, trees or chains, fused or
    explicit commits: outputs, cursors and flushed copies against the emulation; slots no row
    names, and checkpoints no flush wrote, bit for bit."""
    name, state, read = case
    fam = FAMS[name]()
    gen, layout, tensors, opts = start(fam, state, read, L, T, sr=sr)
    rng = random.Random(SEED)
    plan = plan_decode(layout, 3, device="cpu", seed=SEED, **opts)
    params = fam.params(gen)
    live = [1, 3]
    models = {s: SlotModel(fam, tensors, s, read is not None) for s in live}
    cursors = {s: Cursor() for s in live}
    accepted, flushes = None, 0
    for step in range(steps):
        slot_row = [3, -1, 1] if step % 2 else [1, 3, -1]
        slots = torch.tensor(slot_row, dtype=I32)
        t_row = [rng.randint(1, T) if s >= 0 else 0 for s in slot_row]
        trees_now = [random_tree(rng, t, rng.choice(["chain", "star", "random"])) if trees
                     else list(range(-1, t - 1)) for t in t_row]  # fmt: skip
        parents = [p + [-1] * (T - len(p)) for p in trees_now]
        drafts = fam.drafts(gen, 3, T)
        kw = dict(num_drafts=torch.tensor(t_row, dtype=I32))
        if trees:
            kw["parents"] = torch.tensor(parents, dtype=I32)
        if fused and accepted is not None:
            kw["num_accepted"] = torch.tensor([accepted.get(s, 0) for s in slot_row], dtype=I32)
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
        out = torch.full((3, T, *fam.state_shape()[:2]), float("nan"))
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
        paths = torch.zeros(3, T, dtype=I32)
        for r, s in enumerate(slot_row):
            if s < 0:
                continue
            t = t_row[r]
            path = random_path(rng, trees_now[r]) if trees else list(range(rng.randint(0, t)))
            accepted[s] = len(path)
            paths[r, : len(path)] = torch.tensor(path, dtype=I32)
            if not fused or trees:
                models[s].commit(path)
        if not fused or trees:
            counts = torch.tensor([accepted.get(s, 0) for s in slot_row], dtype=I32)
            args = dict(num_accepted=counts, slot_indices=slots,
                        accepted_path=paths if trees else None, parents=kw.get("parents"))  # fmt: skip
            if via_op:  # the registered op: rings by role, a read copy's after the three
                names = layout.ring_names
                rings = {**dict(zip(COMMIT_RING_ARGS, (tensors[n] for n in names[:3]))),
                         **dict(zip(COMMIT_READ_RING_PARAMS, (tensors[n] for n in names[3:])))}  # fmt: skip
                torch.ops.replayssm.commit_drafts(plan_handle(plan), cursors=tensors["cursors"],
                                                  **rings, **args)  # fmt: skip
            else:
                commit_drafts(plan, **tensors, **args)
            for s in live:
                cursors[s].commit(accepted[s])
            accepted = None
    for s in (0, 2, 4):  # never named
        assert all(torch.equal(tensors[n][s].view(torch.uint8), t.view(torch.uint8))
                   for n, t in start(fam, state, read, L, T, sr=sr)[2].items()
                   if n in layout.checkpoint_names for t in [t[s]])  # fmt: skip
    assert flushes >= 2, "the schedule must fold committed records early"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("trees, fused", [(False, True), (False, False), (True, False)],
                         ids=["chain-fused", "chain-explicit", "tree"])  # fmt: skip
def test_verify_schedules_on_formats_match_the_emulation(case, trees, fused):
    run_formats_schedule(case, trees=trees, fused=fused)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] is not None], ids=_id)
def test_tree_commits_through_the_registered_op_on_read_copies(case):
    """torch.ops.replayssm.commit_drafts takes a read copy's rings (GDN's v and beta) after the
    three by role, and moves them as the Python commit_drafts does."""
    run_formats_schedule(case, trees=True, fused=False, via_op=True)


def test_the_registered_commit_names_a_read_copy_ring_left_out():
    fam = FAMS["gdn"]()
    _gen, layout, tensors, opts = start(fam, "f32", "e4m3", 4, 3)
    plan = plan_decode(layout, 1, device="cpu", seed=SEED, **opts)
    rings = dict(zip(COMMIT_RING_ARGS, (tensors[n] for n in layout.ring_names[:3])))
    before = {k: t.clone() for k, t in tensors.items()}
    with pytest.raises((ValueError, TypeError), match="rec_v|rec_beta"):
        torch.ops.replayssm.commit_drafts(plan_handle(plan), cursors=tensors["cursors"], **rings,
                                          num_accepted=torch.tensor([1], dtype=I32),
                                          slot_indices=torch.tensor([1], dtype=I32))  # fmt: skip
    assert all(
        torch.equal(t.view(torch.uint8), before[k].view(torch.uint8)) for k, t in tensors.items()
    )


@pytest.mark.parametrize("case", [("mamba2", "e4m3", None), ("gdn", "f32", "nvfp4"),
                                  ("kda", "nvfp4", None)], ids=_id)  # fmt: skip
def test_verify_schedules_under_stochastic_rounding(case):
    run_formats_schedule(case, trees=False, fused=True, sr=True)


# ---------------------------------------------------------------------------------------------
# The same accepted tokens as plain decode steps
# ---------------------------------------------------------------------------------------------

BIT_EXACT = {("mamba2", False), ("mamba2", True), ("gdn", True)}  # (family, separate)


def twin_run(case, sr, *, L=4, T=3, steps=16):
    """Verifies with fused commits of random counts on slot 1, and a twin pool that decodes the
    accepted tokens one at a time, its flush forced (flush_mask) on the last token an early
    flush folded; returns the largest difference in codes' bits seen at those flushes (0 where
    every copy's bits agree) and the number of flushes compared."""
    name, state, read = case
    fam = FAMS[name]()
    gen, layout, tensors, opts = start(fam, state, read, L, T, sr=sr)
    twin_layout = fam.layout(state, read, L + T + 1, 1)  # never flushes unasked
    twin = twin_layout.allocate(5, "cpu")
    reset_slots(twin_layout, twin, torch.arange(5), decoded(tensors, "state", torch.arange(5)))
    for n in layout.checkpoint_names:  # (reset encodes from FP32: start from the same bits)
        twin[n].copy_(tensors[n])
    plan = plan_decode(layout, 1, device="cpu", seed=SEED, **opts)
    twin_plan = plan_decode(twin_layout, 1, device="cpu", seed=SEED, flush_mask=True, **opts)
    params = fam.params(gen)
    rng = random.Random(SEED)
    slots, cursor = torch.tensor([1], dtype=I32), Cursor()
    buffered, accepted, compared, differs, worst = [], None, 0, False, 0.0
    for _ in range(steps):
        drafts = fam.drafts(gen, 1, T)
        kw = {} if accepted is None else {"num_accepted": torch.tensor([accepted], dtype=I32)}
        flush = cursor.verify(T, accepted, L, T)
        fam.verify_op(plan, **tensors, **params, **drafts, slot_indices=slots, **kw)
        if flush:
            for i, tok in enumerate(buffered):
                mask = torch.tensor([i == len(buffered) - 1])
                fam.decode_op(twin_plan, **twin, **params, **tok, slot_indices=slots,
                              flush_mask=mask)  # fmt: skip
            buffered, compared = [], compared + 1
            differs |= any(not torch.equal(tensors[n][1].view(torch.uint8),
                                           twin[n][1].view(torch.uint8))
                           for n in layout.checkpoint_names)  # fmt: skip
            index = torch.tensor([1])
            a, b = decoded(tensors, "state", index)[0], decoded(twin, "state", index)[0]
            worst = max(worst, rel_err(a, b))
        accepted = rng.randint(0, T)
        buffered += [{k: v[:, j] for k, v in drafts.items()} for j in range(accepted)]
    return differs, worst, compared


# The unit roundoff of a one-copy format: e4m3's 3 mantissa bits, NVFP4's e2m1 (half its gap
# of 0.5 at 1).
UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "nvfp4": 2.0**-2}


@pytest.mark.parametrize("sr", [False, True], ids=["rn", "sr"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_verify_then_commit_is_the_decode_steps(case, sr):
    """Bit for bit where BIT_EXACT says. The delta rule's one-copy runs differ: a verify computes
    each draft's u with its own order of FP32 additions (a masked window of L + T records) and,
    after an early flush, from the folded FP32 state rather than its stored copy (as a flushing
    step's output is), where a decode step reads the stored copy. The u's then differ by that
    one rounding of the checkpoint times beta |k^| <= 1, so the next stored checkpoints differ,
    relative to their norm, by less than the format's unit roundoff (measured: up to 0.012 for
    e4m3, 0.045 for NVFP4)."""
    name, state, read = case
    differs, worst, compared = twin_run(case, sr)
    assert compared >= 2
    if (name, read is not None) in BIT_EXACT:
        assert not differs, "the copies' bits differ from the decode steps'"
    else:
        assert worst < UNIT_ROUNDOFF[state], f"relative difference {worst:.3e}"


# ---------------------------------------------------------------------------------------------
# The CUDA modules refuse these specs (the kernels do not read scaled or two-copy checkpoints
# in verify yet)
# ---------------------------------------------------------------------------------------------

CUDA_REFUSAL = "^drafts: expected 1 for a CUDA module .*the torch path.*CUDA kernels do not yet"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_cuda_modules_with_drafts_on_these_formats_are_refused(case):
    name, state, read = case
    fam = FAMS[name]()
    spec = fam.layout(state, read, 4, 3)  # the layout (and so its spec) is the torch path's
    spec = plan_decode(spec, 2, device="cpu", **fam.options).spec
    assert spec.has_verify
    with pytest.raises(ValueError, match=CUDA_REFUSAL):
        check_cuda_spec(spec)
    with pytest.raises(ValueError, match=CUDA_REFUSAL):  # every JIT / AOT route renders first
        render(spec)
    with pytest.raises(ValueError, match=CUDA_REFUSAL):
        load_module(spec)


def test_cuda_plan_is_refused_before_any_build(monkeypatch):
    """plan_decode on a CUDA device checks the spec before the launch policy and the load."""
    import replayssm_jit.ops.plan as plan_mod

    fam = FAMS["mamba2"]()
    layout = fam.layout("e4m3", None, 4, 3)
    monkeypatch.setattr(plan_mod, "resolve_device", lambda d: torch.device("cuda", 0))
    with pytest.raises(ValueError, match=CUDA_REFUSAL):
        plan_decode(layout, 2, device="cuda", **fam.options)


def test_cuda_keeps_the_one_copy_16_bit_specs_with_drafts():
    shape = FAMS["mamba2"]()
    spec = make_spec("mamba2", plan_shape(shape), window=4, drafts=3, state_dtype="bf16")
    assert check_cuda_spec(spec) is spec
    assert check_cuda_spec(make_spec("mamba2", plan_shape(shape), window=4, drafts=1,
                                     state_dtype="e4m3"))  # fmt: skip


def plan_shape(fam):
    return fam.layout("f32", None, 4, 1).shape


def test_formats_take_every_dtype_listed():
    assert set(DTYPES) >= {state for _, state, _ in CASES}


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "mamba2"], ids=_id)
def test_the_snapshot_baseline_refuses_these_formats_and_writes_nothing(case):
    """The snapshot baseline copies plain state slots: on a scaled or two-copy checkpoint it
    would copy codes without their scales, so both of its ops refuse by name, writing nothing."""
    name, state, read = case
    fam = FAMS[name]()
    gen, layout, tensors, opts = start(fam, state, read, 4, 2)
    plan = plan_decode(layout, 1, device="cpu", seed=SEED, **opts)
    before = {k: t.clone() for k, t in tensors.items()}
    slots, snaps = torch.tensor([1]), torch.tensor([[2, 3]])
    refusal = "^plan: expected a layout with one f32/bf16/f16 checkpoint"
    with pytest.raises(ValueError, match=refusal):
        commit_snapshots(plan, state=tensors["state"], snapshot_slots=snaps,
                         num_accepted=torch.tensor([1]), slot_indices=slots)  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        mamba2_snapshot_verify(plan, state=tensors["state"], **fam.params(gen),
                               **fam.drafts(gen, 1, 2), slot_indices=slots,
                               snapshot_slots=snaps)  # fmt: skip
    for k, t in tensors.items():  # bit for bit (rings hold NaN)
        assert torch.equal(
            t.contiguous().view(torch.uint8), before[k].contiguous().view(torch.uint8)
        ), k
