"""benchmarks/accuracy_kernels.py on the CPU (the kernels' PyTorch twin): a short run writes its
JSON, markdown and plot; FP32 checkpoints follow the float64 decode to FP32 arithmetic, FP8 ones
are far off it, and the formats not built are listed as such."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from support.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import accuracy_kernels as kernels
import accuracy_study as study


def test_short_cpu_run_writes_ordered_errors(tmp_path):
    labels = ["conv FP32", "replay FP32", "shared FP8+SR", "separate FP32 + FP8", "shared NVFP4+SR"]
    # The first flush is at step 16: the windows (16, 32] and (32, 48] read stored checkpoints.
    argv = ["--device", "cpu", "--steps", "32,48", "--report-window", "16",
            "--configs", ",".join(labels), "--out", str(tmp_path)]  # fmt: skip
    assert kernels.main(argv) == 0
    res = json.loads((tmp_path / "accuracy-kernels-mamba2.json").read_text())
    assert res["environment"]["torch"] == torch.__version__
    assert res["environment"]["command"].startswith("python benchmarks/accuracy_kernels.py")
    assert not res["configs"]["shared NVFP4+SR"]["not_built"]
    assert res["configs"]["replay FP32"]["kernel"] == "per-item"
    errors = res["ssm_part_error"]
    assert set(errors) == set(labels)
    for n in ("32", "48"):
        err = {label: row[n] for label, row in errors.items()}
        assert all(math.isfinite(e) for e in err.values()), err
        fp32 = max(err["conv FP32"], err["replay FP32"])
        fp8 = min(err["shared FP8+SR"], err["separate FP32 + FP8"])
        assert fp32 < 1e-4 and fp8 > 1e-3 and fp8 > 1000 * fp32, err
        assert err["shared NVFP4+SR"] > err["shared FP8+SR"], err  # 4-bit values read worse
    text = (tmp_path / "accuracy-kernels-mamba2.md").read_text()
    assert "separate beats shared at FP8 reads @32" in text
    assert "separate beats shared at NVFP4 reads @32: n/a (separate FP32 + NVFP4: not run)" in text
    assert (tmp_path / "accuracy-kernels-mamba2.png").stat().st_size > 0


def test_gdn_runs_separate_mode_and_nvfp4():
    configs = {c.label: kernels.kernel_config(c, kernels.GDNInputs) for c in study.CONFIGS}
    assert not configs["separate FP32 + FP8"].not_built
    assert configs["separate FP32 + FP8"].read_dtype == torch.float8_e4m3fn
    assert not configs["shared NVFP4+SR"].not_built
    assert configs["separate FP32 + NVFP4"].read_dtype == torch.float4_e2m1fn_x2
    assert configs["shared FP8+SR"].state_dtype == torch.float8_e4m3fn
    assert configs["conv FP8+SR"].mode == "conventional" and configs["conv FP8+SR"].sr


def test_checks_compare_the_orderings_and_the_emulation():
    res = {"steps": [1024], "configs": {},
           "ssm_part_error": {"shared FP8+SR": {1024: 0.04}, "separate FP32 + FP8": {1024: 0.02},
                              "conv FP8+SR": {1024: 0.1}}}  # fmt: skip
    by_check = {c["check"]: c for c in kernels.checks(res, {"conv FP8+SR": {1024: 0.05}})}
    assert by_check["separate beats shared at FP8 reads"]["passed"]
    assert not by_check["separate FP32 + FP8 beats conv FP8+SR"]["passed"]  # 5x < 6x
    assert not by_check["conv FP8+SR / emulation"]["passed"]  # 2x off


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "100"], "--steps: expected ascending positive multiples of 16"),
        (["--steps", "64,32"], "--steps: expected ascending"),
        (["--steps", "32", "--report-window", "64"], "--report-window: expected 1 to 32"),
        (["--configs", "conv FP64"], "--configs: expected labels from"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        kernels.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
