"""Run the replica: timing (CUDA graphs, CUDA events), one profiled step, memory, correctness.

    python benchmarks/e2e.py --model nano4b --batch 1,8,32,128,256,512 --context 1024
    python benchmarks/e2e.py --tiny --device cpu --model all --batch 1,2 --context 32

On a GPU each (model, context, batch, mode) is one CUDA graph of one step (cursors advance on
the device inside it), replayed `--warmup` times, then timed over `--steps` replays with CUDA
events (median and mean). On the CPU the same step runs eagerly through the ops' torch path and
nothing is timed: the JSON says so and holds no speed figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from .configs import MODELS, ModelConfig, get_config, tiny
from .replica import MODES, Replica, Weights, _tensors_of, acceptance_probs, get_mode, refusal

ROOT = Path(__file__).resolve().parents[2]
TOP_LABELS = ("embed", "ssm", "attn", "mlp", "moe", "head", "commit", "draft")
SUB_LABELS = ("ssm.proj", "ssm.conv", "ssm.op", "ssm.norm_out", "moe.route", "moe.experts")
GIB = 1 << 30


def commit_measured() -> tuple[str, str | None]:
    """(the full hash of HEAD, None), or ("undetermined", why) where the tree differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                "benchmarks/e2e", "replayssm_jit"], capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        return "undetermined", f"git unavailable: {e}"
    if dirty:
        return (
            "undetermined",
            f"uncommitted changes under benchmarks/e2e or replayssm_jit (HEAD {head})",
        )
    return head, None


# ---------------------------------------------------------------------------------------------
# Stepping: one CUDA graph per replica (batch size and mode) on the GPU, eager on the CPU
# ---------------------------------------------------------------------------------------------


def make_stepper(replica: Replica, graphs: bool):
    """A callable running one step: a captured CUDA graph's replay where `graphs` (two eager
    warm-up steps on a side stream first, as capture needs), else replica.step."""
    if not graphs:
        return replica.step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            replica.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replica.step()
    return graph.replay


def time_steps(stepper, warmup: int, steps: int) -> dict:
    """Median and mean ms per step over `steps` replays after `warmup`, from CUDA events."""
    for _ in range(warmup):
        stepper()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]  # fmt: skip
    for start, end in events:
        start.record()
        stepper()
        end.record()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in events]
    return {"step_ms": statistics.median(ms), "step_ms_mean": statistics.fmean(ms),
            "steps_timed": steps, "warmup": warmup}  # fmt: skip


def profile_step(replica: Replica) -> dict:
    """One eager step under torch.profiler: time per e2e.* label (device time on CUDA, CPU time
    on the CPU) and the SSM layers' share of the labelled step."""
    cuda = replica.w.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        replica.step()
        if cuda:
            torch.cuda.synchronize()
    times, source = {}, "cpu"
    for ev in prof.key_averages():
        if not ev.key.startswith("e2e."):
            continue
        us = ev.cpu_time_total
        if cuda:
            dev = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
            if dev:
                us, source = dev, "device"
        times[ev.key[4:]] = times.get(ev.key[4:], 0.0) + us / 1000.0
    total = sum(times.get(k, 0.0) for k in TOP_LABELS)
    share = times.get("ssm", 0.0) / total if total else None
    return {"breakdown_ms": {k: round(v, 6) for k, v in times.items()},
            "breakdown_time": source, "ssm_share": share}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Memory: bytes per sequence and the largest batch a device budget holds
# ---------------------------------------------------------------------------------------------


def real_weight_bytes(weights: Weights) -> dict:
    """The full model's weight bytes (every MoE layer its own FP8 experts, the rest BF16) and
    the replica's own (as allocated: a shared bank counted once)."""
    cfg = weights.cfg
    banks = {id(b["moe"].bank): b["moe"].bank for b in weights.blocks if "moe" in b}
    bank_params = sum(b.w1.numel() + b.w2.numel() for b in banks.values()) // max(len(banks), 1)
    bank_ptrs = {t.data_ptr() for b in banks.values() for t in (b.w1, b.w2)}
    seen, other = set(), 0
    for t in _tensors_of(weights):
        if t.data_ptr() in seen or t.data_ptr() in bank_ptrs:
            continue
        seen.add(t.data_ptr())
        other += t.numel()
    real = 2 * other + cfg.count("moe") * bank_params  # FP8 experts: one byte a weight
    return {"full_model_fp8_experts": real, "replica_as_allocated": weights.nbytes()}


def memory_row(replica: Replica, weight_bytes: int, budget: float, reserve: float) -> dict:
    per = replica.bytes_per_sequence()
    total = sum(per.values())
    free = budget - reserve - weight_bytes
    return {"bytes_per_sequence": {**per, "total": total},
            "largest_batch": max(0, int(free // total)) if total else None,
            "budget_gib": budget / GIB, "reserve_gib": reserve / GIB}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Correctness: two modes fed their own argmax, side by side
# ---------------------------------------------------------------------------------------------


def compare_modes(weights: Weights, mode: str, reference: str, *, batch: int, context: int,
                  steps: int, graphs: bool = False, broken: str | None = None,
                  seed: int = 1, ssm_path: str = "ops",
                  reference_ssm_path: str = "ops") -> dict:  # fmt: skip
    """Run `reference` and `mode` from the same prefill state, each feeding back its own greedy
    tokens, for `steps` steps: token agreement, the first step whose tokens differ, and the max
    |Δlogit| over the steps before each row's first difference. ssm_path applies to `mode`'s
    replica, reference_ssm_path to the reference's."""
    ref = Replica(weights, reference, batch, context, seed=seed, ssm_path=reference_ssm_path)
    run = Replica(weights, mode, batch, context, seed=seed, broken=broken, ssm_path=ssm_path)
    ref_step, run_step = make_stepper(ref, graphs), make_stepper(run, graphs)
    alive = torch.ones(batch, dtype=torch.bool, device=weights.device)
    agree, first, max_d = 0, None, 0.0
    for i in range(steps):
        ref_step()
        run_step()
        d = (ref.logits - run.logits).abs().flatten(1).amax(1)
        if bool(alive.any()):
            max_d = max(max_d, float(d[alive].max()))
        same = (ref.targets == run.targets).all(1)
        agree += int(same.sum())
        if first is None and not bool(same.all()):
            first = i
        alive &= same
    window = weights.cfg.window
    return {
        "model": weights.cfg.name, "mode": mode, "reference": reference, "batch": batch,
        "context": context, "steps": steps, "window": window,
        "flushes": steps // window if get_mode(mode).replay else 0,
        "tokens_identical": first is None, "token_agreement": agree / (steps * batch),
        "first_divergence_step": first, "max_abs_dlogit": max_d, "broken": broken,
        "graphs": graphs, "ssm_path": run.ssm_path, "reference_ssm_path": ref.ssm_path,
    }  # fmt: skip


def correctness(weights: Weights, modes: list[str], *, batch: int, context: int, steps: int,
                graphs: bool, ssm_path: str = "ops") -> list[dict]:  # fmt: skip
    """Each mode against conventional (the speculative ones against the snapshot baseline,
    which draws the same accepted counts); the references have no adapter and run the ops."""
    out = []
    for mode in modes:
        if mode == "conventional" or refusal(weights.cfg, get_mode(mode), weights.device):
            continue
        if mode == "spec_snapshot":
            continue
        reference = "spec_snapshot" if mode == "spec_replay" else "conventional"
        out.append(compare_modes(weights, mode, reference, batch=batch, context=context,
                                 steps=steps, graphs=graphs, ssm_path=ssm_path))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def config_record(cfg: ModelConfig, weights: Weights) -> dict:
    c = asdict(cfg)
    c["blocks"] = ["+".join(k for k in b if k) for b in cfg.blocks]
    return {
        "config": c,
        "layer_counts": {k: cfg.count(k) for k in ("ssm", "attn", "mlp", "moe")},
        "share_experts": weights.share_experts,
        "weight_bytes": real_weight_bytes(weights),
        "acceptance": {"T": 4, "mean": cfg.accept_mean, "probs_a_1_to_T": acceptance_probs(cfg.accept_mean)},
    }  # fmt: skip


def attention_for(cfg, args) -> str:
    """The attention a run uses: --attention, where "auto" is FlashInfer's batch decode for GQA
    models on CUDA with flashinfer-python installed, else torch SDPA."""
    from .flashinfer_decode import available

    if args.attention != "auto":
        return args.attention
    gqa = not cfg.attn.kv_lora_rank
    on_cuda = torch.device(args.device).type == "cuda"
    return "flashinfer" if gqa and on_cuda and available() else "sdpa"


def run_point(weights: Weights, mode: str, batch: int, context: int, args, wbytes: int) -> dict:
    row = {"model": weights.cfg.name, "mode": mode, "batch": batch, "context": context}
    why = refusal(weights.cfg, get_mode(mode), weights.device)
    if why:
        return {**row, "refused": why}
    try:
        replica = Replica(weights, mode, batch, context, seed=args.seed,
                          attention=attention_for(weights.cfg, args),
                          ssm_path=args.ssm_path)  # fmt: skip
    except torch.cuda.OutOfMemoryError as e:  # (a large batch at a long context: say so, go on)
        torch.cuda.empty_cache()
        return {**row, "out_of_memory": str(e).splitlines()[0]}
    row["attention"] = "flashinfer" if replica.attn_decode is not None else "sdpa"
    row["ssm_path"] = replica.ssm_path  # what ran: "vllm" falls back to "ops" where no adapter
    if replica.ssm_path_note:
        row["ssm_path_fallback"] = replica.ssm_path_note
    row["memory"] = memory_row(replica, wbytes, args.memory_gib * GIB, args.reserve_gib * GIB)
    row.update(profile_step(replica))
    row["tokens_per_step_expected"] = batch * (
        sum((i + 1) * p for i, p in enumerate(replica.accept_probs)) if replica.T > 1 else 1
    )
    if args.timed:
        stepper = make_stepper(replica, args.graphs)
        before = int(replica.emitted)
        steps_before = int(replica.step_index)
        row.update(time_steps(stepper, args.warmup, args.steps))
        ran = args.warmup + args.steps
        row["tokens_per_step"] = (int(replica.emitted) - before) / ran
        if replica.T > 1:
            assert int(replica.step_index) - steps_before == ran
        row["tokens_per_s"] = row["tokens_per_step"] / (row["step_ms"] / 1000.0)
    del replica
    if weights.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def add_speedups(runs: list[dict]) -> None:
    """speedup_vs_conventional: step-time ratio (standard modes) or tokens/s ratio (the
    speculative ones); spec_replay also against spec_snapshot."""
    base = {(r["model"], r["context"], r["batch"], r["mode"]): r for r in runs}
    for r in runs:
        key = (r["model"], r["context"], r["batch"])
        conv, snap = base.get((*key, "conventional")), base.get((*key, "spec_snapshot"))
        if "tokens_per_s" not in r or not conv or "tokens_per_s" not in conv:
            continue
        r["speedup_vs_conventional"] = r["tokens_per_s"] / conv["tokens_per_s"]
        if r["mode"] == "spec_replay" and snap and "tokens_per_s" in snap:
            r["speedup_vs_spec_snapshot"] = r["tokens_per_s"] / snap["tokens_per_s"]


def split_list(text: str, what: str, kind=int) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(
            f"--{what}: expected a comma-separated list of {kind.__name__}, got {text!r}"
        ) from None
    if not values:
        raise SystemExit(f"--{what}: expected at least one value, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--model", default="all", help=f"comma list of {list(MODELS)} (or aliases), or all"
    )
    p.add_argument("--batch", default="1,8,32,128,256,512")
    p.add_argument("--context", default="1024", help="KV cache tokens each attention layer reads")
    p.add_argument("--mode", default="all", help=f"comma list of {list(MODES)}, or all")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        default=None,
        help="weights and activations (default: bf16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--tiny", action="store_true", help="configs.tiny() sizes (the CPU run)")
    p.add_argument("--window", type=int, default=None, help="replay window L (default 16; tiny 4)")
    p.add_argument("--steps", type=int, default=1000, help="timed steps (GPU)")
    p.add_argument("--warmup", type=int, default=128, help="warm-up steps (GPU)")
    p.add_argument("--check-steps", type=int, default=256, help="correctness steps (0: none)")
    p.add_argument("--check-batch", type=int, default=4)
    p.add_argument("--check-dtype", default="float32", help="dtype of the correctness run")
    p.add_argument(
        "--share-experts",
        choices=("auto", "yes", "no"),
        default="auto",
        help="one expert bank for all MoE layers (auto: the 120B-class models on CUDA)",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="device memory budget (default: the GPU's, else an H200's 139)",
    )
    p.add_argument("--reserve-gib", type=float, default=8.0, help="kept for activations and graphs")
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument(
        "--attention",
        choices=("auto", "sdpa", "flashinfer"),
        default="auto",
        help="attention decode (auto: FlashInfer's batch decode where installed on CUDA, for "
        "GQA models; MLA and drafts always SDPA). Each run row records which ran",
    )
    p.add_argument(
        "--ssm-path",
        choices=("ops", "vllm"),
        default="ops",
        help="how the SSM layers call ReplaySSM: the functional ops, or the vLLM adapter with "
        "vLLM's call signatures (modes without an adapter use the ops; each run row records "
        "which ran and why)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--out", default="benchmarks/scratch/e2e", help="folder for e2e.json and the plots"
    )
    args = p.parse_args(argv)
    args.models = list(MODELS) if args.model == "all" else split_list(args.model, "model", str)
    args.batches = split_list(args.batch, "batch")
    args.contexts = split_list(args.context, "context")
    args.modes = list(MODES) if args.mode == "all" else split_list(args.mode, "mode", str)
    for m in args.modes:
        if m not in MODES:
            raise SystemExit(f"--mode: expected names from {list(MODES)}, got {m!r}")
    for name in args.models:
        try:
            get_config(name)
        except ValueError as e:
            raise SystemExit(f"--{e}") from None
    args.device = torch.device(args.device)
    args.timed = args.device.type == "cuda"
    args.graphs = args.graphs and args.timed
    default_dtype = "bfloat16" if args.timed else "float32"
    args.dtype = getattr(torch, args.dtype or default_dtype)
    args.check_dtype = getattr(torch, args.check_dtype)
    if args.memory_gib is None:
        args.memory_gib = (torch.cuda.get_device_properties(args.device).total_memory / GIB
                           if args.timed else 139.0)  # fmt: skip
    return args


def model_config(name: str, args) -> ModelConfig:
    cfg = get_config(name)
    if args.tiny:
        cfg = tiny(cfg, window=args.window or 4)
    elif args.window:
        from dataclasses import replace

        cfg = replace(cfg, window=args.window)
    return cfg


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (torch path)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commit, note = commit_measured()
    result = {
        "schema": "replayssm-e2e/1",
        "date": datetime.date.today().isoformat(),
        "device": device_name(args.device),
        "commit_measured": commit,
        **({"commit_measured_note": note} if note else {}),
        "command": "python benchmarks/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": {"python": platform.python_version(), "torch": torch.__version__},
        "timed": args.timed,
        "timing": ("CUDA graph per (batch, mode), CUDA events, median of steps after warm-up"
                   if args.timed else "none: the CPU torch path is a correctness run, not a speed claim"),
        "attention": ("per run row: FlashInfer's batch decode (one-token GQA steps) or torch SDPA, "
                      "over a KV cache of exactly --context tokens"),
        "experts": ("BF16, torch._grouped_mm" if args.timed else f"{args.dtype} per-expert loop (CPU)"),
        "dtype": str(args.dtype), "graphs": args.graphs, "ssm_path": args.ssm_path,
        "modes": {m: MODES[m].what for m in args.modes},
        "models": {}, "runs": [], "correctness": [],
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = [(m, c, b, mode) for m in args.models for c in args.contexts for b in args.batches
              for mode in args.modes]  # fmt: skip
    bar = tqdm(total=len(points) + (len(args.models) if args.check_steps else 0), desc="e2e",
               file=sys.stderr)  # fmt: skip
    for name in args.models:
        cfg = model_config(name, args)
        # The 120B-class models' experts with their states would not fit one H200 (issue 37).
        big = get_config(name).name in ("nemotron-3-super-120b-a12b", "qwen3.5-122b-a10b")
        share = args.share_experts == "yes" or (args.share_experts == "auto" and args.timed and big)
        weights = Weights(cfg, args.device, args.dtype, seed=0, share_experts=bool(share))
        result["models"][cfg.name] = config_record(cfg, weights)
        wbytes = result["models"][cfg.name]["weight_bytes"]["full_model_fp8_experts"]
        for _, context, batch, mode in [p for p in points if p[0] == name]:
            bar.set_postfix_str(f"{cfg.name} ctx={context} B={batch} {mode}")
            result["runs"].append(run_point(weights, mode, batch, context, args, wbytes))
            bar.update(1)
        if args.check_steps:
            bar.set_postfix_str(f"{cfg.name} correctness")
            check_w = weights
            if args.check_dtype != args.dtype:  # (free the timing weights first)
                check_w = weights = None
                check_w = Weights(cfg, args.device, args.check_dtype, seed=0,
                                  share_experts=bool(share))  # fmt: skip
            result["correctness"] += correctness(check_w, args.modes, batch=args.check_batch,
                                                 context=args.contexts[0], steps=args.check_steps,
                                                 graphs=args.graphs,
                                                 ssm_path=args.ssm_path)  # fmt: skip
            del check_w
            bar.update(1)
        del weights
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    add_speedups(result["runs"])
    path = out / "e2e.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    from .plots import write_plots

    pngs = write_plots(result, out)
    print(f"wrote {path} and {', '.join(str(p) for p in pngs)}")
    bad = [c for c in result["correctness"]
           if c["mode"] in ("replay_fp32", "spec_replay") and not c["tokens_identical"]]  # fmt: skip
    for c in bad:
        print(f"FAIL: {c['model']} {c['mode']} tokens differ from {c['reference']} at step "
              f"{c['first_divergence_step']}", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0
