"""Teacher-forced KL of checkpoint formats in tiny HF hybrid models: what a quantised SSM state
does to a whole model's next-token distributions, through hf.patch.

    python benchmarks/accuracy_hf_kl.py [--models nemotron_h,qwen3_next] [--tokens 2048]
        [--points 256,512,1024,2048] [--report-window 128] [--batch 4] [--prompt 16]
        [--device cuda|cpu] [--jobs N] [--threads 1] [--seed 0] [--configs LABEL,...]
        [--out DIR]

Models: random weights from configs (MODELS), FP32 weights and activations, so that the only
rounding besides FP32 arithmetic is the SSM checkpoint's:
  nemotron_h  NemotronH, hidden 64, vocab 256, 6 blocks M-MLP-M-attention-M-MLP; Mamba-2 mixers
              of 4 heads, headdim 64, dstate 128 (Nemotron-H's head shape), 2 groups.
  qwen3_next  Qwen3-Next, hidden 64, vocab 256, 4 layers GDN-GDN-GDN-attention (dense MLPs);
              GDN mixers of 1 key head and 2 value heads, K = V = 128 (Qwen3-Next's head).
As in tests/integrations/test_hf_dropin.py, the SSM mixers get long memories (per-token decays near 1, D
small, input projections x8) so that the state carries the output; the LM head is drawn with
std 3 / sqrt(hidden) so that the next-token distributions are peaked rather than near uniform
(the reference's mean entropy is in the JSON).

Each run: a prefill of --prompt random tokens per row (HF's own forward), then --tokens
teacher-forced one-token decode steps of a fixed random token sequence (--batch rows; the
given next token is fed, never the argmax). The reference is the unpatched model (HF's own
FP32 decode); each configuration patches our ops in (hf.patch with its mode, state_dtype,
read_dtype and stochastic rounding; window 16, the rows' flushes staggered, replay on the
per-item kernel; conventional SR gets a new seed every step). Metric: KL(p_ref || p_config)
of the next-token distributions per step and row (float64; rounding noise below zero is
clamped), averaged over the rows and over the --report-window steps ending at each N.
Configurations whose formats are not built (none today) are listed as such,
with the reason hf.patch gives.

Writes accuracy-hf-kl-<model>.json, accuracy-hf-kl-<model>.png and accuracy-hf-kl.md into
--out (default benchmarks/scratch/). --jobs runs (model, configuration) runs in parallel
processes of --threads threads each (default: one per core on the CPU; the tiny models' steps
are bound by per-op overhead, so more threads per run do not help).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import plot_against_steps, run_environment

HERE = Path(__file__).resolve().parent
F64 = torch.float64
WINDOW = 16
VOCAB = 256
DEFAULT_POINTS = (256, 512, 1024, 2048)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    family: str  # the SSM family hf.patch runs: "mamba2" or "gdn"
    config_class: str
    model_class: str
    config: dict


MODELS = {
    "nemotron_h": ModelSpec(
        "mamba2", "NemotronHConfig", "NemotronHForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
             layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention",
                                "linear_attention", "mlp"],
             num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             mamba_num_heads=4, mamba_head_dim=64, ssm_state_size=128, n_groups=2,
             conv_kernel=4, chunk_size=16, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2),
    ),
    "qwen3_next": ModelSpec(
        "gdn", "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             layer_types=["linear_attention", "linear_attention", "linear_attention",
                          "full_attention"],
             num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
             linear_value_head_dim=128, mlp_only_layers=[0, 1, 2, 3], tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2),
    ),
}  # fmt: skip
LOGIT_STD = 3.0


def build_model(name: str, seed: int, device: torch.device) -> torch.nn.Module:
    """The model's random weights for `seed` (drawn on the CPU: the same on every device)."""
    import transformers

    from replayssm_jit.integrations import hf

    spec = MODELS[name]
    config = getattr(transformers, spec.config_class)(**spec.config)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mixer in model.modules():
            if type(mixer).__name__ in hf.MIXERS:
                _long_memory(mixer, gen)
        head = model.get_output_embeddings().weight
        hidden = head.shape[1]
        head.copy_(torch.randn(head.shape, generator=gen) * (LOGIT_STD / hidden**0.5))
    return model.to(device)


def _long_memory(mixer, gen) -> None:
    """Per-token decays near 1 (A in [0.02, 0.1], dt biases in [-3, -2.5]), D = 0.01, and input
    projections x8: the state's readout dominates the mixer's output (tests/integrations/test_hf_dropin.py)."""
    heads = mixer.A_log.shape[0]
    mixer.A_log.copy_(torch.log(0.02 + 0.08 * torch.rand(heads, generator=gen)))
    mixer.dt_bias.copy_(-3.0 + 0.5 * torch.rand(heads, generator=gen))
    if hasattr(mixer, "D"):
        mixer.D.fill_(0.01)
    for child, proj in mixer.named_children():
        if child.startswith("in_proj"):
            proj.weight.mul_(8.0)


def token_ids(seed: int, batch: int, length: int) -> torch.Tensor:
    """The fixed random tokens (prompt then teacher-forced sequence), ids 3.. (no pad/bos/eos)."""
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randint(3, VOCAB, (batch, length), generator=gen)


# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """A checkpoint configuration of issue 18: hf.patch's mode, state_dtype, read_dtype and
    stochastic_rounding."""

    label: str
    mode: str
    state_dtype: str
    read_dtype: str | None = None
    sr: bool = False

    def patch_options(self) -> dict:
        return dict(mode=self.mode, state_dtype=self.state_dtype, read_dtype=self.read_dtype,
                    stochastic_rounding=self.sr)  # fmt: skip

    @property
    def note(self) -> str:
        if self.read_dtype and self.sr:
            return "the read copy is stochastically rounded too (one SR flag per plan)"
        return ""


CONFIGS = (
    Config("conv FP32", "conventional", "f32"),
    Config("conv FP16+SR", "conventional", "f16", sr=True),
    Config("conv BF16+SR", "conventional", "bf16", sr=True),
    Config("conv FP8+SR", "conventional", "e4m3", sr=True),
    Config("replay FP32", "replay", "f32"),
    Config("shared FP16+SR", "replay", "f16", sr=True),
    Config("shared FP8+SR", "replay", "e4m3", sr=True),
    Config("shared NVFP4+SR", "replay", "nvfp4", sr=True),
    Config("separate FP32 + FP8", "replay", "f32", "e4m3"),
    Config("separate FP32 + NVFP4", "replay", "f32", "nvfp4"),
    Config("separate FP16+SR + FP8", "replay", "f16", "e4m3", sr=True),
    Config("separate FP16+SR + NVFP4", "replay", "f16", "nvfp4", sr=True),
)
BY_LABEL = {c.label: c for c in CONFIGS}
REFERENCE = "reference"


def not_built(cfg: Config, model: torch.nn.Module, seed: int) -> str:
    """Why hf.patch cannot run `cfg` on `model` ("" where it can): what the patch refuses (a
    CPU plan only: nothing compiles)."""
    from replayssm_jit.integrations import hf

    try:
        hf.patch(model, window=WINDOW, seed=seed, **cfg.patch_options())
    except ValueError as exc:
        return f"hf.patch refuses it: {exc}"
    hf.unpatch(model)
    return ""


# ---------------------------------------------------------------------------------------------
# One run: a model's teacher-forced logits under one configuration (or the reference)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    model: str
    label: str  # a configuration's label, or REFERENCE
    seed: int
    batch: int
    prompt: int
    tokens: int
    device: str
    threads: int


def run_task(task: Task) -> dict:
    """Prefill, then task.tokens teacher-forced decode steps: {"logits": [tokens, batch, vocab]
    float32 on the CPU (step t's predicts token prompt + t + 1), wall and per-token times, the
    kernel the plans chose}."""
    import transformers
    from transformers import DynamicCache

    from replayssm_jit import LaunchConfig
    from replayssm_jit.integrations import hf

    transformers.logging.set_verbosity_error()  # (the fallback-kernel notices, once per run)
    threads = torch.get_num_threads()
    torch.set_num_threads(task.threads)
    device = torch.device(task.device)
    try:
        model = build_model(task.model, task.seed, device)
        ids = token_ids(task.seed, task.batch, task.prompt + task.tokens).to(device)
        handle = None
        if task.label != REFERENCE:
            cfg = BY_LABEL[task.label]
            # Replay on the per-item kernel: the GPU policy would flush FP32 checkpoints every
            # token at this batch, which is the conventional step.
            config = LaunchConfig(kernel="per-item") if cfg.mode == "replay" else None
            handle = hf.patch(model, window=WINDOW, seed=task.seed, stagger_flushes=True,
                              launch_config=config, **cfg.patch_options())  # fmt: skip
        logits = torch.empty(task.tokens, task.batch, VOCAB, device=device)
        started = time.perf_counter()
        try:
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=ids[:, : task.prompt], past_key_values=cache, use_cache=True)
                decode_started = time.perf_counter()
                for t in range(task.tokens):
                    step = ids[:, task.prompt + t : task.prompt + t + 1]
                    out = model(input_ids=step, past_key_values=cache, use_cache=True)
                    logits[t] = out.logits[:, -1]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            done = time.perf_counter()
            kernels = []
            if handle is not None:
                assert all(layer.decode_steps == task.tokens for layer in handle.layers)
                kernels = sorted({layer.plan(task.batch).kernel for layer in handle.layers})
        finally:
            if handle is not None:
                hf.unpatch(model)
    finally:
        torch.set_num_threads(threads)
    return {
        "logits": logits.cpu(),
        "wall_s": done - started,
        "ms_per_token": 1e3 * (done - decode_started) / task.tokens,
        "kernel": ",".join(kernels),
    }


# ---------------------------------------------------------------------------------------------
# KL and the report
# ---------------------------------------------------------------------------------------------


def step_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) per step, mean over the rows: [tokens] float64, clamped at 0 (the float64
    sum of two near-equal distributions may land a rounding error below it)."""
    log_ref = torch.log_softmax(ref_logits.to(F64), dim=-1)
    log_p = torch.log_softmax(logits.to(F64), dim=-1)
    kl = (log_ref.exp() * (log_ref - log_p)).sum(-1)
    return kl.clamp_min(0).mean(-1)


def window_means(kl: torch.Tensor, ends: list[int], window: int) -> list[float]:
    """Mean KL over the `window` steps ending at each N in `ends` (steps N - window + 1 .. N)."""
    return [float(kl[n - window : n].mean()) for n in ends]


def model_result(name: str, args, built: dict, runs: dict) -> dict:
    """A model's JSON: configs, KL at the points, the per-window series, top-1 agreement."""
    ref = runs[REFERENCE]["logits"]
    log_ref = torch.log_softmax(ref.to(F64), dim=-1)
    entropy = float(-(log_ref.exp() * log_ref).sum(-1).mean())
    W = args.report_window
    ends = list(range(W, args.tokens + 1, W))
    kl, series, top1, configs = {}, {}, {}, {}
    for cfg in args.configs:
        why = built[cfg.label]
        info = {**asdict(cfg), "note": cfg.note, "not_built": why}
        if not why:
            run = runs[cfg.label]
            per_step = step_kl(ref, run["logits"])
            kl[cfg.label] = dict(zip(map(str, args.points), window_means(per_step, args.points, W)))
            series[cfg.label] = window_means(per_step, ends, W)
            top1[cfg.label] = float((run["logits"].argmax(-1) == ref.argmax(-1)).double().mean())
            info |= {"kernel": run["kernel"], "ms_per_token": round(run["ms_per_token"], 2),
                     "wall_s": round(run["wall_s"], 1)}  # fmt: skip
        configs[cfg.label] = info
    spec = MODELS[name]
    return {
        "model": name, "family": spec.family, "hf_class": spec.model_class,
        "hf_config": spec.config, "logit_std": LOGIT_STD, "seed": args.seed,
        "batch": args.batch, "prompt": args.prompt, "tokens": args.tokens, "window": WINDOW,
        "points": args.points, "report_window": W, "window_ends": ends,
        "reference": "the unpatched model (HF's own FP32 decode, FP32 state)",
        "reference_ms_per_token": round(runs[REFERENCE]["ms_per_token"], 2),
        "reference_entropy_nats": entropy, "configs": configs, "kl": kl, "kl_windows": series,
        "top1_agreement": top1,
    }  # fmt: skip


def checkpoint_text(cfg: dict) -> str:
    text = f"{cfg['mode']} {cfg['state_dtype']}"
    if cfg["read_dtype"]:
        text += f" + read {cfg['read_dtype']}"
    if cfg["sr"]:
        text += " SR"
    if cfg.get("kernel") and cfg["kernel"] != cfg["mode"]:
        text += f" ({cfg['kernel']} kernel)"
    return text + (f"; {cfg['note']}" if cfg["note"] else "")


def markdown(results: list[dict], env: dict) -> str:
    lines = [
        "# Teacher-forced KL(p_ref || p_config) of checkpoint formats in tiny HF models",
        "",
        f"- Device: {env['device']}; torch {env['torch']}; transformers {env['transformers']}; "
        f"commit {env['commit']}" + (" (dirty tree)" if env["dirty"] else "") + ".",
        f"- Command: `{env['command']}` ({env['wall_s']} s wall, {env['jobs']} jobs of "
        f"{env['threads']} threads).",
        "- Random-weight models (benchmarks/accuracy_hf_kl.py MODELS), FP32 weights and "
        "activations; reference: the unpatched model's own decode. KL per step (nats), mean "
        "over the rows and the report window ending at N.",
    ]
    for res in results:
        points = res["points"]
        lines += [
            "",
            f"## {res['model']} ({res['family']}): {res['batch']} rows, prompt {res['prompt']}, "
            f"{res['tokens']} teacher-forced steps, window {res['window']}, report window "
            f"{res['report_window']}",
            "",
            f"Reference: {res['reference_ms_per_token']} ms/token, mean next-token entropy "
            f"{res['reference_entropy_nats']:.2f} nats (uniform: {math.log(VOCAB):.2f}).",
            "",
            "| configuration | checkpoint | "
            + " | ".join(f"KL @{n}" for n in points)
            + " | top-1 agreement | ms/token |",
            "|---|---|" + "---|" * (len(points) + 2),
        ]  # fmt: skip
        for label, cfg in res["configs"].items():
            if cfg["not_built"]:
                cells = ["not built"] * len(points) + ["", ""]
                what = cfg["not_built"]
            else:
                row = res["kl"][label]
                cells = [f"{row[str(n)]:.3g}" for n in points]
                cells += [f"{res['top1_agreement'][label]:.4f}", f"{cfg['ms_per_token']}"]
                what = checkpoint_text(cfg)
            lines.append(f"| {label} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    ends = res["window_ends"]
    curves = {label: list(zip(ends, values)) for label, values in res["kl_windows"].items()}
    plot_against_steps(
        curves, path,
        ylabel=f"KL(p_ref || p), mean over the {res['report_window']} steps ending at N",
        title=f"{res['model']}: teacher-forced KL of checkpoint formats",
    )  # fmt: skip


def environment(device: torch.device, argv: list[str]) -> dict:
    import transformers

    return {
        **run_environment(device, "benchmarks/accuracy_hf_kl.py", argv),
        "transformers": transformers.__version__,
    }


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    p.add_argument("--tokens", type=int, default=2048, help="teacher-forced decode steps")
    defaults = ",".join(map(str, DEFAULT_POINTS))
    p.add_argument("--points", default="",
                   help=f"report points N, ascending, at most --tokens (default: those of "
                        f"{defaults} below --tokens, and --tokens)")  # fmt: skip
    p.add_argument("--report-window", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="rows (sequences) per run")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default_device)
    p.add_argument("--jobs", type=int, default=0,
                   help="parallel runs (default: 1 on CUDA, else one per core)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--seed", type=int, default=0, help="weights, tokens and SR seed")
    p.add_argument("--configs", default="", help="labels to run, comma-separated (all)")
    p.add_argument("--out", type=Path, default=HERE / "scratch")
    args = p.parse_args(argv)
    args.models = [s.strip() for s in args.models.split(",") if s.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        p.error(f"--models: expected names from {sorted(MODELS)}, got {args.models}")
    for name in ("tokens", "report_window", "batch", "prompt", "threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: expected a positive int")
    if args.points:
        try:
            args.points = [int(s) for s in args.points.split(",")]
        except ValueError:
            p.error(f"--points: expected comma-separated ints, got {args.points!r}")
        if args.points != sorted(set(args.points)) or args.points[0] <= 0:
            p.error(f"--points: expected ascending positive ints, got {args.points}")
        if args.points[-1] > args.tokens:
            p.error(f"--points: expected at most --tokens ({args.tokens}), got {args.points}")
    else:
        args.points = [n for n in DEFAULT_POINTS if n < args.tokens] + [args.tokens]
    # The windows ending at the points may not reach before the first decode step.
    args.report_window = min(args.report_window, args.points[0])
    labels = [s.strip() for s in args.configs.split(",") if s.strip()] or list(BY_LABEL)
    unknown = [s for s in labels if s not in BY_LABEL]
    if unknown:
        p.error(f"--configs: expected labels from {list(BY_LABEL)}, got {unknown}")
    args.configs = [c for c in CONFIGS if c.label in labels]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device: CUDA is not available here (--device cpu runs the PyTorch twin)")
    if args.jobs <= 0:
        args.jobs = 1 if device.type == "cuda" else max(1, (os.cpu_count() or 1) // args.threads)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    started = time.perf_counter()
    built, tasks = {}, []
    for name in args.models:
        model = build_model(name, args.seed, torch.device("cpu"))
        built[name] = {cfg.label: not_built(cfg, model, args.seed) for cfg in args.configs}
        labels = [REFERENCE] + [label for label, why in built[name].items() if not why]
        tasks += [Task(name, label, args.seed, args.batch, args.prompt, args.tokens,
                       args.device, args.threads) for label in labels]  # fmt: skip
    print(f"{len(tasks)} runs of {args.tokens} steps, {args.jobs} at a time", flush=True)
    runs = {name: {} for name in args.models}

    def record(task: Task, run: dict) -> None:
        runs[task.model][task.label] = run
        print(f"{task.model} {task.label}: {run['ms_per_token']:.1f} ms/token, "
              f"{run['wall_s']:.1f} s", flush=True)  # fmt: skip

    if args.jobs == 1:
        for task in tasks:
            record(task, run_task(task))
    else:
        # Spawned workers: no forked torch state; each builds its model from the seed.
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            for task, run in zip(tasks, pool.map(run_task, tasks)):
                record(task, run)
    results = [model_result(name, args, built[name], runs[name]) for name in args.models]
    env = environment(torch.device(args.device), argv)
    env |= {"wall_s": round(time.perf_counter() - started, 1), "jobs": args.jobs,
            "threads": args.threads}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for res in results:
        res["environment"] = env
        stem = args.out / f"accuracy-hf-kl-{res['model']}"
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
        plot(res, stem.with_suffix(".png"))
    text = markdown(results, env)
    (args.out / "accuracy-hf-kl.md").write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
