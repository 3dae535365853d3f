"""Tensors a step writes must not share memory (replayssm_jit.core.checks.check_disjoint): an `out`,
a workspace or a slot tensor laid over another slot tensor would let the kernels overwrite slots
no row names. Every op rejects that before anything changes, on every backend."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import mamba2_decode, mamba2_layout, mamba2_verify, plan_decode, reset_slots
from replayssm_jit.core.checks import check_disjoint

H, P, N, G = 4, 16, 32, 2


def _pool(drafts=1, slots=6):
    layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=4, drafts=drafts,
                           act_dtype=torch.float32)  # fmt: skip
    tensors = layout.allocate(slots, "cpu")
    reset_slots(layout, tensors, list(range(slots)), torch.randn(slots, H, P, N))
    return layout, tensors


def _inputs(batch, lead=()):
    gen = torch.Generator().manual_seed(0)
    return dict(
        x=torch.randn(batch, *lead, H, P, generator=gen),
        dt=torch.randn(batch, *lead, H, generator=gen),
        A=-torch.rand(H, generator=gen) - 0.5,
        B=torch.randn(batch, *lead, G, N, generator=gen),
        C=torch.randn(batch, *lead, G, N, generator=gen),
        D=torch.randn(H, generator=gen),
        dt_bias=torch.randn(H, generator=gen),
    )


def _snapshot(tensors):
    return {k: v.clone() for k, v in tensors.items()}


def _unchanged(before, tensors):
    return all(
        torch.equal(before[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in before
    )


def test_decode_rejects_out_over_the_state():
    layout, tensors = _pool()
    plan = plan_decode(layout, 2, device="cpu")
    out = tensors["state"].view(-1)[: 2 * H * P].view(2, H, P)  # the checkpoint's first values
    before = _snapshot(tensors)
    with pytest.raises(ValueError, match=r"(out|state): expected memory disjoint from (state|out)"):
        mamba2_decode(plan, **tensors, **_inputs(2), slot_indices=torch.tensor([1, 2],
                      dtype=torch.int32), out=out)  # fmt: skip
    assert _unchanged(before, tensors)


def test_decode_rejects_a_workspace_over_the_cursors():
    layout, tensors = _pool()
    plan = plan_decode(layout, 2, device="cpu")
    workspace = tensors["cursors"].view(torch.float32).view(-1)
    before = _snapshot(tensors)
    with pytest.raises(ValueError, match="expected memory disjoint"):
        mamba2_decode(plan, **tensors, **_inputs(2), slot_indices=torch.tensor([1, 2],
                      dtype=torch.int32), workspace=workspace)  # fmt: skip
    assert _unchanged(before, tensors)


def test_verify_rejects_out_over_a_ring():
    layout, tensors = _pool(drafts=2)
    plan = plan_decode(layout, 2, device="cpu")
    out = tensors["rec_x"].view(-1)[: 2 * 2 * H * P].view(2, 2, H, P)
    before = _snapshot(tensors)
    with pytest.raises(ValueError, match="expected memory disjoint"):
        mamba2_verify(plan, **tensors, **_inputs(2, (2,)), slot_indices=torch.tensor([1, 2],
                      dtype=torch.int32), out=out)  # fmt: skip
    assert _unchanged(before, tensors)


def test_separate_tensors_pass_and_empty_ones_are_ignored():
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    check_disjoint({"a": a, "b": b, "c": None, "d": torch.zeros(0)})
    with pytest.raises(ValueError, match="^b: expected memory disjoint from a"):
        check_disjoint({"a": a, "b": a[1:, 1:]})
    # Interleaved views of one buffer count as overlapping (their byte extents cross).
    with pytest.raises(ValueError, match="expected memory disjoint"):
        check_disjoint({"even": a[:, 0::2], "odd": a[:, 1::2]})
