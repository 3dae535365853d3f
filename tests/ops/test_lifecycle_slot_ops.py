"""Slot ops' contract: what reset_slots, copy_slots and cache.fork write; bad ids change nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.lifecycle import (
    FAMILIES,
    GPU,
    Mamba2,
    assert_slots_kept,
    engine_tensors,
    same_bits,
    snapshot,
)

from replayssm_jit import Mamba2DecodeCache, copy_slots, reset_slots

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")


# ---------------------------------------------------------------------------------------------
# The ops' contract: what they write, and arguments checked before anything changes
# ---------------------------------------------------------------------------------------------


def small_tensors(device, num_slots=6, window=4, family=None):
    fam = family or Mamba2()
    layout = fam.layout(window, torch.float32)
    gen = torch.Generator(device=device).manual_seed(3)
    return layout, engine_tensors(layout, num_slots, gen, device, window)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("fam", FAMILIES)
def test_reset_slots_writes_only_the_checkpoints_and_cursors_of_its_slots(fam, dev):
    layout, tensors = small_tensors(dev, family=fam)
    before = snapshot(tensors)
    reset_slots(layout, tensors, torch.tensor([4, 1], device=dev))  # int64 ids are fine
    init = torch.randn(1, *tensors["state"].shape[1:], dtype=torch.float64)  # on the CPU
    reset_slots(layout, tensors, [2], init)
    assert torch.equal(tensors["state"][[4, 1]], torch.zeros_like(tensors["state"][[4, 1]]))
    assert torch.equal(tensors["state"][2], init[0].to(device=dev, dtype=torch.float32))
    assert torch.equal(tensors["cursors"][[1, 2, 4]], torch.zeros(3, 4, dtype=torch.int32,
                                                                  device=dev))  # fmt: skip
    for name in layout.ring_names:  # stale ring rows stay (the cursor holds none of them)
        assert same_bits(tensors[name], before[name]), name
    assert_slots_kept(before, tensors, [0, 3, 5])
    # The rings may be left out: only the checkpoints and cursors are written.
    reset_slots(layout, {"state": tensors["state"], "cursors": tensors["cursors"]}, [0])
    assert tensors["cursors"][0].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("fam", FAMILIES)
def test_copy_slots_copies_every_tensor_of_a_slot(fam, dev):
    layout, tensors = small_tensors(dev, family=fam)
    before = snapshot(tensors)
    copy_slots(layout, tensors, [3, 3, 0], torch.tensor([5, 1, 2], device=dev))
    for name, t in tensors.items():
        for src, dst in ((3, 5), (3, 1), (0, 2)):
            assert same_bits(t[dst], before[name][src]), (name, dst)
    assert_slots_kept(before, tensors, [0, 3, 4])
    copy_slots(layout, tensors, [], [])  # nothing to copy


def bad_calls(layout, tensors):
    """(op, args, kwargs, error, message pattern) for reset_slots and copy_slots."""
    state = tensors["state"]
    init = torch.zeros(1, *state.shape[1:])
    return [
        (reset_slots, ("layout", tensors, [0]), {}, TypeError, "^layout: expected a CacheLayout"),
        (reset_slots, (layout, [state], [0]), {}, TypeError, "^tensors: expected a mapping"),
        (reset_slots, (layout, {**tensors, "rec_X": state}, [0]), {}, ValueError,
         r"^tensors: expected names from \['state', .*got \['rec_X'\]"),
        (reset_slots, (layout, {**tensors, "cursors": None}, [0]), {}, TypeError,
         "^cursors: expected a torch.Tensor, got NoneType"),
        (reset_slots, (layout, {**tensors, "state": state[:5]}, [0]), {}, ValueError,
         r"^rec_x: expected 5 slots \(as state\), got 6"),
        (reset_slots, (layout, {**tensors, "state": state.double()}, [0]), {}, TypeError,
         "^state: expected dtype torch.float32, got torch.float64"),
        (reset_slots, (layout, tensors, [6]), {}, ValueError,
         r"^slots: expected slot ids in \[0, 6\), got 6$"),
        (reset_slots, (layout, tensors, [-1]), {}, ValueError, r"^slots: .* got -1$"),
        (reset_slots, (layout, tensors, [0]), dict(pad_slot_id=0), ValueError,
         r"^slots: expected slot ids in \[0, 6\) other than pad_slot_id=0, got 0$"),
        (reset_slots, (layout, tensors, [2, 2]), {}, ValueError,
         "^slots: expected distinct slot ids, got 2 twice$"),
        (reset_slots, (layout, tensors, [1.0]), {}, TypeError, "^slots: expected int slot ids"),
        (reset_slots, (layout, tensors, [True]), {}, TypeError, "^slots: expected int slot ids"),
        (reset_slots, (layout, tensors, torch.tensor([0.0])), {}, TypeError,
         "^slots: expected an integer tensor, got dtype torch.float32$"),
        (reset_slots, (layout, tensors, torch.tensor([[0]])), {}, ValueError,
         r"^slots: expected a 1-D tensor, got shape \[1, 1\]$"),
        (reset_slots, (layout, tensors, 0), {}, TypeError,
         "^slots: expected an int tensor or a list of ints, got int$"),
        (reset_slots, (layout, tensors, [0, 1], init), {}, ValueError,
         r"^initial_state: expected shape \[2, "),
        (reset_slots, (layout, tensors, [0], init.int()), {}, TypeError,
         "^initial_state: expected a floating dtype, got torch.int32$"),
        (reset_slots, (layout, tensors, [0]), dict(pad_slot_id=1.0), TypeError,
         "^pad_slot_id: expected an int"),
        (reset_slots, (layout, tensors, [0]), dict(check_slot_values=1), TypeError,
         "^check_slot_values: expected a bool"),
        (reset_slots, (layout, tensors, [0]), dict(check_slot_values=False), TypeError,
         r"^slots: expected an int tensor on cpu \(check_slot_values=False\), got list$"),
        (copy_slots, (layout, tensors, [0], [1, 2]), {}, ValueError,
         r"^dst: expected 1 slot ids \(as src\), got 2$"),
        (copy_slots, (layout, tensors, [0, 1], [2, 2]), {}, ValueError,
         "^dst: expected distinct slot ids, got 2 twice$"),
        (copy_slots, (layout, tensors, [0, 1], [2, 0]), {}, ValueError,
         "^dst: expected slot ids not in src, got 0$"),
        (copy_slots, (layout, tensors, [7], [1]), {}, ValueError,
         r"^src: expected slot ids in \[0, 6\), got 7$"),
        (copy_slots, (layout, tensors, [1], [0]), dict(pad_slot_id=0), ValueError,
         r"^dst: expected slot ids in \[0, 6\) other than pad_slot_id=0, got 0$"),
        (copy_slots, (layout, {k: v for k, v in tensors.items() if k != "rec_dt"}, [0], [1]), {},
         TypeError, "^rec_dt: expected a torch.Tensor, got NoneType"),
    ]  # fmt: skip


def test_bad_arguments_are_named_and_change_nothing():
    layout, tensors = small_tensors("cpu")
    before = snapshot(tensors)
    calls = bad_calls(layout, tensors)
    for op, args, kwargs, error, match in calls:
        with pytest.raises(error, match=match):
            op(*args, **kwargs)
        assert_slots_kept(before, tensors, range(6))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])
def test_unchecked_slot_ids_are_used_as_given(dev):
    """check_slot_values=False reads no id on the host (no sync): the ids must be a tensor on
    the tensors' device, and are then the caller's responsibility."""
    layout, tensors = small_tensors(dev)
    before = snapshot(tensors)
    ids = torch.tensor([3], dtype=torch.int32, device=dev)
    reset_slots(layout, tensors, ids, check_slot_values=False)
    copy_slots(layout, tensors, ids, ids + 1, check_slot_values=False)
    assert tensors["cursors"][3].tolist() == [0, 0, 0, 0]
    for name, t in tensors.items():
        assert same_bits(t[4], t[3]), name
    assert_slots_kept(before, tensors, [0, 1, 2, 5])
    if dev == "cuda":
        with pytest.raises(ValueError, match="^slots: expected device cuda"):
            reset_slots(layout, tensors, ids.cpu(), check_slot_values=False)


def test_cache_fork_and_reset():
    cache = Mamba2DecodeCache(5, num_heads=4, headdim=16, dstate=16, ngroups=2, window=4,
                              device="cpu", pad_slot_id=0)  # fmt: skip
    a = cache.allocate(1)
    cache.state[a.long()] = 1.5
    cache.cursors[a.long(), 0] = 2
    with pytest.raises(ValueError, match=r"^dst: expected allocated slot ids, got 2 \(free\)$"):
        cache.fork(a, [2])
    with pytest.raises(ValueError, match=r"^src: expected allocated slot ids, got 3 \(free\)$"):
        cache.fork([3], [2])
    with pytest.raises(ValueError, match="^dst: .* other than pad_slot_id=0, got 0$"):
        cache.fork(a, [0])
    b = cache.allocate(2)
    with pytest.raises(ValueError, match="^dst: expected slot ids not in src"):
        cache.fork(torch.cat([a, a]), [int(a), int(b[0])])
    cache.fork(torch.cat([a, a]), b)
    for name, t in cache.tensors.items():
        assert torch.equal(t[b.long()], t[a.long()].expand_as(t[b.long()])), name
    assert cache.records_held(b).tolist() == [2, 2]
    with pytest.raises(ValueError, match="^slots: expected distinct slot ids, got 2 twice$"):
        cache.reset([2, 2])
    cache.reset(b[:1])
    assert cache.records_held(b).tolist() == [0, 2]


@settings(max_examples=120, deadline=None)
@given(
    op=st.sampled_from(["reset", "copy"]),
    src=st.lists(st.integers(-2, 7), max_size=4),
    dst=st.lists(st.integers(-2, 7), max_size=4),
    as_tensor=st.booleans(),
    pad=st.sampled_from([None, -1, 0]),
)
def test_fuzzed_slot_ids_succeed_or_raise_and_change_nothing(op, src, dst, as_tensor, pad):
    layout, tensors = small_tensors("cpu")
    before = snapshot(tensors)
    ids = (lambda v: torch.tensor(v, dtype=torch.int32)) if as_tensor else list
    try:
        if op == "reset":
            reset_slots(layout, tensors, ids(src), pad_slot_id=pad)
        else:
            copy_slots(layout, tensors, ids(src), ids(dst), pad_slot_id=pad)
    except (TypeError, ValueError) as exc:
        assert str(exc).split(":")[0] in ("slots", "src", "dst"), str(exc)
        assert_slots_kept(before, tensors, range(6))
        return
    targets = set(src) if op == "reset" else set(dst)
    assert all(0 <= s < 6 and s != pad for s in targets)
    assert_slots_kept(before, tensors, [s for s in range(6) if s not in targets])
