"""The main job on the CPU: the float64 reference backend and the package's CPU path (the same API
on CPU tensors), Mamba-2, GDN and KDA models, and the command line's argument errors."""

import subprocess
import sys

import pytest
import torch

from replayssm_jit.__main__ import main as cli
from replayssm_jit.cli.demo import run_demo
from replayssm_jit.core.version import __version__

pytestmark = pytest.mark.usefixtures("no_launch_env")

MODELS = ["nemotron-3-super-120b", "qwen3.5-4b", "kimi-linear-48b"]  # one per family


@pytest.mark.parametrize("model", MODELS)
def test_demo_reference_agrees_to_1e12(model):
    r = run_demo(model, batch=2, steps=10, window=4, layers=1, backend="reference", seed=3)
    assert r["backend"].startswith("reference")
    assert 0 < r["max_rel_diff"] < 1e-12
    assert r["flush_fraction"] == pytest.approx(2 / 10)  # tokens 4 and 8 of each sequence flush
    assert r["bytes"]["replay"] < r["bytes"]["conventional"]


@pytest.mark.parametrize("model", MODELS)
def test_demo_cpu_backend_runs_every_family(model):
    """The cpu backend (wrappers over the functional ops on CPU tensors: the PyTorch path) agrees
    to FP32 rounding and flushes and holds records as the reference does (its window policy:
    token 4 of each sequence flushes, after 0, 1, 2 and 3 held records)."""
    r = run_demo(model, batch=2, steps=4, window=4, layers=1, backend="cpu", seed=3)
    assert r["backend"].startswith("cpu")
    assert 0 < r["max_rel_diff"] < 1e-4
    assert r["flush_fraction"] == pytest.approx(1 / 4)
    assert r["mean_held"] == pytest.approx((0 + 1 + 2 + 3) / 4)
    assert r["bytes"]["replay"] < r["bytes"]["conventional"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks cuda where a GPU is present")
def test_demo_auto_backend_is_cpu_without_a_gpu():
    r = run_demo("qwen4b", batch=1, steps=1, window=4, layers=1, backend="auto", seed=0)
    assert r["backend"].startswith("cpu")


def test_demo_cli_prints_the_report(capsys):
    argv = ["--model", "super120b", "--steps", "5", "--window", "4", "--layers", "1"]
    assert cli(["demo", *argv, "--batch", "1", "--backend", "cpu"]) == 0
    text = capsys.readouterr().out
    for word in ("backend    cpu", "agreement", "conventional", "ReplaySSM"):
        assert word in text


def _argparse_error(capsys, argv) -> str:
    """`argv` exits as an argparse error does: code 2, usage and message on stderr, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert f"usage: python -m replayssm_jit {argv[0]}" in captured.err
    assert "Traceback" not in captured.err and not captured.out
    return captured.err


def test_demo_rejects_bad_arguments(capsys):
    assert "--steps: expected >= 1, got 0" in _argparse_error(capsys, ["demo", "--steps", "0"])
    assert "--window: expected at most 256" in _argparse_error(capsys, ["demo", "--window", "300"])
    err = _argparse_error(capsys, ["demo", "--model", "llama"])
    assert "--model: expected one of" in err and "'llama'" in err
    err = _argparse_error(capsys, ["demo", "--backend", "tpu"])
    assert "invalid choice: 'tpu'" in err
    with pytest.raises(ValueError, match="model"):
        run_demo("mamba-9000", 1, 1, 1, 1, "reference", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_demo_cuda_backend_without_a_gpu_is_an_argument_error(capsys):
    err = _argparse_error(capsys, ["demo", "--backend", "cuda"])
    assert "--backend cuda: no CUDA device is available here" in err


def test_aot_bogus_preset_is_an_argument_error(capsys):
    err = _argparse_error(capsys, ["aot", "--preset", "bogus"])
    assert "--preset: invalid choice: 'bogus'" in err


def test_version_flag_prints_the_one_version(capsys):
    """`--version` prints core/version.py's version, in process and through `python -m`."""
    assert cli(["--version"]) == 0
    assert capsys.readouterr().out == f"replayssm-jit {__version__}\n"
    run = subprocess.run(
        [sys.executable, "-m", "replayssm_jit", "--version"], capture_output=True, text=True
    )
    assert (run.returncode, run.stdout, run.stderr) == (0, f"replayssm-jit {__version__}\n", "")
    err = _usage_error(capsys, ["--version", "demo"])
    assert "expected a command, demo, aot or autotune, got '--version'" in err


def _usage_error(capsys, argv) -> str:
    """`argv` is refused by the dispatcher itself: exit 2, its usage on stderr, nothing on stdout."""
    assert cli(argv) == 2
    captured = capsys.readouterr()
    assert "| --version" in captured.err and not captured.out
    return captured.err
