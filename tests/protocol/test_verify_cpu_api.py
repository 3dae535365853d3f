"""The torch path's verify wrappers, and the ops' refusal of bad arguments and unfit plans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.checks import same_bits
from support.verify_cpu import (
    F32,
    FAMILIES,
    I32,
    Plans,
    assert_rel,
    clone,
    int32_rows,
    new_pool,
    over_families,
    start_pool,
    verify_fresh,
)

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    KDADecodeCache,
    KDADecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
    commit_drafts,
    commit_snapshots,
    plan_decode,
)

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")  # tiny tensors


# ---------------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------------


def _wrapper_call(fam, wrapper, tok, slots, **kwargs):
    """wrapper.verify with the family's positional inputs, the rest by name."""
    if fam.name == "mamba2":
        return wrapper.verify(tok["x"], tok["dt"], fam.A, tok["B"], tok["C"], slots, z=tok["z"],
                              D=fam.D, dt_bias=fam.dt_bias, **kwargs)  # fmt: skip
    return wrapper.verify(tok["q"], tok["k"], tok["v"], slots, a=tok["a"], b=tok["b"],
                          A_log=fam.A_log, dt_bias=fam.dt_bias, **kwargs)  # fmt: skip


WRAPPERS = {
    "mamba2": (Mamba2DecodeCache, Mamba2DecodeWrapper,
               dict(num_heads=4, headdim=8, dstate=16, ngroups=2)),
    "gdn": (GDNDecodeCache, GDNDecodeWrapper,
            dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)),
    "kda": (KDADecodeCache, KDADecodeWrapper,
            dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)),
}  # fmt: skip


@over_families
@pytest.mark.parametrize("graph", [False, True])
def test_wrappers_verify_and_commit(fam, graph):
    """verify() and commit() on the family's wrapper give the ops' results; with use_cuda_graph
    every verify writes the buffer fixed at plan()."""
    gen = torch.Generator().manual_seed(10)
    fam.params(gen)
    cache_cls, wrapper_cls, shape = WRAPPERS[fam.name]
    cache = cache_cls(4, **shape, window=4, drafts=3, act_dtype=F32, device="cpu")
    wrapper = wrapper_cls(cache, use_cuda_graph=graph)
    with pytest.raises(RuntimeError, match="^verify"):
        _wrapper_call(fam, wrapper, fam.tokens(gen, 2, 3), torch.zeros(2, dtype=I32))
    with pytest.raises(RuntimeError, match="^commit"):
        wrapper.commit(torch.zeros(2, dtype=I32), torch.zeros(2, dtype=I32))
    wrapper.plan(2, **fam.options)
    slots = cache.allocate(2)
    cache.reset(slots, 0.5 * torch.randn(2, *cache.state.shape[1:], generator=gen))
    seqs = [fam.sequence(cache.state[int(s)], 4, 3) for s in slots]
    outs = []
    for _ in range(3):
        tok = fam.tokens(gen, 2, 3)
        out = _wrapper_call(fam, wrapper, tok, slots, num_drafts=torch.tensor([3, 2], dtype=I32))
        outs.append(out)
        for b, seq in enumerate(seqs):
            t = 3 - b
            ys = seq.verify(**fam.ref_inputs(tok, (b, slice(0, t))))
            assert_rel(out[b, :t], ys, f"{fam.name} wrapper row {b}")
        wrapper.commit(torch.tensor([1, 2], dtype=I32), slots)
        seqs[0].commit(1)
        seqs[1].commit(2)
    assert cache.records_held(slots).tolist() == [seqs[0].n, seqs[1].n]
    assert (outs[0] is outs[1]) == graph


# ---------------------------------------------------------------------------------------------
# Bad arguments: a ValueError / TypeError naming the argument, raised before anything changes
# ---------------------------------------------------------------------------------------------

_CONTEXT: dict[str, tuple] = {}


def _context(name):
    """A pool after one verify of T = 3 drafts on slots 1 (t = 3) and 2 (t = 1): pending drafts
    for the commit and fused-commit checks. Built once per family."""
    if name not in _CONTEXT:
        fam = FAMILIES[name]()
        gen, layout, tensors, plans = start_pool(fam, 4, 3, 11)
        verify_fresh(fam, plans, tensors, gen, [1, 2], num_drafts=torch.tensor([3, 1], dtype=I32))
        conv = Plans(fam, layout, -1, mode="conventional")
        _CONTEXT[name] = fam, layout, tensors, plans, conv, gen
    return _CONTEXT[name]


def _bad_verify(fam, T, kind, row, j):
    """(override of the verify call's arguments, error type, argument named)."""
    lead = fam.tokens(torch.Generator().manual_seed(0), 2, T)
    first = "x" if fam.name == "mamba2" else "q"
    gate = "dt" if fam.name == "mamba2" else "a"
    parents = [[-1, 0, 1], [-1, 0, 1]]
    cases = {
        "drafts_over_T": ({first: fam.tokens(torch.Generator(), 2, T + 1)[first]}, ValueError,
                          first),
        "gate_over_T": ({gate: torch.zeros(2, T + 1, lead[gate].shape[-1])}, ValueError, gate),
        "act_dtype": ({first: lead[first].to(torch.bfloat16)}, TypeError, first),
        "gate_dtype": ({gate: lead[gate].double()}, TypeError, gate),
        "num_drafts_over_T": ({"num_drafts": torch.tensor([T + 1 + j, 0], dtype=I32).roll(row)},
                              ValueError, "num_drafts"),
        "num_drafts_negative": ({"num_drafts": torch.tensor([-1 - j, 1], dtype=I32).roll(row)},
                                ValueError, "num_drafts"),
        "num_drafts_dtype": ({"num_drafts": torch.ones(2, dtype=torch.int64)}, TypeError,
                             "num_drafts"),
        "num_drafts_shape": ({"num_drafts": torch.ones(3, dtype=I32)}, ValueError, "num_drafts"),
        "parent_not_earlier": ({"parents": _set(parents, row, j, j)}, ValueError, "parents"),
        "parent_below_minus_one": ({"parents": _set(parents, row, j, -2)}, ValueError, "parents"),
        "parents_shape": ({"parents": torch.full((2, T - 1), -1, dtype=I32)}, ValueError,
                          "parents"),
        "parents_strided": ({"parents": torch.full((T, 2), -1, dtype=I32).t()}, ValueError,
                            "parents"),
        "accepted_over_pending": ({"num_accepted": torch.tensor([4, 1], dtype=I32) if row == 0
                                   else torch.tensor([0, 2], dtype=I32)}, ValueError,
                                  "num_accepted"),
        "accepted_negative": ({"num_accepted": torch.tensor([-1, 0], dtype=I32).roll(row)},
                              ValueError, "num_accepted"),
        "accepted_dtype": ({"num_accepted": torch.zeros(2)}, TypeError, "num_accepted"),
        "out_shape": ({"out": torch.zeros(2, *fam.out_row)}, ValueError, "out"),
        "slot_twice": ({"slot_indices": torch.tensor([1, 1], dtype=I32)}, ValueError,
                       "slot_indices"),
        "seed_float": ({"seed": 1.5}, TypeError, "seed"),
    }  # fmt: skip
    return cases[kind]


def _set(rows, r, j, value):
    rows = [list(x) for x in rows]
    rows[r][j] = value
    return int32_rows(rows)


VERIFY_BAD = [
    "drafts_over_T", "gate_over_T", "act_dtype", "gate_dtype", "num_drafts_over_T",
    "num_drafts_negative", "num_drafts_dtype", "num_drafts_shape", "parent_not_earlier",
    "parent_below_minus_one", "parents_shape", "parents_strided", "accepted_over_pending",
    "accepted_negative", "accepted_dtype", "out_shape", "slot_twice", "seed_float",
]  # fmt: skip


@given(
    name=st.sampled_from(list(FAMILIES)),
    kind=st.sampled_from(VERIFY_BAD),
    row=st.integers(0, 1),
    j=st.integers(1, 2),
)
def test_verify_names_the_bad_argument(name, kind, row, j):
    fam, layout, tensors, plans, _, gen = _context(name)
    T = layout.drafts
    tok = fam.tokens(gen, 2, T)
    override, error, arg = _bad_verify(fam, T, kind, row, j)
    before = clone(tensors)
    args = dict(**tensors, **tok, **fam.layer(), slot_indices=torch.tensor([1, 2], dtype=I32))
    args.update(override)
    with pytest.raises(error, match=rf"^{arg}: expected"):
        fam.verify_op(plans(2), **args)
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"


COMMIT_BAD = {
    # (num_accepted, accepted_path or None, argument named); slot 1 has p = 3, slot 2 p = 1
    "accepted_over_pending": ([1, 2], None, "num_accepted"),
    "accepted_over_T": ([4, 0], None, "num_accepted"),
    "path_not_increasing": ([2, 0], [[1, 1, 0], [0, 0, 0]], "accepted_path"),
    "path_decreasing": ([2, 1], [[2, 1, 0], [0, 0, 0]], "accepted_path"),
    "path_past_pending": ([1, 1], [[0, 0, 0], [1, 0, 0]], "accepted_path"),
    "path_negative": ([1, 0], [[-1, 0, 0], [0, 0, 0]], "accepted_path"),
}


@given(name=st.sampled_from(list(FAMILIES)), kind=st.sampled_from(sorted(COMMIT_BAD)))
def test_commit_names_the_bad_argument(name, kind):
    _, _, tensors, plans, _, _ = _context(name)
    accepted, path, arg = COMMIT_BAD[kind]
    before = clone(tensors)
    with pytest.raises(ValueError, match=rf"^{arg}: expected"):
        commit_drafts(plans(2), tensors, num_accepted=torch.tensor(accepted, dtype=I32),
                      slot_indices=torch.tensor([1, 2], dtype=I32),
                      accepted_path=None if path is None else int32_rows(path))  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"


SNAPSHOT_BAD = {
    # (snapshot_slots, num_drafts or None, argument named); the rows' slots are 1 and 2
    "live_slot": ([[3, 4, 1], [5, 6, 7]], None, "snapshot_slots"),
    "twice": ([[3, 4, 5], [5, 6, 7]], None, "snapshot_slots"),
    "out_of_range": ([[3, 4, 8], [5, 6, 7]], None, "snapshot_slots"),
    "pad_id": ([[3, 4, -1], [5, 6, 7]], None, "snapshot_slots"),
    "drafts_over_T": ([[3, 4, 5], [6, 7, 0]], [4, 0], "num_drafts"),
}


@given(
    name=st.sampled_from(list(FAMILIES)),
    kind=st.sampled_from([*sorted(SNAPSHOT_BAD), "dtype", "shape"]),
)
def test_snapshot_names_the_bad_argument(name, kind):
    fam, layout, tensors, _, conv, gen = _context(name)
    state = {"state": tensors["state"]}
    tok = fam.tokens(gen, 2, layout.drafts)
    drafts, arg = None, "snapshot_slots"
    if kind == "dtype":
        snaps, error = torch.zeros(2, 3, dtype=torch.int64), TypeError
    elif kind == "shape":
        snaps, error = torch.zeros(2, 2, dtype=I32), ValueError
    else:
        rows, drafts, arg = SNAPSHOT_BAD[kind]
        snaps, error = int32_rows(rows), ValueError
        drafts = None if drafts is None else torch.tensor(drafts, dtype=I32)
    before = clone(tensors)
    with pytest.raises(error, match=rf"^{arg}: expected"):
        fam.snapshot_op(conv(2), **state, **tok, **fam.layer(), snapshot_slots=snaps,
                        slot_indices=torch.tensor([1, 2], dtype=I32),
                        num_drafts=drafts)  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"
    with pytest.raises(ValueError, match=r"^num_accepted: expected values in \[0, 3\]"):
        commit_snapshots(conv(2), state=tensors["state"], snapshot_slots=int32_rows([[3, 4, 5],
                         [5, 6, 7]]), num_accepted=torch.tensor([4, 0], dtype=I32),
                         slot_indices=torch.tensor([1, 2], dtype=I32))  # fmt: skip
    with pytest.raises(ValueError, match="^snapshot_slots: expected .* no row's slot_indices"):
        commit_snapshots(conv(2), state=tensors["state"], snapshot_slots=int32_rows([[3, 2, 5],
                         [5, 6, 7]]), num_accepted=torch.tensor([2, 0], dtype=I32),
                         slot_indices=torch.tensor([1, 2], dtype=I32))  # fmt: skip
    assert all(same_bits(tensors[k], before[k]) for k in tensors), "a failed call wrote"


@over_families
def test_plans_that_cannot_verify_are_refused(fam):
    """T = 1 layouts, conventional plans for verify and commit, the other family's plan: a
    ValueError naming plan, before anything is read. The baseline takes plans of either mode."""
    gen = torch.Generator().manual_seed(12)
    fam.params(gen)
    one = fam.layout(4, 1)
    tensors = new_pool(fam, one, gen)
    tok = fam.tokens(gen, 1, 1)
    slots = torch.tensor([1], dtype=I32)
    plan = plan_decode(one, 1, device="cpu", **fam.options)
    with pytest.raises(ValueError, match=r"^plan: expected a layout with drafts in \[2, 8\]"):
        fam.verify_op(plan, **tensors, **tok, **fam.layer(), slot_indices=slots)
    layout = fam.layout(4, 2)
    tensors = new_pool(fam, layout, gen)
    tok = fam.tokens(gen, 1, 2)
    conv = plan_decode(layout, 1, device="cpu", mode="conventional", **fam.options)
    replay = plan_decode(layout, 1, device="cpu", **fam.options)
    with pytest.raises(ValueError, match="^plan: expected a plan of mode='replay'"):
        fam.verify_op(conv, **tensors, **tok, **fam.layer(), slot_indices=slots)
    with pytest.raises(ValueError, match="^plan: expected a plan of mode='replay'"):
        commit_drafts(conv, tensors, num_accepted=torch.zeros(1, dtype=I32), slot_indices=slots)
    for plan in (conv, replay):
        out = fam.snapshot_op(plan, state=tensors["state"], **tok, **fam.layer(),
                              slot_indices=slots, snapshot_slots=int32_rows([[2, 3]]))  # fmt: skip
        assert bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match=r"^plan: expected a layout with drafts in \[2, 8\]"):
        fam.snapshot_op(plan_decode(one, 1, device="cpu", mode="conventional", **fam.options),
                        state=new_pool(fam, one, gen)["state"], **fam.tokens(gen, 1, 1),
                        **fam.layer(), slot_indices=slots,
                        snapshot_slots=int32_rows([[2]]))  # fmt: skip
    other = next(f for f in FAMILIES.values() if f is not type(fam))()
    other_plan = plan_decode(other.layout(4, 2), 1, device="cpu", **other.options)
    with pytest.raises(ValueError, match="^plan: expected a"):
        fam.verify_op(other_plan, **tensors, **tok, **fam.layer(), slot_indices=slots)
    with pytest.raises(ValueError, match="^tensors: expected the layout's 'cursors' tensor"):
        commit_drafts(replay, {k: v for k, v in tensors.items() if k != "cursors"},
                      num_accepted=torch.zeros(1, dtype=I32), slot_indices=slots)  # fmt: skip
