"""The main job on the CPU: the float64 reference backend, Mamba-2 and GDN models."""

import pytest

from replayssm_jit.__main__ import main as cli
from replayssm_jit.demo import run_demo


@pytest.mark.parametrize("model", ["nemotron-3-super-120b", "qwen3.5-4b"])
def test_demo_reference_agrees_to_1e12(model):
    r = run_demo(model, batch=2, steps=10, window=4, layers=1, backend="reference", seed=3)
    assert r["backend"].startswith("reference")
    assert 0 < r["max_rel_diff"] < 1e-12
    assert r["flush_fraction"] == pytest.approx(2 / 10)  # tokens 4 and 8 of each sequence flush
    assert r["bytes"]["replay"] < r["bytes"]["conventional"]


def test_demo_cli_prints_the_report(capsys):
    assert (
        cli(
            [
                "demo",
                "--model",
                "super120b",
                "--steps",
                "5",
                "--window",
                "4",
                "--layers",
                "1",
                "--batch",
                "1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for word in ("backend", "agreement", "conventional", "ReplaySSM"):
        assert word in text


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        cli(["demo", "--steps", "0"])
    with pytest.raises(ValueError, match="model"):
        run_demo("mamba-9000", 1, 1, 1, 1, "reference", 0)
