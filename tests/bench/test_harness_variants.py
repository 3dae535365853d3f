"""The launch variants a --tiling-sweep times, for every checkpoint format it is given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import harness


@pytest.mark.parametrize("state", ["f32", "bf16sr", "e4m3", "f32+e4m3", "f32+nvfp4"])
def test_every_format_gets_each_kernel_on_each_tile(state):
    variants = harness.model_variants(("super120b", 8, 16, state))
    labels = [label for label, _config, _kernels in variants]
    assert len(labels) == len(set(labels))
    kernels = {config.kernel for _label, config, _kernels in variants}
    assert kernels == {"per-item", "flush-every-step", "split"}
    assert any(label.endswith("-nospec") for label in labels)
