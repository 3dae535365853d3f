"""benchmarks/e2e (issue 37) at tiny dims through the ops' torch path: every mode runs for every
model, FP32 conventional and ReplaySSM give identical tokens across several flushes (the tiny
configs use window L = 4, so 24 steps cross 6 flushes), a replica that skips loading the
prefill state is caught, and the JSON holds the report's fields. No timing on the CPU."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from support.paths import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks.e2e import configs, run
from benchmarks.e2e.replica import MODES, Replica, Weights, acceptance_probs, refusal

STEPS = 24  # 6 flushes at the tiny window 4
WINDOW = 4

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")  # tiny tensors


@pytest.fixture(scope="module")
def tiny_weights():
    cache = {}

    def get(name):
        if name not in cache:
            cfg = configs.tiny(configs.get_config(name), window=WINDOW)
            cache[name] = Weights(cfg, "cpu", torch.float32, seed=0)
        return cache[name]

    return get


def test_real_configs_keep_the_published_layer_counts():
    counts = {name: {k: configs.MODELS[name]().count(k) for k in ("ssm", "attn", "mlp", "moe")}
              for name in configs.MODELS}  # fmt: skip
    assert counts["nemotron-3-nano-4b"] == dict(ssm=21, attn=4, mlp=17, moe=0)
    assert counts["nemotron-3-super-120b-a12b"] == dict(ssm=40, attn=8, mlp=0, moe=40)
    assert counts["qwen3.5-4b"] == dict(ssm=24, attn=8, mlp=32, moe=0)
    assert counts["qwen3.5-122b-a10b"] == dict(ssm=36, attn=12, mlp=0, moe=48)
    assert counts["kimi-linear-48b"] == dict(ssm=21, attn=6, mlp=1, moe=26)
    for name in configs.MODELS:
        cfg = configs.MODELS[name]()
        assert cfg.sources, name  # every config says where its numbers come from
        t = configs.tiny(cfg)
        assert t.hidden == 64 and len(t.blocks) == 6 and t.window == 4
        assert {k for k in ("ssm", "attn", "mlp", "moe") if cfg.count(k)} == {
            k for k in ("ssm", "attn", "mlp", "moe") if t.count(k)
        }, name


def test_kda_separate_mode_runs_on_the_torch_path_and_is_refused_on_cuda(tiny_weights):
    """KDA's read copy: the torch path runs it; on CUDA the mode is refused up front (its
    kernels are not built), by name, not at the first step."""
    cfg = tiny_weights("kimi-linear-48b").cfg
    assert refusal(cfg, MODES["separate_e4m3"]) is None
    why = refusal(cfg, MODES["separate_e4m3"], "cuda")
    assert why and "read_dtype: expected None for a CUDA kda module" in why
    assert refusal(cfg, MODES["replay_fp32"], "cuda") is None


def test_acceptance_distribution_has_table10_mean():
    for mean in (3.43, 3.56):
        probs = acceptance_probs(mean)
        assert len(probs) == 4 and math.isclose(sum(probs), 1.0, abs_tol=1e-12)
        assert math.isclose(sum((i + 1) * p for i, p in enumerate(probs)), mean, abs_tol=1e-9)
        assert math.isclose(probs[0], 0.05, abs_tol=1e-12)  # draft 1 accepted with 0.95


@pytest.mark.parametrize("name", list(configs.MODELS))
def test_every_mode_runs(tiny_weights, name):
    weights = tiny_weights(name)
    for mode, m in MODES.items():
        why = refusal(weights.cfg, m)
        if why:  # only where the real head tile has no such checkpoint
            assert mode == "separate_e4m3" and name == "nemotron-3-nano-4b", why
            with pytest.raises(ValueError, match="mode: separate_e4m3 refused"):
                Replica(weights, mode, 2, 16)
            continue
        r = Replica(weights, mode, 2, 16)
        for _ in range(2):
            r.step()
        assert bool(torch.isfinite(r.logits).all()), mode
        cursors = [layer["binding"].pool["cursors"] for layer in r.layers if "binding" in layer]
        if m.replay:  # records held (or pending drafts) moved on the device
            assert all(int(c[:2].abs().sum()) > 0 for c in cursors), mode
        assert int(r.emitted) > 0


@pytest.mark.parametrize("name", list(configs.MODELS))
def test_fp32_conventional_and_replay_give_identical_tokens(tiny_weights, name):
    res = run.compare_modes(tiny_weights(name), "replay_fp32", "conventional", batch=2,
                            context=16, steps=STEPS)  # fmt: skip
    assert res["flushes"] == STEPS // WINDOW >= 6
    assert res["tokens_identical"] and res["token_agreement"] == 1.0, res
    assert res["max_abs_dlogit"] < 1e-3, res


@pytest.mark.parametrize("name", ["nemotron-3-nano-4b", "qwen3.5-4b", "kimi-linear-48b"])
def test_spec_verify_matches_snapshot_baseline(tiny_weights, name):
    """Our verify with the fused commit against one snapshot per draft, the same draws."""
    res = run.compare_modes(tiny_weights(name), "spec_replay", "spec_snapshot", batch=2,
                            context=16, steps=12)  # fmt: skip
    assert res["tokens_identical"], res
    assert res["max_abs_dlogit"] < 1e-3, res


@pytest.mark.parametrize("name", ["nemotron-3-nano-4b", "qwen3.5-4b", "kimi-linear-48b"])
def test_skipping_the_prefill_state_load_is_caught(tiny_weights, name):
    """A replica that starts its slots from zero instead of reset_slots(initial_state=...)."""
    res = run.compare_modes(tiny_weights(name), "replay_fp32", "conventional", batch=2,
                            context=16, steps=STEPS, broken="skip_prefill_state")  # fmt: skip
    assert not res["tokens_identical"], res
    assert res["max_abs_dlogit"] > 1e-2, res


def test_replica_argument_errors(tiny_weights):
    weights = tiny_weights("qwen3.5-4b")
    with pytest.raises(ValueError, match="mode: expected one of"):
        Replica(weights, "fast", 1, 16)
    with pytest.raises(ValueError, match="broken: expected one of"):
        Replica(weights, "conventional", 1, 16, broken="other")
    with pytest.raises(ValueError, match="attention: expected 'sdpa' or 'flashinfer'"):
        Replica(weights, "conventional", 1, 16, attention="flash")
    with pytest.raises(ValueError, match="attention: 'flashinfer' needs flashinfer-python"):
        Replica(weights, "conventional", 1, 16, attention="flashinfer")
    with pytest.raises(ValueError, match="model: expected one of"):
        configs.get_config("gpt")
    with pytest.raises(SystemExit, match="--mode: expected names from"):
        run.parse_args(["--mode", "fast", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--batch: expected a comma-separated list of int"):
        run.parse_args(["--batch", "1,x", "--device", "cpu"])


def test_cli_writes_json_and_plots(tmp_path):
    argv = ["--tiny", "--device", "cpu", "--model", "nano4b,kimi48b", "--batch", "1,2",
            "--context", "16", "--mode", "conventional,replay_fp32,spec_replay,spec_snapshot",
            "--check-steps", "8", "--check-batch", "1", "--out", str(tmp_path)]  # fmt: skip
    assert run.main(argv) == 0
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert result["device"] == "CPU (torch path)" and result["timed"] is False
    assert result["commit_measured"] == "undetermined" or len(result["commit_measured"]) == 40
    assert set(result["models"]) == {"nemotron-3-nano-4b-tiny", "kimi-linear-48b-tiny"}
    for rec in result["models"].values():
        assert rec["config"]["sources"] and rec["weight_bytes"]["full_model_fp8_experts"] > 0
        assert rec["acceptance"]["mean"] == 3.43
    assert len(result["runs"]) == 2 * 2 * 4
    for r in result["runs"]:
        assert "step_ms" not in r and "speedup_vs_conventional" not in r  # no CPU speed claims
        mem = r["memory"]
        assert mem["bytes_per_sequence"]["total"] > 0 and mem["largest_batch"] > 0
        assert 0 < r["ssm_share"] < 1 and r["breakdown_ms"]["ssm.op"] > 0
        assert r["attention"] == "sdpa"  # (auto: FlashInfer needs CUDA)
    conv = {r["batch"]: r for r in result["runs"] if r["mode"] == "conventional"}
    replay = {r["batch"]: r for r in result["runs"] if r["mode"] == "replay_fp32"}
    for b in conv:  # replay slots hold the rings: more bytes than the state alone
        assert (replay[b]["memory"]["bytes_per_sequence"]["ssm_slots"]
                > conv[b]["memory"]["bytes_per_sequence"]["ssm_slots"])  # fmt: skip
    checks = {(c["model"], c["mode"]): c for c in result["correctness"]}
    for model in result["models"]:
        assert checks[(model, "replay_fp32")]["tokens_identical"]
        assert checks[(model, "spec_replay")]["reference"] == "spec_snapshot"
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert (tmp_path / "memory_breakdown.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# --ssm-path vllm: the SSM layers through the vLLM adapter, as vLLM's model code calls it
# ---------------------------------------------------------------------------------------------

FAMILIES = ["nemotron-3-nano-4b", "qwen3.5-4b", "kimi-linear-48b"]  # Mamba-2, GDN, KDA


@pytest.mark.parametrize("mode, steps", [("replay_fp32", STEPS), ("spec_replay", 12)])
@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_path_gives_the_ops_paths_tokens(tiny_weights, name, mode, steps):
    """FP32: the adapter's calls (MTP with num_accepted_tokens in the speculative mode) give the
    ops' tokens over several flushes (spec: 12 verifies of ~3.4 kept tokens at L = 4)."""
    res = run.compare_modes(tiny_weights(name), mode, mode, batch=2, context=16, steps=steps,
                            ssm_path="vllm")  # fmt: skip
    assert (res["ssm_path"], res["reference_ssm_path"]) == ("vllm", "ops"), res
    assert res["tokens_identical"] and res["token_agreement"] == 1.0, res
    assert res["max_abs_dlogit"] < 1e-5, res


@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_path_takes_model_dtype_gates(name):
    """BF16 activations: dt, a, b reach the adapter in BF16 as vLLM passes them; its FP32 copies
    are the ops path's .float(), so the tokens and logits still match."""
    cfg = configs.tiny(configs.get_config(name), window=WINDOW)
    weights = Weights(cfg, "cpu", torch.bfloat16, seed=0)
    for mode, steps in (("replay_fp32", 2 * WINDOW), ("spec_replay", 4)):
        res = run.compare_modes(weights, mode, mode, batch=2, context=16, steps=steps,
                                ssm_path="vllm")  # fmt: skip
        assert res["ssm_path"] == "vllm" and res["tokens_identical"], res
        assert res["max_abs_dlogit"] == 0.0, res


def test_vllm_path_separate_e4m3_gives_the_ops_paths_tokens(tiny_weights):
    res = run.compare_modes(tiny_weights("qwen3.5-4b"), "separate_e4m3", "separate_e4m3",
                            batch=2, context=16, steps=STEPS, ssm_path="vllm")  # fmt: skip
    assert res["ssm_path"] == "vllm" and res["tokens_identical"], res


@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_path_off_by_one_num_accepted_tokens_is_caught(tiny_weights, name):
    """num_accepted_tokens without the bonus token (clamped to vLLM's minimum 1, so the
    adapter's value check passes) commits too few drafts: the tokens differ."""
    res = run.compare_modes(tiny_weights(name), "spec_replay", "spec_replay", batch=2,
                            context=16, steps=12, ssm_path="vllm",
                            broken="num_accepted_off_by_one")  # fmt: skip
    assert res["ssm_path"] == "vllm" and not res["tokens_identical"], res
    assert res["max_abs_dlogit"] > 1e-2, res


@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_path_uses_blocks_past_the_null_block(tiny_weights, name):
    """Rows hold blocks 1..batch through the backend; block 0 (vLLM's null block) is never
    written, and modes without an adapter fall back to the ops and say why."""
    r = Replica(tiny_weights(name), "spec_replay", 2, 16, ssm_path="vllm")
    for _ in range(3):
        r.step()
    bindings = [layer["binding"] for layer in r.layers if "binding" in layer]
    assert r.ssm_path == "vllm" and bindings
    for b in bindings:
        assert b.path.backend.layer(b.pool["state"]) is b.layer  # registered with the backend
        assert all(not bool(t[0].float().abs().sum()) for t in b.pool.values())
        assert int(b.pool["cursors"][1:, :2].abs().sum()) > 0
    assert r.vllm.num_accepted_tokens.tolist() == r.prev_accepted.tolist()
    for mode, why in (("conventional", "plans ReplaySSM only"), ("spec_snapshot", "snapshot")):
        fallback = Replica(tiny_weights(name), mode, 2, 16, ssm_path="vllm")
        assert fallback.ssm_path == "ops" and why in fallback.ssm_path_note


@pytest.mark.parametrize("mode", ["replay_fp32", "spec_replay"])
@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_path_pad_rows_on_the_null_block(tiny_weights, name, mode):
    """A padded CUDA-graph batch: the last row names block 0, which stays untouched; the live
    rows' tokens and logits are the ops path's (every other layer works row by row; the MoE's
    per-expert GEMMs see other row counts, hence a tolerance on the logits)."""
    weights = tiny_weights(name)
    ops = Replica(weights, mode, 3, 16)
    padded = Replica(weights, mode, 3, 16, ssm_path="vllm", pad_rows=1)
    for _ in range(2 * WINDOW if mode == "replay_fp32" else 4):
        ops.step()
        padded.step()
        assert torch.equal(ops.targets[:2], padded.targets[:2])
        assert float((ops.logits[:2] - padded.logits[:2]).abs().max()) < 1e-4
    for layer in padded.layers:
        if "binding" in layer:
            pool = layer["binding"].pool
            assert all(not bool(t[0].float().abs().sum()) for t in pool.values())
            assert not bool(pool["cursors"][3].abs().sum())  # block 3: the pad row's, unused


def test_vllm_path_argument_errors(tiny_weights):
    weights = tiny_weights("qwen3.5-4b")
    with pytest.raises(ValueError, match="ssm_path: expected one of"):
        Replica(weights, "replay_fp32", 1, 16, ssm_path="sglang")
    with pytest.raises(ValueError, match="broken: expected 'num_accepted_off_by_one' only"):
        Replica(weights, "replay_fp32", 1, 16, ssm_path="vllm", broken="num_accepted_off_by_one")
    with pytest.raises(ValueError, match="broken: expected 'num_accepted_off_by_one' only"):
        Replica(weights, "spec_replay", 1, 16, broken="num_accepted_off_by_one")
    with pytest.raises(ValueError, match="pad_rows: expected 0 unless"):
        Replica(weights, "conventional", 2, 16, ssm_path="vllm", pad_rows=1)
    with pytest.raises(ValueError, match=r"pad_rows: expected 0\.\.1 \(batch 2\), got 2"):
        Replica(weights, "replay_fp32", 2, 16, ssm_path="vllm", pad_rows=2)
    with pytest.raises(SystemExit):
        run.parse_args(["--ssm-path", "sglang", "--device", "cpu"])


def test_cli_records_the_ssm_path_per_run_row(tmp_path):
    argv = ["--tiny", "--device", "cpu", "--model", "qwen4b", "--batch", "2", "--context", "16",
            "--mode", "conventional,replay_fp32,spec_replay,spec_snapshot", "--ssm-path", "vllm",
            "--check-steps", "8", "--check-batch", "1", "--out", str(tmp_path)]  # fmt: skip
    assert run.main(argv) == 0
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert result["ssm_path"] == "vllm"
    paths = {r["mode"]: (r["ssm_path"], "ssm_path_fallback" in r) for r in result["runs"]}
    assert paths == {"conventional": ("ops", True), "replay_fp32": ("vllm", False),
                     "spec_replay": ("vllm", False), "spec_snapshot": ("ops", True)}  # fmt: skip
    checks = {c["mode"]: c for c in result["correctness"]}
    assert checks["replay_fp32"]["ssm_path"] == "vllm" and checks["replay_fp32"]["tokens_identical"]
    assert checks["spec_replay"]["ssm_path"] == "vllm" and checks["spec_replay"]["tokens_identical"]
