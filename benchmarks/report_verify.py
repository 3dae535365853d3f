"""Tables and a plot from bench_verify.py's JSON: per (shape, batch, T) our verify step (mixed and
paper acceptance), its ratio to our T = 1 step and to the conventional snapshot baseline.

    python benchmarks/report_verify.py RESULTS_DIR/verify.json [--plot RESULTS_DIR/verify.png]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def table(rows: list[dict]) -> str:
    by = defaultdict(dict)
    for r in rows:
        if "error" in r:
            continue
        by[(r["shape"], r["batch"], r["T"])][r["kernel"]] = r
    lines = [
        "| shape | batch | T | verify kernel | verify mixed | verify paper | other verify kernel "
        "(mixed) | T = 1 step | mixed / T1 | snapshot baseline | snapshot / mixed | tree (T = 8) "
        "| flushes per row-step | fla per-token states / T tokens (GDN) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (shape, batch, T), k in sorted(by.items(), key=lambda x: (x[0][0], -x[0][1], x[0][2])):
        mixed, t1, snap = k["verify_mixed"]["us"], k["t1"]["us"], k["snapshot"]["us"]
        paper = k.get("verify_paper", {}).get("us")
        tree = k.get("tree_verify_commit", {}).get("us")
        kernel = k["verify_mixed"].get("verify_kernel", "per-item")
        fla = " / ".join(
            f"{k[n]['us']:.1f}" for n in ("fla_per_token_states", "fla_T_tokens") if n in k
        )
        other = next((f"{r['us']:.1f} ({r['verify_kernel']})" for name, r in k.items()
                      if name.startswith("verify_mixed_") and "verify_kernel" in r), "")  # fmt: skip
        lines.append(
            f"| {shape} | {batch} | {T} | {kernel} | {mixed:.1f} | {paper:.1f} | {other} | {t1:.1f} | "
            f"{mixed / t1:.2f} | {snap:.1f} | {snap / mixed:.2f} | "
            f"{'' if tree is None else f'{tree:.1f}'} | {k['verify_mixed']['flush_rate']:.3f} | "
            f"{fla} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows if "error" not in r})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sel = [r for r in rows if r.get("shape") == shape and r.get("batch") == 256]
        for kernel, style in (("verify_mixed", "o-"), ("snapshot", "s--"), ("t1", "k:")):
            pts = sorted((r["T"], r["us"]) for r in sel if r.get("kernel") == kernel)
            if pts:
                ax.plot(*zip(*pts), style, label=kernel)
        ax.set_title(f"{shape}, batch 256")
        ax.set_xlabel("drafts T")
        ax.set_ylabel("us per step")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    rows = json.loads(args.json.read_text())["rows"]
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
