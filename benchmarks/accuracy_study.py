"""Accuracy of quantised checkpoints (issue 18), float64 emulation on the CPU: one Mamba-2 or
Gated DeltaNet layer decoded conventionally (the state re-stored every step) and with ReplaySSM (the
checkpoint stored at every L-th step: shared, one low-precision copy carries and serves; or
separate, a high-precision copy carries the recurrence and a low-precision one serves the
non-flush reads), each against a float64 conventional decode.

    python benchmarks/accuracy_study.py [--family mamba2|gdn] [--steps 4096] [--seed 0] [--out DIR]

Storage rounding is the kernels' (replayssm_jit.reference.precision: FP16 / BF16 with RN or
stochastic rounding, FP8 e4m3 with an FP32 scale per state row, NVFP4 with an e4m3 scale per 16
elements and an FP32 scale per head); arithmetic is float64, records are exact. Mamba-2's shapes and
input distributions are those of the fidelity emulation in ../shared/anchors/RESULTS-fidelity.md
(nheads 8, headdim 64, dstate 128 (super120b's head), batch 4; median per-step log-decays
log-spaced from 0.002 to 0.03 over the heads), so its figures are the yardstick; GDN's
(GDNLayer) take qwen4b's head and the same decays. The metric is the SSM-part error:
||y - y_ref|| / ||y_ref - D x|| over the 512 steps ending at each report point. Writes
accuracy.json and a markdown table into --out (default benchmarks/scratch/).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from replayssm_jit.reference.precision import fp8_encode, nvfp4_encode, round_half_rn, round_half_sr

F64 = torch.float64
BATCH, HEADS, P, N, WINDOW = 4, 8, 64, 128, 16
REPORT_WINDOW = 512


@dataclass(frozen=True)
class Format:
    name: str  # "fp32", "fp16", "bf16", "fp8" or "nvfp4"
    sr: bool = False

    def __str__(self) -> str:
        return self.name.upper() + ("+SR" if self.sr else "")


@dataclass(frozen=True)
class Config:
    label: str
    replay: bool
    carry: Format  # the copy the recurrence continues from
    read: Format | None = None  # separate: the copy non-flush steps read (None: shared)


CONFIGS = (
    Config("conv FP32", False, Format("fp32")),
    Config("conv FP16+SR", False, Format("fp16", True)),
    Config("conv BF16+SR", False, Format("bf16", True)),
    Config("conv FP8+SR", False, Format("fp8", True)),
    Config("replay FP32", True, Format("fp32")),
    Config("shared FP16+SR", True, Format("fp16", True)),
    Config("shared FP8+SR", True, Format("fp8", True)),
    Config("shared NVFP4+SR", True, Format("nvfp4", True)),
    Config("separate FP32 + FP8", True, Format("fp32"), Format("fp8")),
    Config("separate FP32 + NVFP4", True, Format("fp32"), Format("nvfp4")),
    Config("separate FP16+SR + FP8", True, Format("fp16", True), Format("fp8")),
    Config("separate FP16+SR + NVFP4", True, Format("fp16", True), Format("nvfp4")),
)

# The fidelity emulation's SSM-part errors at 8K, seed 0 (RESULTS-fidelity.md, main table).
ANCHOR_8K = {
    "conv FP16+SR": 0.0012, "conv BF16+SR": 0.0093, "conv FP8+SR": 0.125, "replay FP32": 2.5e-8,
    "shared FP16+SR": 2.9e-4, "shared FP8+SR": 0.036, "shared NVFP4+SR": 0.134,
    "separate FP32 + FP8": 0.019, "separate FP32 + NVFP4": 0.069,
    "separate FP16+SR + FP8": 0.019, "separate FP16+SR + NVFP4": 0.069,
}  # fmt: skip


def store(x: torch.Tensor, fmt: Format, gen: torch.Generator) -> torch.Tensor:
    """x [batch, heads, P, N] as `fmt` stores it, read back as float64."""
    bits = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int64) if fmt.sr else None
    if fmt.name == "fp32":
        return x.to(torch.float32).to(F64)
    if fmt.name in ("fp16", "bf16"):
        dtype = torch.float16 if fmt.name == "fp16" else torch.bfloat16
        return (round_half_sr(x, bits, dtype) if fmt.sr else round_half_rn(x, dtype)).value
    if fmt.name == "fp8":
        return fp8_encode(x, dims=(-1,), bits=bits).value  # a scale per (batch, head, row)
    if fmt.name == "nvfp4":
        return nvfp4_encode(x, head_dims=2, bits=bits).value  # a head scale per (batch, head)
    raise ValueError(f"format: expected fp32, fp16, bf16, fp8 or nvfp4, got {fmt.name!r}")


class Mamba2Layer:
    """S [B, H, P, N] <- alpha S + dt x B^T, y = S C (the SSM part; D x is the same everywhere).
    x ~ N(0, 1); B, C ~ N(0, 1) / sqrt(N), one group; A_h = -exp(U(0, ln 16)); dt = softplus(z +
    bias_h), z ~ N(-4.5, 1), with bias_h putting head h's median dt |A| at m_h."""

    shape = (BATCH, HEADS, P, N)

    def tokens(self, seed: int, steps: int, m_lo: float, m_hi: float):
        gen = torch.Generator().manual_seed(seed)
        A = -torch.exp(torch.rand(HEADS, generator=gen, dtype=F64) * math.log(16.0))
        m = torch.exp(torch.linspace(math.log(m_lo), math.log(m_hi), HEADS, dtype=F64))
        bias = torch.log(torch.expm1(m / A.abs())) + 4.5
        for _ in range(steps):
            x = torch.randn(BATCH, HEADS, P, generator=gen, dtype=F64)
            Bt = torch.randn(BATCH, N, generator=gen, dtype=F64) / math.sqrt(N)
            Ct = torch.randn(BATCH, N, generator=gen, dtype=F64) / math.sqrt(N)
            z = torch.randn(BATCH, HEADS, generator=gen, dtype=F64) - 4.5
            dt = torch.nn.functional.softplus(z + bias)
            alpha = torch.exp(dt * A)[..., None, None]
            yield alpha, (dt[..., None] * x)[..., None] * Bt[:, None, None, :], Ct

    @staticmethod
    def advance(state, token):
        alpha, update, Ct = token
        state = alpha * state + update
        return state, torch.einsum("bhpn,bn->bhp", state, Ct)


class GDNLayer:
    """Gated DeltaNet with K = V = 128 (qwen4b's head shape; one value head per key head here):
    S [B, H, V, K] <- a S; u = beta (v - S k); S <- S + u k^T; y = S q. q, k ~ N(0, 1)
    L2-normalised; v ~ N(0, 1); beta = sigmoid(N(0, 1)); log a = -m_h exp(N(0, 1) / 2), head h's
    median per-step log-decay m_h log-spaced as for Mamba-2."""

    shape = (BATCH, HEADS, 128, 128)

    def tokens(self, seed: int, steps: int, m_lo: float, m_hi: float):
        gen = torch.Generator().manual_seed(seed)
        m = torch.exp(torch.linspace(math.log(m_lo), math.log(m_hi), HEADS, dtype=F64))
        for _ in range(steps):
            q = torch.randn(BATCH, HEADS, 128, generator=gen, dtype=F64)
            k = torch.randn(BATCH, HEADS, 128, generator=gen, dtype=F64)
            q, k = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
            v = torch.randn(BATCH, HEADS, 128, generator=gen, dtype=F64)
            beta = torch.sigmoid(torch.randn(BATCH, HEADS, generator=gen, dtype=F64))
            a = torch.exp(-m * torch.exp(torch.randn(BATCH, HEADS, generator=gen, dtype=F64) / 2))
            yield a[..., None, None], beta[..., None], q, k, v

    @staticmethod
    def advance(state, token):
        a, beta, q, k, v = token
        state = a * state
        u = beta * (v - torch.einsum("bhvk,bhk->bhv", state, k))
        state = state + u[..., None] * k[..., None, :]
        return state, torch.einsum("bhvk,bhk->bhv", state, q)


LAYERS = {"mamba2": Mamba2Layer, "gdn": GDNLayer}


class Decoder:
    """One configuration's decode of `layer`; step() returns the SSM part of y. ReplaySSM's
    records are exact, so its non-flush outputs are the recurrence run in float64 from the read
    copy (the corrections u computed against it, as the kernels do), and a flush folds from the
    carried copy: separate runs the window again from the high-precision copy (u recomputed
    from it), shared from the one copy it has."""

    def __init__(self, cfg: Config, layer, seed: int):
        self.cfg, self.layer, self.gen = cfg, layer, torch.Generator().manual_seed(seed + 1)
        self.carry = torch.zeros(layer.shape, dtype=F64)
        self.view, self.hp_view, self.held = self.carry.clone(), self.carry.clone(), 0

    def step(self, token):
        cfg = self.cfg
        if not cfg.replay:  # the state from registers gives y, then it is stored
            full, y = self.layer.advance(self.carry, token)
            self.carry = store(full, cfg.carry, self.gen)
            return y
        self.view, y = self.layer.advance(self.view, token)
        if cfg.read is not None:
            self.hp_view, y_hp = self.layer.advance(self.hp_view, token)
        self.held += 1
        if self.held < WINDOW:
            return y
        full = self.view
        if cfg.read is not None:  # a flush's output comes from its fold of the carried copy
            full, y = self.hp_view, y_hp
        self.carry = store(full, cfg.carry, self.gen)
        read = self.carry if cfg.read is None else store(self.carry, cfg.read, self.gen)
        self.view, self.hp_view, self.held = read, self.carry, 0
        return y


def run(seed: int, steps: int, m_lo: float, m_hi: float, configs=CONFIGS, family="mamba2") -> dict:
    layer = LAYERS[family]()
    reports = [n for n in (1024, 2048, 4096, 8192, 16384, 32768) if n <= steps]
    decoders = [Decoder(cfg, layer, seed) for cfg in configs]
    ref = torch.zeros(layer.shape, dtype=F64)
    err = [0.0] * len(configs)
    norm = 0.0
    results = {cfg.label: {} for cfg in configs}
    for t, token in enumerate(layer.tokens(seed, steps, m_lo, m_hi), start=1):
        ref, y_ref = layer.advance(ref, token)
        counted = any(n - REPORT_WINDOW < t <= n for n in reports)
        if counted:
            norm += float(y_ref.square().sum())
        for k, dec in enumerate(decoders):
            y = dec.step(token)
            if counted:
                err[k] += float((y - y_ref).square().sum())
        if t in reports:
            for k, cfg in enumerate(configs):
                results[cfg.label][t] = math.sqrt(err[k] / norm)
            err, norm = [0.0] * len(configs), 0.0
    return {"family": family, "seed": seed, "steps": steps, "m": [m_lo, m_hi],
            "ssm_part_error": results}  # fmt: skip


def table(res: dict) -> str:
    anchors = ANCHOR_8K if res["family"] == "mamba2" else {}
    points = sorted({n for row in res["ssm_part_error"].values() for n in row})
    head = " | ".join(f"@{n // 1024}K" for n in points)
    lines = [f"| configuration | {head} | fidelity emulation @8K | ratio |",
             "|---|" + "---|" * (len(points) + 2)]  # fmt: skip
    for label, row in res["ssm_part_error"].items():
        last = row[points[-1]]
        anchor = anchors.get(label)
        ratio = f"{last / anchor:.2f}" if anchor else ""
        cells = " | ".join(f"{row[n]:.3g}" for n in points)
        lines.append(f"| {label} | {cells} | {anchor if anchor else ''} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=sorted(LAYERS), default="mamba2")
    p.add_argument("--m-lo", type=float, default=0.002)
    p.add_argument("--m-hi", type=float, default=0.03)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "scratch")
    args = p.parse_args(argv)
    if args.steps < 1024 or args.steps % WINDOW:
        p.error(f"--steps: expected a multiple of {WINDOW} of at least 1024, got {args.steps}")
    res = run(args.seed, args.steps, args.m_lo, args.m_hi, family=args.family)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    (args.out / "accuracy.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
