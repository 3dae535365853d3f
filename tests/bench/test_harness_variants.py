"""The launch variants a --tiling-sweep times, for every checkpoint format it is given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from replayssm_jit.families.spec import spec_tilings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import harness


@pytest.mark.parametrize("state", ["f32", "bf16sr", "e4m3", "f32+e4m3", "f32+nvfp4"])
def test_every_format_gets_each_kernel_on_each_tile(state):
    spec = harness.format_spec("super120b", 16, state)
    assert (spec.read_dtype is not None) == ("+" in state) and ("sr" in spec.flags) == (
        "sr" in state
    )
    variants = harness.model_variants(("super120b", 8, 16, state))
    labels = [label for label, _config, _kernels in variants]
    assert len(labels) == len(set(labels))
    tiles = {rows for rows, _warps in spec_tilings(spec)}
    for kernel in ("per-item", "flush-every-step", "split"):
        assert {c.rows_per_cta for _l, c, _k in variants if c.kernel == kernel} == tiles, kernel
    assert any(label.endswith("-nospec") for label in labels)


def test_a_read_copy_has_no_conventional_spec():
    with pytest.raises(ValueError, match="f32\\+e4m3"):
        harness.format_spec("super120b", 1, "f32+e4m3")
