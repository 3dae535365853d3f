"""benchmarks/accuracy_hf_kl.py on the CPU: a short teacher-forced run of both tiny models
writes its JSON, markdown and plots; the KL is finite and non-negative, FP32 checkpoints stay
at FP32 rounding noise, FP8 ones are far off it, and every format runs on both models."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

pytest.importorskip("transformers")
from support.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import accuracy_hf_kl as kl

LABELS = ["conv FP32", "replay FP32", "conv FP8+SR", "shared FP8+SR", "separate FP32 + FP8",
          "shared NVFP4+SR"]  # fmt: skip
FP32, FP8 = ("conv FP32", "replay FP32"), ("conv FP8+SR", "shared FP8+SR", "separate FP32 + FP8")


def test_short_cpu_run_writes_ordered_kl(tmp_path):
    # 32 steps: the rows' staggered flushes (window 16) fall inside both report windows.
    argv = ["--device", "cpu", "--tokens", "32", "--points", "16,32", "--report-window", "16",
            "--batch", "2", "--jobs", "1", "--configs", ",".join(LABELS),
            "--out", str(tmp_path)]  # fmt: skip
    assert kl.main(argv) == 0
    for name, family in (("nemotron_h", "mamba2"), ("qwen3_next", "gdn")):
        res = json.loads((tmp_path / f"accuracy-hf-kl-{name}.json").read_text())
        env = res["environment"]
        assert env["torch"] == torch.__version__ and env["transformers"]
        assert env["command"].startswith("python benchmarks/accuracy_hf_kl.py --device cpu")
        assert "commit" in env
        assert res["family"] == family and res["points"] == [16, 32]
        configs = res["configs"]
        assert not any(c["not_built"] for c in configs.values())  # (every format: Mamba-2 and GDN)
        assert configs["replay FP32"]["kernel"] == "per-item"
        built = [label for label in LABELS if not configs[label]["not_built"]]
        assert set(res["kl"]) == set(built)
        for n in ("16", "32"):
            values = {label: res["kl"][label][n] for label in built}
            assert all(math.isfinite(v) and v >= 0 for v in values.values()), values
            fp32 = max(values[label] for label in FP32)
            fp8 = min(values[label] for label in FP8 if label in values)
            assert fp32 < 1e-6 and fp8 > 1e-5 and fp8 > 1000 * fp32, values
        assert all(len(v) == 2 for v in res["kl_windows"].values())  # windows ending at 16, 32
        assert res["top1_agreement"]["replay FP32"] == 1.0
        assert (tmp_path / f"accuracy-hf-kl-{name}.png").stat().st_size > 0
    text = (tmp_path / "accuracy-hf-kl.md").read_text()
    assert "## nemotron_h (mamba2)" in text and "## qwen3_next (gdn)" in text
    assert "| shared NVFP4+SR | replay nvfp4 SR (per-item kernel) |" in text


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--tokens", "32", "--points", "16,64"], "--points: expected at most --tokens"),
        (["--configs", "shared FP4"], "--configs: expected labels"),
        (["--models", "mamba"], "--models: expected names"),
    ],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        kl.parse(["--device", "cpu", *argv])
    assert match in capsys.readouterr().err


def test_default_points_follow_the_tokens():
    args = kl.parse(["--device", "cpu", "--tokens", "600"])
    assert args.points == [256, 512, 600] and args.report_window == 128
    args = kl.parse(["--device", "cpu", "--tokens", "48"])
    assert args.points == [48] and args.report_window == 48
    assert kl.parse(["--device", "cpu"]).points == [256, 512, 1024, 2048]
