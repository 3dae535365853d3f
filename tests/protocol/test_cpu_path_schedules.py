"""Each family's ReplaySSM and conventional step schedules on the torch path against the oracles."""

from __future__ import annotations

import random

import pytest
import torch
from support.cpu_path import (
    BF16,
    F16,
    F32,
    F64,
    NUM_SLOTS,
    SPARE,
    GDNCase,
    KDACase,
    Mamba2Case,
    assert_rel,
    assert_same_bits,
    check_untouched,
    fresh_pool,
    one_step,
)

SLOT_START = {1: 0, 2: 1, 3: 2, 4: 3}  # named slots, and the step each joins at (staggered)


# One intra-op thread (conftest's single_thread): tiny tensors, and threads contend on a busy box.
pytestmark = pytest.mark.usefixtures("single_thread")


def make_batch(rng: random.Random, step: int, pad: int) -> list[int]:
    """This step's slot per batch row: the slots that have joined (each skipped at random),
    shuffled, with up to two pad rows among them."""
    rows = [s for s, start in SLOT_START.items() if step >= start and rng.random() > 0.15]
    for _ in range(rng.randint(0, 2)):
        rows.insert(rng.randint(0, len(rows)), pad)
    rng.shuffle(rows)
    return rows


def check_rows(case, out, y_ref: dict[int, torch.Tensor], slots_list, pad, what) -> None:
    for b, s in enumerate(slots_list):
        if s == pad:
            assert bool((out[b] == 0).all()), f"{what}: pad row {b} not zero"
        else:
            assert_rel(out[b], y_ref[b], f"{what}: output row {b} (slot {s})", case.tol_out)


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
        tok, out = one_step(case, gen, pool, slots_list, pad, replay=True, fes=fes, seed=seed)
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
                assert_rel(pool.state[s], seq.checkpoint, f"{what}: state {s}", case.tol_state)
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
        tok, out = one_step(case, gen, pool, slots_list, pad, replay=False, seed=seed)
        slots = torch.tensor(slots_list, dtype=torch.int32)
        y = case.pool_step(ref_state, slots, tok, pad)
        what = f"conventional step {step}"
        check_rows(case, out, dict(enumerate(y)), slots_list, pad, what)
        for s in range(NUM_SLOTS):
            if s in slots_list and s != pad:
                assert_rel(pool.state[s], ref_state[s], f"{what}: state {s}", case.tol_state)
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
    one_step(case, gen, pool, [1, 2], replay=True)
    g = pool.rings["rec_g"][[1, 2], :, 0]  # [2, HV, K]
    assert bool(torch.isfinite(g).all()) and bool((g < 0).all())
    assert float((g.amax(-1) - g.amin(-1)).min()) > 1e-3
