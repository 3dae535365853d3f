"""Wrapper checks that need no GPU: slot ids are validated before anything is launched."""

import pytest
import torch

from replayssm_jit import Mamba2DecodeCache, Mamba2DecodeWrapper
from replayssm_jit.spec import mamba2_spec


def planned_wrapper(**kwargs):
    """A wrapper with its plan filled in by hand (plan() would load a CUDA module)."""
    cache = Mamba2DecodeCache(
        6, num_heads=4, headdim=8, dstate=16, ngroups=2, window=4, device="cpu"
    )
    wrapper = Mamba2DecodeWrapper(cache, **kwargs)
    wrapper.spec = mamba2_spec(headdim=8, dstate=16, heads_per_group=2, window=4)
    wrapper.batch_size = 2
    return wrapper, torch.zeros(2, 4, 8, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "slots, error, match",
    [
        ([0, 6], ValueError, r"slot_indices: expected values in \[0, 6\)"),
        ([1, 1], ValueError, "slot_indices: expected distinct slots"),
        ([0, 1, 2], ValueError, r"slot_indices: expected shape \[2\]"),
    ],
)
def test_bad_slot_ids_are_rejected(slots, error, match):
    wrapper, x = planned_wrapper()
    with pytest.raises(error, match=match):
        wrapper._begin_run(x, torch.tensor(slots, dtype=torch.int32), None)


def test_slot_value_check_can_be_skipped_but_not_the_layout_checks():
    for kwargs in (dict(check_slot_values=False), dict(use_cuda_graph=True)):
        wrapper, x = planned_wrapper(**kwargs)
        wrapper._begin_run(
            x, torch.tensor([0, 6], dtype=torch.int32), torch.empty(2, 4, 8)
        )  # not read
        with pytest.raises(TypeError, match="slot_indices: expected dtype torch.int32"):
            wrapper._begin_run(x, torch.tensor([0, 1]), None)


def test_run_before_plan_and_wrong_batch():
    cache = Mamba2DecodeCache(4, num_heads=4, headdim=8, dstate=16, ngroups=2, device="cpu")
    with pytest.raises(RuntimeError, match="plan"):
        Mamba2DecodeWrapper(cache)._begin_run(
            torch.zeros(2, 4, 8), torch.zeros(2, dtype=torch.int32), None
        )
    wrapper, _ = planned_wrapper()
    with pytest.raises(ValueError, match="batch: expected 2 rows"):
        wrapper._begin_run(torch.zeros(3, 4, 8), torch.zeros(3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="mode"):
        Mamba2DecodeWrapper(cache, mode="fast")
