"""benchmarks/accuracy_study.py: the emulated decodes follow the float64 reference where they
round nothing, and rank as the two-precision design says they must where they round."""

from __future__ import annotations

import sys

import pytest
from support.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import accuracy_study as study


def _errors(labels, steps=1024, family="mamba2"):
    configs = [c for c in study.CONFIGS if c.label in labels]
    res = study.run(seed=0, steps=steps, m_lo=0.002, m_hi=0.03, configs=configs, family=family)
    return {label: row[steps] for label, row in res["ssm_part_error"].items()}


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_replay_rounds_once_per_window_and_separate_keeps_lp_error_out_of_the_recurrence(family):
    err = _errors(
        {"replay FP32", "conv FP32", "separate FP32 + FP8", "shared FP8+SR"}, family=family
    )
    assert err["replay FP32"] < err["conv FP32"] / 2 < 1e-6  # 16x fewer roundings
    assert err["shared FP8+SR"] > 1.5 * err["separate FP32 + FP8"] > 0.01  # issue 18: >= 1.9x at 8K


def test_bad_steps_are_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        study.main(["--steps", "100"])
    assert "--steps: expected a multiple of 16" in capsys.readouterr().err
