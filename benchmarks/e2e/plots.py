"""PNG plots of an e2e.json: speedup against batch beside the paper's Table 6 row, memory per
sequence, and one step's breakdown."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # (no display on the benchmark machines)
import matplotlib.pyplot as plt

from .configs import PAPER_BATCHES, PAPER_TABLE6

PARTS = ("embed", "ssm", "attn", "mlp", "moe", "head", "commit", "draft")


def _base(model: str) -> str:
    return model.removesuffix("-tiny")


def speedup_figure(result: dict, path: Path) -> Path:
    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = [r for r in result["runs"] if r["model"] == model]
        contexts = sorted({r["context"] for r in runs})
        for mode in result["modes"]:
            if mode == "conventional":
                continue
            for ctx in contexts:
                pts = sorted((r["batch"], r["speedup_vs_conventional"]) for r in runs
                             if r["mode"] == mode and r["context"] == ctx
                             and "speedup_vs_conventional" in r)  # fmt: skip
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{mode} ctx {ctx}")
        paper = PAPER_TABLE6.get(_base(model))
        if paper:
            ax.plot(PAPER_BATCHES, paper, "k--", marker="s", label="paper Table 6 (B300, vLLM)")
        if not result["timed"]:
            ax.text(0.5, 0.5, "no timings:\nCPU torch path", transform=ax.transAxes,
                    ha="center", va="center", color="gray")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("speedup vs conventional")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_breakdown_figure(result: dict, path: Path) -> Path:
    """Per model: bytes per sequence by mode (SSM slots, conv, KV) and the largest batch; one
    step's breakdown by layer type (the largest batch and context run, conventional and
    replay_fp32)."""
    models = list(result["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 6.4), squeeze=False)
    for col, model in enumerate(models):
        runs = [r for r in result["runs"] if r["model"] == model and "memory" in r]
        if not runs:
            continue
        batch, ctx = max(r["batch"] for r in runs), max(r["context"] for r in runs)
        at = {r["mode"]: r for r in runs if r["batch"] == batch and r["context"] == ctx}
        ax = axes[0][col]
        modes = list(at)
        bottom = [0.0] * len(modes)
        for part in ("ssm_slots", "conv_states", "kv_cache"):
            vals = [at[m]["memory"]["bytes_per_sequence"][part] / 2**20 for m in modes]
            ax.bar(modes, vals, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, m in enumerate(modes):
            ax.text(i, bottom[i], f"max B {at[m]['memory']['largest_batch']}", ha="center",
                    va="bottom", fontsize=6)  # fmt: skip
        ax.set_title(f"{model}: MiB per sequence (ctx {ctx})", fontsize=8)
        ax.tick_params(axis="x", rotation=45, labelsize=6)
        ax.legend(fontsize=6)
        ax = axes[1][col]
        shown = [m for m in ("conventional", "replay_fp32") if m in at] or modes[:1]
        bottom = [0.0] * len(shown)
        for part in PARTS:
            vals = [at[m]["breakdown_ms"].get(part, 0.0) for m in shown]
            if any(vals):
                ax.bar(shown, vals, bottom=bottom, label=part)
                bottom = [b + v for b, v in zip(bottom, vals)]
        unit = at[shown[0]]["breakdown_time"]
        note = "" if result["timed"] else " (CPU, not a speed claim)"
        ax.set_title(f"one step at B {batch}, ms ({unit}){note}", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict, out: Path) -> list[Path]:
    return [speedup_figure(result, out / "speedup.png"),
            memory_breakdown_figure(result, out / "memory_breakdown.png")]  # fmt: skip
