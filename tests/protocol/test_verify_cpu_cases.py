"""Targeted verify / commit cases on the torch path, and the conventional snapshot baseline."""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.checks import same_bits
from support.verify_cpu import (
    F32,
    F64,
    I32,
    NUM_SLOTS,
    Mamba2,
    Plans,
    assert_rel,
    assert_slots_unchanged,
    clone,
    int32_rows,
    new_pool,
    over_families,
    start_pool,
    verify_fresh,
)

from replayssm_jit import commit_drafts, commit_snapshots, copy_slots, plan_decode, reset_slots
from replayssm_jit.core import codecs
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.torch_path import Pool, Rows

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")  # tiny tensors


# ---------------------------------------------------------------------------------------------
# Targeted cases
# ---------------------------------------------------------------------------------------------


@over_families
def test_early_flush_boundary_both_ways(fam):
    """From n = L + 1 committed records in two slots, one verify: t = T - 2 (n + t = L + T - 1)
    holds them, t = T - 1 (n + t = L + T) folds them first: cursor words, checkpoints and outputs
    as the reference's."""
    L, T = 4, 4
    gen, layout, tensors, plans = start_pool(fam, L, T, 1)
    seqs = {s: fam.sequence(tensors["state"][s], L, T) for s in (1, 2)}
    for accept in (3, 2):  # n = 3, then 5 = L + 1
        tok, _ = verify_fresh(fam, plans, tensors, gen, [1, 2])
        commit_drafts(plans(2), tensors, num_accepted=torch.tensor([accept, accept], dtype=I32),
                      slot_indices=torch.tensor([1, 2], dtype=I32))  # fmt: skip
        for b, s in enumerate((1, 2)):
            seqs[s].verify(**fam.ref_inputs(tok, (b, slice(0, T))))
            seqs[s].commit(accept)
    assert tensors["cursors"][1:3].tolist() == [[L + 1, 0, 0, 0]] * 2
    before = clone(tensors)
    drafts = torch.tensor([T - 2, T - 1], dtype=I32)
    tok, out = verify_fresh(fam, plans, tensors, gen, [1, 2], num_drafts=drafts)
    for b, (s, t) in enumerate(((1, T - 2), (2, T - 1))):
        ys = seqs[s].verify(**fam.ref_inputs(tok, (b, slice(0, t))))
        assert_rel(out[b, :t], ys, f"slot {s} drafts")
        assert bool((out[b, t:] == 0).all())
    assert seqs[1].n == L + 1 and seqs[2].n == 0
    assert tensors["cursors"][1].tolist() == [L + 1, 0, 0, T - 2]  # held, no flush
    assert tensors["cursors"][2].tolist() == [0, 1, 0, T - 1]  # folded, epoch advanced
    assert same_bits(tensors["state"][1], before["state"][1])
    assert_rel(tensors["state"][2], seqs[2].checkpoint, "folded checkpoint")
    # The drafts' records at rows n + j: after the flush from row 0.
    name = layout.ring_names[-1]  # the scalar ring (dt or g) is written for every draft
    assert bool(torch.isfinite(tensors[name][1][:, L + 1 : L + T - 1]).all())
    assert same_bits(tensors[name][1][:, L + T - 1 :], before[name][1][:, L + T - 1 :])
    assert bool(torch.isfinite(tensors[name][2][:, : T - 1]).all())


@over_families
def test_tree_commit_compacts_the_path(fam):
    """A tree verify, then commit of the path 1 -> 2 -> 3 (draft 0 rejected): every ring's rows
    n + 1.. n + 3 move to n .. n + 2, nothing else moves; the next step sees exactly the path."""
    L, T = 4, 4
    gen, layout, tensors, plans = start_pool(fam, L, T, 2)
    seq = fam.sequence(tensors["state"][3], L, T)
    tok, _ = verify_fresh(fam, plans, tensors, gen, [3])  # a chain of 2 committed: n = 2
    seq.verify(**fam.ref_inputs(tok, (0, slice(0, T))))
    commit_drafts(plans(1), tensors, num_accepted=torch.tensor([2], dtype=I32),
                  slot_indices=torch.tensor([3], dtype=I32))  # fmt: skip
    seq.commit(2)
    parents = [-1, -1, 1, 2]
    tok, out = verify_fresh(fam, plans, tensors, gen, [3], parents=int32_rows([parents]))
    assert_rel(out[0], seq.verify(parents=parents, **fam.ref_inputs(tok, 0)), "tree outputs")
    before = clone(tensors)
    commit_drafts(plans(1), tensors, num_accepted=torch.tensor([3], dtype=I32),
                  slot_indices=torch.tensor([3], dtype=I32),
                  accepted_path=int32_rows([[1, 2, 3, 0]]))  # fmt: skip
    seq.commit([1, 2, 3])
    assert tensors["cursors"][3].tolist() == [5, 0, 0, 0]
    for name in layout.ring_names:
        ring, old = tensors[name][3], before[name][3]
        assert same_bits(ring[:, 2:5], old[:, 3:6]), name
        assert same_bits(ring[:, :2], old[:, :2]) and same_bits(ring[:, 5:], old[:, 5:]), name
    step = fam.tokens(gen, 1)
    out = fam.decode_op(plans(1), **tensors, **step, **fam.layer(),
                        slot_indices=torch.tensor([3], dtype=I32))  # fmt: skip
    assert_rel(out[0], seq.step(**fam.ref_inputs(step, 0)), "step after the tree commit")
    assert tensors["cursors"][3].tolist() == [0, 1, 0, 0]  # 5 + 1 >= L: flushed
    assert_rel(tensors["state"][3], seq.checkpoint, "checkpoint")


@over_families
def test_uncommitted_verify_then_standard_step(fam):
    """A verify whose commit never comes: a plain step refuses to drop its drafts silently; with
    num_accepted=0 it rejects them (word 3 back to 0) and replays only the committed records."""
    L, T = 4, 3
    gen, _, tensors, plans = start_pool(fam, L, T, 3, pad=0)
    seq = fam.sequence(tensors["state"][1], L, T)
    step = fam.tokens(gen, 2)
    fam.decode_op(plans(2), **tensors, **step, **fam.layer(),
                  slot_indices=torch.tensor([0, 1], dtype=I32))  # fmt: skip
    seq.step(**fam.ref_inputs(step, 1))
    tok, out = verify_fresh(fam, plans, tensors, gen, [1, 0])
    assert bool((out[1] == 0).all())
    assert_rel(out[0], seq.verify(**fam.ref_inputs(tok, 0)), "drafts")
    assert tensors["cursors"][1].tolist() == [1, 0, 0, T]
    seq.drop_pending()
    step = fam.tokens(gen, 1)
    with pytest.raises(ValueError, match="num_accepted: expected the accepted counts"):
        fam.decode_op(plans(1), **tensors, **step, **fam.layer(),
                      slot_indices=torch.tensor([1], dtype=I32))  # fmt: skip
    for i in range(3):  # held 1 -> 2 -> 3 -> flush (n + 1 >= L)
        step = fam.tokens(gen, 1)
        reject = {"num_accepted": torch.zeros(1, dtype=I32)} if i == 0 else {}
        out = fam.decode_op(plans(1), **tensors, **step, **fam.layer(),
                            slot_indices=torch.tensor([1], dtype=I32), **reject)  # fmt: skip
        assert_rel(out[0], seq.step(**fam.ref_inputs(step, 0)), "step")
        assert tensors["cursors"][1].tolist() == [seq.n, int(seq.n == 0), 0, 0]
    assert_rel(tensors["state"][1], seq.checkpoint, "checkpoint")


@over_families
def test_corrupted_cursors_fault_only_their_rows(fam):
    """n outside [0, L + T), p outside [0, T], or n + p > L + T - 1: in eager mode the ops raise
    a ValueError naming cursors and change nothing; the CPU path itself (what runs inside a
    graph's kernels) gives those rows NaN outputs and touches nothing of their slots. n = L + T
    - 1 with p = 0 is a state commits leave, not a fault."""
    L, T = 2, 3
    gen, layout, tensors, plans = start_pool(fam, L, T, 4)
    bad = {1: [L + T, 0], 2: [0, T + 1], 3: [L, T], 4: [-1, 0]}
    for s, (n, p) in bad.items():
        tensors["cursors"][s, 0], tensors["cursors"][s, 3] = n, p
    tensors["cursors"][5, 0] = L + T - 1  # valid: n + p = L + T - 1
    for name in layout.ring_names:  # records to hold (the steps below read slots 3 and 5's)
        tensors[name].copy_(0.3 * torch.randn(tensors[name].shape, generator=gen))
    before = clone(tensors)
    for s in bad:
        with pytest.raises(
            ValueError, match=rf"^cursors: expected a cursor a step leaves in slot {s}"
        ):
            verify_fresh(fam, plans, tensors, gen, [s, 5], num_accepted=torch.zeros(2, dtype=I32))
        with pytest.raises(
            ValueError, match=rf"^cursors: expected a cursor a step leaves in slot {s}"
        ):
            commit_drafts(plans(1), tensors, num_accepted=torch.zeros(1, dtype=I32),
                          slot_indices=torch.tensor([s], dtype=I32))  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"
    rows = [1, 2, 3, 4, 5]
    setup = torch_path.StepScalars(True, False, L, frozenset(plans(5).spec.flags), -1, 0, T)
    op = {
        "mamba2": torch_path.mamba2_verify,
        "gdn": torch_path.gdn_verify,
        "kda": torch_path.kda_verify,
    }[fam.name]
    out = torch.empty(5, T, *fam.out_row)
    op(
        setup,
        _torch_pool(tensors, layout),
        _torch_inputs(fam, fam.tokens(gen, 5, T)),
        Rows(torch.tensor(rows, dtype=I32), out, num_accepted=torch.zeros(5, dtype=I32)),
    )
    assert bool(torch.isnan(out[:4]).all()) and bool(torch.isfinite(out[4]).all())
    assert_slots_unchanged(tensors, before, [1, 2, 3, 4, 6, 7], "verify")
    assert tensors["cursors"][5].tolist() == [0, 1, 0, T]  # L + T - 1 + T >= L + T: flushed
    before = clone(tensors)
    torch_path.commit(
        setup,
        _torch_pool(tensors, layout),
        Rows(torch.tensor(rows, dtype=I32), num_accepted=torch.tensor([0, 0, 0, 0, 1], dtype=I32)),
        None,
    )
    assert_slots_unchanged(tensors, before, [1, 2, 3, 4, 6, 7], "commit")
    assert tensors["cursors"][5].tolist() == [1, 1, 0, 0]


@over_families
def test_device_values_are_clamped_by_the_cpu_path(fam):
    """What the kernels do with values the eager checks would refuse: num_drafts clamped to
    [0, T], a parent outside [-1, j) read as -1, num_accepted clamped to [0, p], a path index
    clamped into [0, p)."""
    L, T = 4, 3
    gen, layout, tensors, plans = start_pool(fam, L, T, 5)
    twin = clone(tensors)
    setup = torch_path.StepScalars(True, False, L, frozenset(plans(2).spec.flags), -1, 0, T)
    tok = fam.tokens(gen, 2, T)
    op = {
        "mamba2": torch_path.mamba2_verify,
        "gdn": torch_path.gdn_verify,
        "kda": torch_path.kda_verify,
    }[fam.name]
    inputs = _torch_inputs(fam, tok)
    outs = []
    for pool, nd, par in ((tensors, [9, -4], [[-1, 5, 1], [-1, 0, -7]]),
                          (twin, [T, 0], [[-1, -1, 1], [-1, 0, -1]])):  # fmt: skip
        out = torch.empty(2, T, *fam.out_row)
        op(setup, _torch_pool(pool, layout), inputs,
           Rows(torch.tensor([1, 2], dtype=I32), out, num_drafts=torch.tensor(nd, dtype=I32),
                parents=int32_rows(par)))  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert all(same_bits(tensors[k], twin[k]) for k in tensors)
    for pool, acc, path in ((tensors, [5, 3], [[2, 9, 0], [0, 0, 0]]),
                            (twin, [T, 0], [[2, 2, 0], [0, 0, 0]])):  # fmt: skip
        torch_path.commit(setup, _torch_pool(pool, layout),
                          Rows(torch.tensor([1, 2], dtype=I32),
                               num_accepted=torch.tensor(acc, dtype=I32)),
                          int32_rows(path))  # fmt: skip
    assert all(same_bits(tensors[k], twin[k]) for k in tensors)


def _torch_pool(tensors, layout) -> Pool:
    """The torch path's pool of a layout's tensors: state, rings and cursors."""
    return Pool.named({n: tensors[n] for n in ("state", *layout.ring_names, "cursors")})


def _torch_inputs(fam, tok):
    """The bindings' inputs by name (torch_path.*_verify) of the ops' token inputs."""
    if fam.name == "mamba2":
        return dict(x=tok["x"], z=tok["z"], dt=tok["dt"], A=fam.A, D=fam.D, dt_bias=fam.dt_bias,
                    B=tok["B"], C=tok["C"])  # fmt: skip
    extra = {"lower_bound": 0.0} if fam.name == "kda" else {}
    return dict(q=tok["q"], k=tok["k"], v=tok["v"], gate_a=tok["a"], gate_b=tok["b"],
                A_log=fam.A_log, dt_bias=fam.dt_bias, scale=fam.K**-0.5, **extra)  # fmt: skip


@over_families
def test_early_flush_rounds_stochastically_by_the_epoch_read_first(fam):
    """A bf16 checkpoint's early flush with "sr": round_stochastic of the FP32 fold (from a twin
    pool with an FP32 checkpoint of the same values) with rounding_bits(seed, slot << 32 |
    epoch, element), the epoch as the verify read it."""
    L, T, seed = 2, 2, 2**62 + 7
    gen = torch.Generator().manual_seed(6)
    fam.params(gen)
    if fam.name == "mamba2":  # (16-bit state rows: a whole row tile)
        fam.P = 16
    else:
        fam.V = 16
    pools, plans = [], []
    for dtype in (torch.bfloat16, F32):
        layout = fam.layout(L, T, state_dtype=dtype)
        pools.append(new_pool(fam, layout, torch.Generator().manual_seed(7)))
        opts = dict(fam.options, stochastic_rounding=dtype != F32)
        plans.append(plan_decode(layout, 1, device="cpu", seed=seed, **opts))
    pools[1]["state"].copy_(pools[0]["state"].to(F32))
    for pool in pools:
        pool["cursors"][2, 1] = -3  # any epoch (int32)
    toks = [fam.tokens(gen, 1, T) for _ in range(2)]
    for i, tok in enumerate(toks):  # the second verify commits 2: n + t = L + T, a flush first
        outs = []
        for pool, plan in zip(pools, plans):
            accept = torch.tensor([0 if i == 0 else 2], dtype=I32)
            outs.append(fam.verify_op(plan, **pool, **tok, **fam.layer(), num_accepted=accept,
                                      slot_indices=torch.tensor([2], dtype=I32)))  # fmt: skip
        assert torch.equal(outs[0], outs[1])
    assert pools[0]["cursors"][2].tolist() == [0, -2, 0, T]
    element = torch.arange(pools[1]["state"][2].numel(), dtype=torch.int64)
    stream = torch.tensor(2 << 32, dtype=torch.int64) | -3  # (an int32 epoch sign-extends)
    rbits = codecs.rounding_bits(seed, stream, element)
    want = codecs.round_stochastic(pools[1]["state"][2].flatten(), rbits, torch.bfloat16)
    assert same_bits(pools[0]["state"][2].flatten(), want)


# ---------------------------------------------------------------------------------------------
# The conventional spec baseline
# ---------------------------------------------------------------------------------------------


@over_families
@pytest.mark.parametrize("pad", [-1, 0])
def test_snapshot_matches_reference_conventional_steps(fam, pad):
    """Each row's t drafts as a chain of the reference conventional step from its slot: outputs,
    and the state after draft j in snapshot_slots[b, j]; the live slots, the snapshot slots past
    t and every other slot untouched."""
    T = 3
    gen = torch.Generator().manual_seed(8)
    fam.params(gen)
    layout = fam.layout(4, T)
    tensors = new_pool(fam, layout, gen)
    state = {"state": tensors["state"]}
    num_slots = 14
    state["state"] = 0.5 * torch.randn(num_slots, *tensors["state"].shape[1:], generator=gen)
    plans = Plans(fam, layout, pad, mode="conventional")
    rows = [1, pad, 2, 3]
    drafts = [T, 2, 0, 2]
    snaps = [[4, 5, 6], [pad, pad, pad], [7, 8, 9], [10, 11, 12]]
    tok = fam.tokens(gen, 4, T)
    before = clone(state)
    out = fam.snapshot_op(plans(4), **state, **tok, **fam.layer(),
                          slot_indices=torch.tensor(rows, dtype=I32),
                          snapshot_slots=int32_rows(snaps),
                          num_drafts=torch.tensor(drafts, dtype=I32))  # fmt: skip
    written = set()
    for b, s in enumerate(rows):
        if s == pad:
            assert bool((out[b] == 0).all())
            continue
        ref = before["state"][s].to(F64)
        for j in range(drafts[b]):
            y, ref = fam.conv(ref, **fam.ref_inputs(tok, (b, j)))
            assert_rel(out[b, j], y, f"row {b} draft {j}")
            assert_rel(state["state"][snaps[b][j]], ref, f"row {b} snapshot {j}")
            written.add(snaps[b][j])
        assert bool((out[b, drafts[b] :] == 0).all())
    others = [s for s in range(num_slots) if s not in written]
    assert_slots_unchanged(state, before, others, "snapshot")


@over_families
def test_snapshot_baseline_agrees_with_verify_and_commit(fam):
    """100 random steps of the same drafts and accepted counts through ReplaySSM (verify, then
    commit_drafts or the next verify's fused commit; standard steps) and the conventional
    baseline (snapshot_verify, commit_snapshots; conventional steps): same outputs to 1e-5."""
    L, T, pad = 4, 3, 0
    gen = torch.Generator().manual_seed(9)
    rng = random.Random(9)
    fam.params(gen)
    layout = fam.layout(L, T)
    live = [1, 2, 3]
    replay = new_pool(fam, layout, gen)
    base = {"state": torch.zeros(4 + len(live) * T, *replay["state"].shape[1:])}
    base["state"][: NUM_SLOTS // 2] = replay["state"][: NUM_SLOTS // 2]
    snaps = int32_rows([[4 + T * i + j for j in range(T)] for i in range(len(live))]
                       + [[pad] * T])  # fmt: skip
    rows = torch.tensor([*live, pad], dtype=I32)
    replay_plan = plan_decode(layout, 4, device="cpu", pad_slot_id=pad, **fam.options)
    conv_plan = plan_decode(layout, 4, device="cpu", mode="conventional", pad_slot_id=pad,
                            **fam.options)  # fmt: skip
    owed = None  # accepted counts of the last verify, not committed yet
    for it in range(100):
        if rng.random() < 0.15:  # a standard step (the replay side commits what it owes first)
            if owed is not None:
                commit_drafts(replay_plan, replay, num_accepted=owed, slot_indices=rows)
                owed = None
            tok = fam.tokens(gen, 4)
            y1 = fam.decode_op(replay_plan, **replay, **tok, **fam.layer(), slot_indices=rows)
            y2 = fam.decode_op(conv_plan, **base, **tok, **fam.layer(), slot_indices=rows)
            assert_rel(y1[:3], y2[:3], f"step {it}")
            continue
        drafts = torch.tensor([rng.randint(0, T) for _ in range(4)], dtype=I32)
        tok = fam.tokens(gen, 4, T)
        fused = {} if owed is None or rng.random() < 0.5 else {"num_accepted": owed}
        if owed is not None and not fused:
            commit_drafts(replay_plan, replay, num_accepted=owed, slot_indices=rows)
        y1 = fam.verify_op(replay_plan, **replay, **tok, **fam.layer(), slot_indices=rows,
                           num_drafts=drafts, **fused)  # fmt: skip
        y2 = fam.snapshot_op(conv_plan, **base, **tok, **fam.layer(), slot_indices=rows,
                             snapshot_slots=snaps, num_drafts=drafts)  # fmt: skip
        if int(drafts[:3].sum()):
            assert_rel(y1[:3], y2[:3], f"verify {it}")
        assert bool((y1[3] == 0).all()) and bool((y2[3] == 0).all())
        owed = torch.tensor([rng.randint(0, int(t)) for t in drafts], dtype=I32)
        commit_snapshots(conv_plan, state=base["state"], snapshot_slots=snaps, num_accepted=owed,
                         slot_indices=rows)  # fmt: skip
    tok = fam.tokens(gen, 4, T)
    y1 = fam.verify_op(replay_plan, **replay, **tok, **fam.layer(), slot_indices=rows,
                       **({} if owed is None else {"num_accepted": owed}))  # fmt: skip
    y2 = fam.snapshot_op(conv_plan, **base, **tok, **fam.layer(), slot_indices=rows,
                         snapshot_slots=snaps)  # fmt: skip
    assert_rel(y1[:3], y2[:3], "final verify")


@pytest.mark.parametrize("pad", [-1, 0])
def test_commit_snapshots_copies_only_accepted_rows(pad):
    """Rows with a >= 1 copy snapshot a - 1 into their slot; a = 0 rows and pad rows copy
    nothing (their identity copies leave every bit), nor does a batch where no row accepts."""
    fam = Mamba2()
    layout = fam.layout(4, 3)
    plan = plan_decode(layout, 4, device="cpu", mode="conventional", pad_slot_id=pad,
                       **fam.options)  # fmt: skip
    state = torch.randn(12, *layout.tensors()[0].per_slot_shape)
    state[11] = math.nan  # bits an identity copy must keep
    rows = torch.tensor([1, pad, 2, 3], dtype=I32)
    snaps = int32_rows([[4, 5, 6], [11, 11, 11], [7, 8, 9], [10, 11, 9]])
    before = state.clone()
    commit_snapshots(plan, state=state, snapshot_slots=snaps, slot_indices=rows,
                     num_accepted=torch.tensor([2, 3, 0, 1], dtype=I32))  # fmt: skip
    assert same_bits(state[1], before[5]) and same_bits(state[3], before[10])
    keep = [s for s in range(12) if s not in (1, 3)]
    assert same_bits(state[keep], before[keep])
    before = state.clone()
    commit_snapshots(plan, state=state, snapshot_slots=snaps, slot_indices=rows,
                     num_accepted=torch.zeros(4, dtype=I32))  # fmt: skip
    assert same_bits(state, before)


@over_families
def test_chain_commit_of_a_tree_stays_within_its_chain(fam):
    """After a tree verify, a commit without accepted_path (drafts 0..a-1) past the chain the
    tree starts with is refused, and so is such a fused commit in the next verify: those drafts
    are no path of the tree. Within the chain it is taken, as after the slot is reset; a slot
    copied from one with a pending tree holds that tree."""
    gen, layout, tensors, plans = start_pool(fam, 4, 3, 11)
    rows = torch.tensor([1, 2], dtype=I32)
    tree = int32_rows([[-1, 0, 0], [-1, 0, 1]])  # slot 1: drafts 0, 1 a chain, 2 a sibling
    verify_fresh(fam, plans, tensors, gen, [1, 2], parents=tree)
    before = clone(tensors)
    refused = r"^num_accepted: expected at most 2 for row 0 \(slot 1\) without accepted_path"
    with pytest.raises(ValueError, match=refused):
        commit_drafts(plans(2), tensors, num_accepted=int32_rows([[3, 3]])[0], slot_indices=rows)
    with pytest.raises(ValueError, match=refused):
        verify_fresh(fam, plans, tensors, gen, [1, 2], num_accepted=int32_rows([[3, 1]])[0])
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"
    commit_drafts(plans(2), tensors, num_accepted=int32_rows([[2, 3]])[0], slot_indices=rows)
    assert tensors["cursors"][1, 0] == before["cursors"][1, 0] + 2

    verify_fresh(fam, plans, tensors, gen, [1, 2], parents=tree)
    reset_slots(layout, tensors, [1])
    verify_fresh(fam, plans, tensors, gen, [1], num_accepted=int32_rows([[0]])[0])
    commit_drafts(plans(1), tensors, num_accepted=int32_rows([[3]])[0], slot_indices=rows[:1])

    verify_fresh(fam, plans, tensors, gen, [1], parents=tree[:1])
    copy_slots(layout, tensors, [1], [3])
    copied = torch.tensor([3], dtype=I32)
    with pytest.raises(ValueError, match=r"^num_accepted: expected at most 2 for row 0 \(slot 3\)"):
        commit_drafts(plans(1), tensors, num_accepted=int32_rows([[3]])[0], slot_indices=copied)
    commit_drafts(plans(1), tensors, num_accepted=int32_rows([[2]])[0], slot_indices=copied)
