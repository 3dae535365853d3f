"""The lifecycle ops (reset_slots, copy_slots) and SlotCache.from_tensors reject slot tensors
that share memory (replayssm_jit.core.checks.check_disjoint), before anything changes: a write
through one would land in another's slots."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import Mamba2DecodeCache, copy_slots, mamba2_layout, reset_slots

H, P, N, G, SLOTS = 4, 16, 32, 2, 5
OVERLAP = "expected memory disjoint from"


def _layout():
    return mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=4, drafts=2,
                         act_dtype=torch.float32)  # fmt: skip


def _pool():
    layout = _layout()
    tensors = layout.allocate(SLOTS, "cpu")
    reset_slots(layout, tensors, list(range(SLOTS)), torch.randn(SLOTS, H, P, N))
    for name in layout.ring_names:
        tensors[name].copy_(torch.randn(tensors[name].shape).to(tensors[name].dtype))
    return layout, tensors


def _over_state(tensors, name):
    """A tensor of `name`'s shape and dtype laid over the checkpoint pool's first bytes."""
    like = tensors[name]
    flat = tensors["state"].view(like.dtype).view(-1)
    return flat[: like.numel()].view(like.shape)


def _bits(tensors):
    return {k: v.clone().view(torch.uint8) for k, v in tensors.items()}


def _same(before, tensors):
    return all(torch.equal(before[k], tensors[k].view(torch.uint8)) for k in before)


@pytest.mark.parametrize("name", ["cursors", "rec_x"])
def test_reset_slots_rejects_a_tensor_over_the_state(name):
    layout, tensors = _pool()
    tensors[name] = _over_state(tensors, name)
    before = _bits(tensors)
    with pytest.raises(ValueError, match=rf"^(state|{name}): {OVERLAP} (state|{name})"):
        reset_slots(layout, tensors, [1, 3])
    assert _same(before, tensors)


@pytest.mark.parametrize("name", ["cursors", "rec_b", "rec_dt"])
def test_copy_slots_rejects_a_tensor_over_the_state(name):
    layout, tensors = _pool()
    tensors[name] = _over_state(tensors, name)
    before = _bits(tensors)
    with pytest.raises(ValueError, match=OVERLAP):
        copy_slots(layout, tensors, [0], [2])
    assert _same(before, tensors)


def test_copy_slots_rejects_two_rings_in_one_buffer():
    layout, tensors = _pool()
    tensors["rec_dt"] = (
        tensors["rec_b"].view(-1)[: tensors["rec_dt"].numel()].view(tensors["rec_dt"].shape)
    )
    before = _bits(tensors)
    with pytest.raises(ValueError, match=r"^rec_(b|dt): expected memory disjoint from rec_"):
        copy_slots(layout, tensors, [0], [2])
    assert _same(before, tensors)


def test_from_tensors_rejects_shared_memory_and_takes_separate_tensors():
    layout, tensors = _pool()
    cache = Mamba2DecodeCache.from_tensors(layout, **tensors)
    assert cache.tensors["state"] is tensors["state"]
    shared = dict(tensors, cursors=_over_state(tensors, "cursors"))
    with pytest.raises(ValueError, match=OVERLAP):
        Mamba2DecodeCache.from_tensors(layout, **shared)


def test_lifecycle_ops_still_take_a_pool_without_rings():
    layout, tensors = _pool()
    rings_free = {k: v for k, v in tensors.items() if k not in layout.ring_names}
    reset_slots(layout, rings_free, [4])
    assert int(tensors["cursors"][4].abs().sum()) == 0
