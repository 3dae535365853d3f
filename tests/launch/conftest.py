"""Fixtures of the launch tests."""

from __future__ import annotations

import pytest

from replayssm_jit.launch import tuning


@pytest.fixture
def planned_configs(monkeypatch) -> list:
    """The LaunchConfigs plan_decode hands the policy after each tuning lookup, newest last (a
    CPU plan launches nothing, so the config is what shows what a tuning file chose)."""
    seen = []
    real = tuning.tuned_config

    def spy(config, tuning_file, spec, mode, batch, device):
        got = real(config, tuning_file, spec, mode, batch, device)
        seen.append(got)
        return got

    monkeypatch.setattr("replayssm_jit.ops.plan.tuned_config", spy)
    return seen
