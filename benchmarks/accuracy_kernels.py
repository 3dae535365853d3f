"""Accuracy of quantised checkpoints (issue 18) through the decode kernels: the configurations of
accuracy_study.py decoded by Mamba2DecodeWrapper / GDNDecodeWrapper (conventional steps, or
ReplaySSM with a shared checkpoint or separate mode's read copy), each against a float64
conventional decode of the same inputs on the same device.

    python benchmarks/accuracy_kernels.py [--family mamba2|gdn] [--steps 1024,4096,8192,32768]
        [--device cuda] [--out DIR] [--seed 0] [--report-window 512] [--configs LABEL,...]

One layer at the study's shapes and input distributions (Mamba-2: 8 heads of super120b's head,
headdim 64, dstate 128, batch 4; GDN: qwen4b's head, K = V = 128), drawn per step on the device.
A and the per-head dt biases are the study's own draw for the seed, so the heads' memory lengths
match the emulation's. Activations are float32: the output is then rounded only to FP32, and the
comparison is about the checkpoint (BF16 outputs alone would be ~2e-3 off). D x is left out of
the kernels (has_D=False), so y is the SSM part and the metric is the study's
||y - y_ref|| / ||y_ref - D x||, over the --report-window steps ending at each N in --steps, from
one run to the largest N. Configurations whose formats are not built (none today) are listed
as such. The kernels key conventional SR by (seed, slot, element) alone, so each
conventional step gets a seed of its own here (--fixed-conv-seed keeps the plan's one seed).
Writes accuracy-kernels-<family>.json, .md and .png into --out (default benchmarks/scratch/),
with the issue's checks and each figure against the emulation's (--emulation) where it has one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy_study as study
from harness import plot_against_steps, run_environment

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    LaunchConfig,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
    plan_decode,
)

F32, F64 = torch.float32, torch.float64
BATCH, HEADS = study.BATCH, study.HEADS
HERE = Path(__file__).resolve().parent
EMULATION = {
    "mamba2": HERE / "results/2026-12-02-cpu-accuracy/accuracy.json",
    "gdn": HERE / "results/2026-12-02-cpu-accuracy/accuracy-gdn-1k.json",
}
STATE_DTYPES = {"fp32": F32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8": torch.float8_e4m3fn, "nvfp4": torch.float4_e2m1fn_x2}  # fmt: skip
CHUNK = 1024  # steps of inputs drawn at once


class Mamba2Inputs:
    """The study's Mamba2Layer inputs as the kernels take them (float32 x, raw dt = z, A, B, C,
    dt_bias), and the same values widened to float64 as Mamba2Layer.advance takes them."""

    layer = study.Mamba2Layer
    cache_type, wrapper_type = Mamba2DecodeCache, Mamba2DecodeWrapper
    dims: ClassVar[dict] = dict(num_heads=HEADS, headdim=study.P, dstate=study.N, ngroups=1)
    options: ClassVar[dict] = dict(has_D=False, has_z=False, has_dt_bias=True, dt_softplus=True)

    def __init__(self, seed: int, device: torch.device, m_lo: float, m_hi: float):
        # A is the first draw of the study's generator for this seed: the same heads.
        A = -torch.exp(
            torch.rand(HEADS, generator=torch.Generator().manual_seed(seed), dtype=F64)
            * math.log(16.0)
        )
        m = torch.exp(torch.linspace(math.log(m_lo), math.log(m_hi), HEADS, dtype=F64))
        bias = torch.log(torch.expm1(m / A.abs())) + 4.5
        self.A, self.dt_bias = A.to(device, F32), bias.to(device, F32)
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed + 1)

    def draw(self, steps: int) -> None:
        g, dev, n = self.gen, self.device, study.N
        self.x = torch.randn(steps, BATCH, HEADS, study.P, generator=g, device=dev)
        self.B = torch.randn(steps, BATCH, 1, n, generator=g, device=dev) / math.sqrt(n)
        self.C = torch.randn(steps, BATCH, 1, n, generator=g, device=dev) / math.sqrt(n)
        self.z = torch.randn(steps, BATCH, HEADS, generator=g, device=dev) - 4.5
        dt = torch.nn.functional.softplus(self.z.to(F64) + self.dt_bias.to(F64))
        self.alpha = torch.exp(dt * self.A.to(F64))[..., None, None]
        self.dtx = dt[..., None] * self.x.to(F64)

    def kernel(self, i: int):
        return (self.x[i], self.z[i], self.A, self.B[i], self.C[i]), dict(dt_bias=self.dt_bias)

    def reference(self, i: int):
        B, C = self.B[i, :, 0].to(F64), self.C[i, :, 0].to(F64)
        return self.alpha[i], self.dtx[i][..., None] * B[:, None, None, :], C


class GDNInputs:
    """The study's GDNLayer inputs as the kernels take them (float32 q, k L2-normalised here, v,
    log-decay g and beta; plan use_qk_l2norm=False, scale=1), and widened for GDNLayer.advance."""

    layer = study.GDNLayer
    cache_type, wrapper_type = GDNDecodeCache, GDNDecodeWrapper
    dims: ClassVar[dict] = dict(
        num_k_heads=HEADS, num_v_heads=HEADS, head_k_dim=128, head_v_dim=128
    )
    options: ClassVar[dict] = dict(use_qk_l2norm=False, gates_in_kernel=False, scale=1.0)

    def __init__(self, seed: int, device: torch.device, m_lo: float, m_hi: float):
        m = torch.exp(torch.linspace(math.log(m_lo), math.log(m_hi), HEADS, dtype=F64))
        self.m, self.device = m.to(device, F32), device
        self.gen = torch.Generator(device=device).manual_seed(seed + 1)

    def draw(self, steps: int) -> None:
        g, dev, shape = self.gen, self.device, (steps, BATCH, HEADS, 128)
        self.q, self.k = (
            torch.nn.functional.normalize(torch.randn(shape, generator=g, device=dev), dim=-1)
            for _ in range(2)
        )
        self.v = torch.randn(shape, generator=g, device=dev)
        self.beta = torch.sigmoid(torch.randn(steps, BATCH, HEADS, generator=g, device=dev))
        self.g = -self.m * torch.exp(torch.randn(steps, BATCH, HEADS, generator=g, device=dev) / 2)
        self.a = torch.exp(self.g.to(F64))[..., None, None]

    def kernel(self, i: int):
        return (self.q[i], self.k[i], self.v[i]), dict(g=self.g[i], beta=self.beta[i])

    def reference(self, i: int):
        q, k, v = (t[i].to(F64) for t in (self.q, self.k, self.v))
        return self.a[i], self.beta[i].to(F64)[..., None], q, k, v


FAMILIES = {"mamba2": Mamba2Inputs, "gdn": GDNInputs}


@dataclass(frozen=True)
class KernelConfig:
    """A study configuration as a cache format: mode, state and read dtypes, SR (of the carried
    copy, and of the read copy unless read_rn), or why it is not built."""

    study: study.Config
    mode: str = "replay"
    state_dtype: torch.dtype | None = None
    read_dtype: torch.dtype | None = None
    sr: bool = False
    read_rn: bool = False
    not_built: str = ""
    note: str = ""

    @property
    def label(self) -> str:
        return self.study.label

    def describe(self) -> dict:
        name = {None: None, **{v: k for k, v in STATE_DTYPES.items()}}
        return {"mode": self.mode, "state_dtype": name[self.state_dtype],
                "read_dtype": name[self.read_dtype], "stochastic_rounding": self.sr,
                "read_copy_round_to_nearest": self.read_rn, "not_built": self.not_built,
                "note": self.note}  # fmt: skip


def kernel_config(cfg: study.Config, family) -> KernelConfig:
    formats = [cfg.carry, *([cfg.read] if cfg.read else [])]
    if any(f.name == "nvfp4" for f in formats) and not family.wrapper_type.family.nvfp4:
        name = family.wrapper_type.family.name
        return KernelConfig(cfg, not_built=f"NVFP4 checkpoints are not built for {name}")
    if cfg.read is not None and not family.wrapper_type.family.read_copy:
        name = family.wrapper_type.family.name
        return KernelConfig(cfg, not_built=f"separate mode (a read copy) is not built for {name}")
    # The read copy rounds as the study's does (to nearest unless it says SR).
    read_rn = cfg.read is not None and cfg.carry.sr and not cfg.read.sr
    sr = cfg.carry.sr or (cfg.read is not None and cfg.read.sr)
    return KernelConfig(
        cfg,
        mode="replay" if cfg.replay else "conventional",
        state_dtype=STATE_DTYPES[cfg.carry.name],
        read_dtype=STATE_DTYPES[cfg.read.name] if cfg.read else None,
        sr=sr,
        read_rn=read_rn,
    )


class Decoder:
    """One configuration's cache (a slot per batch row) and wrapper. Replay steps run the
    per-item kernel: at this batch the launch policy would flush FP32 checkpoints every token."""

    def __init__(self, cfg: KernelConfig, family, device, seed: int, fixed_conv_seed: bool):
        self.cfg, self.family = cfg, family
        replay = cfg.mode == "replay"
        self.cache = family.cache_type(
            BATCH, **family.dims, window=study.WINDOW if replay else 1,
            state_dtype=cfg.state_dtype, read_dtype=cfg.read_dtype, act_dtype=F32, device=device,
        )  # fmt: skip
        self.wrapper = family.wrapper_type(self.cache, mode=cfg.mode, check_slot_values=False)
        self.plan_args = dict(
            config=LaunchConfig(kernel="per-item") if replay else None, seed=seed,
            stochastic_rounding=cfg.sr, **family.options,
            **({"read_copy_round_to_nearest": True} if cfg.read_rn else {}),
        )  # fmt: skip
        self.slots = self.cache.allocate(BATCH)
        # Conventional steps key SR by (seed, slot, element) with no epoch: one seed per step.
        self.step_seed = cfg.sr and not replay and not fixed_conv_seed
        self.seed = seed

    def spec(self):
        """The kernel's spec, planned on the CPU (nothing is loaded)."""
        return plan_decode(self.cache.layout, BATCH, device="cpu", mode=self.cfg.mode,
                           **self.plan_args).spec  # fmt: skip

    def plan(self) -> None:
        self.wrapper.plan(BATCH, **self.plan_args)

    def run(self, args, kwargs, out: torch.Tensor, t: int) -> None:
        seed = ((self.seed << 32) + t) & (2**63 - 1) if self.step_seed else None
        self.wrapper.run(*args, self.slots, **kwargs, out=out, seed=seed)


def prebuild(decoders: list[Decoder]) -> None:
    """Compile the modules no AOT folder or JIT cache holds, in parallel (plan() would compile
    them one at a time)."""
    from replayssm_jit.jit import env
    from replayssm_jit.jit.build import build, find_prebuilt

    if env.jit_disabled():
        return
    specs = {spec.uri: spec for spec in (d.spec() for d in decoders)}
    missing = [spec for spec in specs.values() if find_prebuilt(spec) is None]
    if missing:
        print(f"compiling {len(missing)} modules", flush=True)
        with ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
            list(pool.map(build, missing))


def run(args) -> dict:
    device = torch.device(args.device)
    family = FAMILIES[args.family](args.seed, device, args.m_lo, args.m_hi)
    configs = [kernel_config(cfg, family) for cfg in study.CONFIGS]
    if args.configs:
        configs = [c for c in configs if c.label in args.configs]
    built = [c for c in configs if not c.not_built]
    decoders = [Decoder(c, family, device, args.seed, args.fixed_conv_seed) for c in built]
    if device.type == "cuda":
        prebuild(decoders)
    for d in decoders:
        d.plan()
    reports, W = args.steps, args.report_window
    err = torch.zeros(len(reports), len(decoders), dtype=F64, device=device)
    norm = torch.zeros(len(reports), dtype=F64, device=device)
    outs = torch.empty(len(decoders), BATCH, HEADS, family.layer.shape[2], device=device)
    ref = torch.zeros(family.layer.shape, dtype=F64, device=device)
    results = {c.label: {} for c in built}
    kernels = {d.cfg.label: {**d.cfg.describe(), "kernel": d.wrapper.kernel,
               "backend": d.wrapper.backend} for d in decoders}  # fmt: skip
    started = time.perf_counter()
    with torch.no_grad():
        for t in range(1, reports[-1] + 1):
            i = (t - 1) % CHUNK
            if i == 0:
                family.draw(min(CHUNK, reports[-1] - t + 1))
            ref, y_ref = family.layer.advance(ref, family.reference(i))
            kernel_args, kernel_kwargs = family.kernel(i)
            for k, dec in enumerate(decoders):
                dec.run(kernel_args, kernel_kwargs, outs[k], t)
            for r, n in enumerate(reports):
                if n - W < t <= n:
                    err[r] += (outs - y_ref).square().sum((1, 2, 3))
                    norm[r] += y_ref.square().sum()
            if t in reports:
                r = reports.index(t)
                for dec, e in zip(decoders, (err[r] / norm[r]).sqrt().tolist()):
                    results[dec.cfg.label][t] = e
                figures = ", ".join(f"{label} {row[t]:.3g}" for label, row in results.items())
                print(f"step {t}, {time.perf_counter() - started:.1f} s: {figures}", flush=True)
            elif t % 4096 == 0:
                print(f"step {t}/{reports[-1]}: {time.perf_counter() - started:.1f} s", flush=True)
    return {
        "family": args.family, "seed": args.seed, "steps": reports, "report_window": W,
        "m": [args.m_lo, args.m_hi], "act_dtype": "float32", "state_shape": list(family.layer.shape),
        "window": study.WINDOW, "conv_seed": "fixed" if args.fixed_conv_seed else "per step",
        "wall_s": round(time.perf_counter() - started, 1),
        "configs": {c.label: c.describe() for c in configs} | kernels,
        "ssm_part_error": results,
    }  # fmt: skip


def emulation_errors(path: Path | None) -> dict:
    """The emulation's ssm_part_error {label: {N: error}} from its JSON, or {}."""
    if path is None or not path.is_file():
        return {}
    rows = json.loads(path.read_text())["ssm_part_error"]
    return {label: {int(n): e for n, e in row.items()} for label, row in rows.items()}


def checks(res: dict, emulation: dict) -> list[dict]:
    """The issue's orderings at each N and each figure against the emulation's (within 1.5x)."""
    err, out = res["ssm_part_error"], []
    pairs = (("shared FP8+SR", "separate FP32 + FP8", 1.9, "separate beats shared at FP8 reads"),
             ("shared NVFP4+SR", "separate FP32 + NVFP4", 1.9,
              "separate beats shared at NVFP4 reads"),
             ("conv FP8+SR", "separate FP32 + FP8", 6.0, "separate FP32 + FP8 beats conv FP8+SR"))  # fmt: skip
    for worse, better, target, what in pairs:
        for n in res["steps"]:
            if worse in err and better in err:
                ratio = err[worse][n] / err[better][n]
                out.append({"check": what, "N": n, "value": ratio, "target": f">= {target}x",
                            "passed": ratio >= target})  # fmt: skip
            else:
                missing = worse if worse not in err else better
                why = res["configs"].get(missing, {}).get("not_built") or "not run"
                out.append({"check": what, "N": n, "value": None, "target": f">= {target}x",
                            "passed": None, "why": f"{missing}: {why}"})  # fmt: skip
    for label, row in err.items():
        for n, e in row.items():
            if n in emulation.get(label, {}):
                ratio = e / emulation[label][n]
                out.append({"check": f"{label} / emulation", "N": n, "value": ratio,
                            "target": "within 1.5x", "passed": 1 / 1.5 <= ratio <= 1.5})  # fmt: skip
    return out


def at(n: int) -> str:
    return f"@{n // 1024}K" if n % 1024 == 0 else f"@{n}"


def verdict(c: dict) -> str:
    if c["passed"] is None:
        return f"n/a ({c['why']})"
    return f"{c['value']:.3g} ({'pass' if c['passed'] else 'FAIL'}, target {c['target']})"


def markdown(res: dict) -> str:
    env, points = res["environment"], res["steps"]
    lines = [
        f"# Checkpoint accuracy through the kernels: {res['family']}, seed {res['seed']}",
        "",
        f"- Device: {env['device']}; torch {env['torch']}; commit {env['commit']}"
        + (" (dirty tree)" if env.get("dirty") else "")
        + f"; {res['wall_s']} s.",
        f"- Command: `{env['command']}`",
        f"- Float32 activations, D x left out; SSM-part error over the {res['report_window']} steps "
        f"ending at N; conventional SR seeds: {res['conv_seed']}.",
        "",
        "| configuration | checkpoint | " + " | ".join(at(n) for n in points) + " |",
        "|---|---|" + "---|" * len(points),
    ]
    for label, cfg in res["configs"].items():
        if cfg["not_built"]:
            cells = ["not built"] * len(points)
            what = cfg["not_built"]
        else:
            row = res["ssm_part_error"][label]
            cells = [f"{row[n]:.3g}" for n in points]
            what = (
                f"{cfg['mode']} {cfg['state_dtype']}"
                + (f" + read {cfg['read_dtype']}" if cfg["read_dtype"] else "")
                + (" SR" if cfg["stochastic_rounding"] else "")
                + f" ({cfg['kernel']})"
            )
            if cfg["note"]:
                what += f"; {cfg['note']}"
        lines.append(f"| {label} | {what} | " + " | ".join(cells) + " |")
    lines += ["", "## Checks", ""]
    emulated = [c for c in res["checks"] if c["check"].endswith(" / emulation")]
    lines += [f"- {c['check']} {at(c['N'])}: {verdict(c)}" for c in res["checks"]
              if c not in emulated]  # fmt: skip
    if emulated:
        ns = sorted({c["N"] for c in emulated})
        lines += ["", f"Kernel / emulation (`{res['emulation']}`), target within 1.5x:", "",
                  "| configuration | " + " | ".join(at(n) for n in ns) + " |",
                  "|---|" + "---|" * len(ns)]  # fmt: skip
        for label in res["ssm_part_error"]:
            mine = {c["N"]: c for c in emulated if c["check"] == f"{label} / emulation"}
            cells = [f"{mine[n]['value']:.2f}" + ("" if mine[n]["passed"] else " (out)")
                     if n in mine else "" for n in ns]  # fmt: skip
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", "The emulation rounds the checkpoint only (float64 arithmetic); the FP32 "
                  "rows here carry the kernels' FP32 arithmetic too."]  # fmt: skip
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    curves = {label: sorted(row.items()) for label, row in res["ssm_part_error"].items()}
    plot_against_steps(
        curves, path,
        ylabel=f"SSM-part error over the {res['report_window']} steps ending at N",
        title=f"{res['family']} through the kernels ({res['environment']['device']})",
    )  # fmt: skip


def environment(device: torch.device, argv: list[str]) -> dict:
    return run_environment(device, "benchmarks/accuracy_kernels.py", argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="mamba2")
    p.add_argument("--steps", default="1024,4096,8192,32768", help="report points N, ascending")
    p.add_argument("--report-window", type=int, default=study.REPORT_WINDOW)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--m-lo", type=float, default=0.002)
    p.add_argument("--m-hi", type=float, default=0.03)
    p.add_argument("--configs", default="", help="study labels to run, comma-separated (all)")
    p.add_argument("--fixed-conv-seed", action="store_true",
                   help="conventional SR with the plan's one seed (the same bits every step)")  # fmt: skip
    p.add_argument("--emulation", type=Path, default=None,
                   help="the emulation's JSON to compare with (default: the family's in "
                        "benchmarks/results/2026-12-02-cpu-accuracy)")  # fmt: skip
    p.add_argument("--out", type=Path, default=HERE / "scratch")
    args = p.parse_args(argv)
    try:
        args.steps = [int(s) for s in args.steps.split(",")]
    except ValueError:
        p.error(f"--steps: expected comma-separated ints, got {args.steps!r}")
    W = study.WINDOW
    if args.steps != sorted(set(args.steps)) or any(n <= 0 or n % W for n in args.steps):
        p.error(f"--steps: expected ascending positive multiples of {W}, got {args.steps}")
    if not 0 < args.report_window <= args.steps[0]:
        p.error(f"--report-window: expected 1 to {args.steps[0]} (the first N), "
                f"got {args.report_window}")  # fmt: skip
    labels = {c.label for c in study.CONFIGS}
    args.configs = [s.strip() for s in args.configs.split(",") if s.strip()]
    unknown = [s for s in args.configs if s not in labels]
    if unknown:
        p.error(f"--configs: expected labels from {sorted(labels)}, got {unknown}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device: CUDA is not available here (--device cpu runs the PyTorch twin)")
    res = run(args)
    res["environment"] = environment(device, argv)
    emulation_path = args.emulation or EMULATION[args.family]
    res["emulation"] = None
    if emulation_path.is_file():
        res["emulation"] = os.path.relpath(emulation_path.resolve(), HERE.parent)
    res["checks"] = checks(res, emulation_errors(emulation_path))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"accuracy-kernels-{args.family}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    stem.with_suffix(".md").write_text(text + "\n")
    print(text, flush=True)
    plot(res, stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
