"""Turn one H200 run's JSON into a markdown table and a speedup-vs-batch plot.

python benchmarks/report.py RUN_DIR [--fi RUN_DIR/fi/fi_more.json] [--out DIR]

RUN_DIR holds the benchmarks' mamba2.json / gdn.json (an experiment's folder under
benchmarks/scratch/, or a record folder under benchmarks/results/); tables.md and the plots go
to --out, by default RUN_DIR itself.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

FI_KERNELS = {
    "FI selective_state_update[auto]": "FI selective_state_update",
    "FI checkpointing_ssu[auto] amortized": "FI checkpointing_ssu default, amortized",
    "FI checkpointing_ssu[auto] tuned amortized": "FI checkpointing_ssu autotuned, amortized",
    "FI checkpointing_ssu[monolith] amortized": "FI checkpointing_ssu monolith, amortized",
}


def load_rows(run_dir: Path, family: str) -> list[dict]:
    path = run_dir / f"{family}.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def load_fi(path: Path | None) -> dict[tuple[str, int], dict[str, float]]:
    out: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    if path and path.exists():
        for r in json.loads(path.read_text())["results"]:
            if r["kernel"] in FI_KERNELS:
                out[(r["shape"], r["batch"])][FI_KERNELS[r["kernel"]]] = r["timing"]["us"]
    return out


OURS = ("conventional", "nonflush", "flush", "amortized", "cycle", "staggered")


def table(rows: list[dict], fi: dict, family: str) -> str:
    by_cfg: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if "@" not in r["kernel"]:
            by_cfg[(r["shape"], r["state"], r["window"], r["batch"])][r["kernel"]] = r
    # Peers measured by the same benchmark (e.g. fla for GDN) become columns too.
    same_run = sorted(
        {r["kernel"] for r in rows if "@" not in r["kernel"] and r["kernel"] not in OURS}
    )
    for (shape, _state, _window, batch), k in by_cfg.items():
        for name in same_run:
            if name in k:
                fi.setdefault((shape, batch), {})[name] = k[name]["us"]
    peer_cols = sorted({k for v in fi.values() for k in v})
    head = [
        "shape",
        "state",
        "L",
        "batch",
        "conventional µs (% ceil)",
        "non-flush µs",
        "flush µs",
        "amortized µs (% ceil)",
        "cycle µs",
        "staggered µs",
        "conv / amortized",
        *peer_cols,
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, state, window, batch), k in sorted(by_cfg.items()):

        def us(name, pct=False, k=k):
            if name not in k:
                return ""
            r = k[name]
            return f"{r['us']:.1f}" + (
                f" ({r['pct_ceiling']:.0f}%)" if pct and "pct_ceiling" in r else ""
            )

        ratio = f"{k['conventional']['us'] / k['amortized']['us']:.2f}x" if "amortized" in k else ""
        peers = [
            f"{fi[(shape, batch)][c]:.1f}"
            if state == "f32" and window == 16 and c in fi.get((shape, batch), {})
            else ""
            for c in peer_cols
        ]
        lines.append(
            "| "
            + " | ".join(
                [
                    shape,
                    state,
                    str(window),
                    str(batch),
                    us("conventional", True),
                    us("nonflush"),
                    us("flush"),
                    us("amortized", True),
                    us("cycle"),
                    us("staggered"),
                    ratio,
                    *peers,
                ]
            )
            + " |"
        )
    return f"### {family}\n\n" + "\n".join(lines) + "\n"


def variants_table(rows: list[dict], family: str) -> str:
    """Launch variants (kernel@variant rows: per-item and split-kernel row tiles) per config."""
    by_cfg: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if "@" in r["kernel"]:
            by_cfg[(r["shape"], r["state"], r["window"], r["batch"])][r["kernel"]] = r["us"]
    if not by_cfg:
        return ""
    lines = [
        f"### {family}: launch variants (µs; conventional@X is the conventional step at tile X,"
        " cycle@X one ReplaySSM step amortized over a measured L-cycle)",
        "",
    ]
    for (shape, state, window, batch), ks in by_cfg.items():
        cells = ", ".join(f"{k} {v:.1f}" for k, v in ks.items())
        lines.append(f"- {shape} {state} L={window} batch {batch}: {cells}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], fi: dict, out: Path, family: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = defaultdict(dict)
    for r in rows:
        if r["window"] == 16 and r["kernel"] in ("conventional", "amortized"):
            series[(r["shape"], r["state"])].setdefault(r["batch"], {})[r["kernel"]] = r["us"]
    for (shape, state), pts in sorted(series.items()):
        batches = sorted(b for b, v in pts.items() if len(v) == 2)
        ax.plot(
            batches,
            [pts[b]["conventional"] / pts[b]["amortized"] for b in batches],
            marker="o",
            label=f"ours {shape} {state}: conventional / ReplaySSM",
        )
        for peer in (
            "FI checkpointing_ssu autotuned, amortized",
            "FI checkpointing_ssu default, amortized",
        ):
            fb = [b for b in batches if peer in fi.get((shape, b), {}) and state == "f32"]
            if fb:
                ax.plot(
                    fb,
                    [pts[b]["conventional"] / fi[(shape, b)][peer] for b in fb],
                    ls="--",
                    marker="x",
                    label=f"{peer.split(',')[0]} ({peer.split(', ')[0].split(' ')[-1]}) {shape}",
                )
    ax.axhline(2 / (1 + 1 / 16), color="gray", lw=0.8, ls=":", label="byte-count ideal, L=16")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("speedup over our conventional step")
    ax.set_title(f"{family}: ReplaySSM (L=16) vs conventional, H200")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--fi", type=Path, default=None)
    p.add_argument(
        "--out", type=Path, default=None, help="folder for tables.md and plots (default RUN_DIR)"
    )
    args = p.parse_args(argv)
    args.out = args.run_dir if args.out is None else args.out
    args.out.mkdir(parents=True, exist_ok=True)
    fi = load_fi(args.fi or args.run_dir / "fi" / "fi_more.json")
    parts = []
    for family in ("mamba2", "gdn"):
        rows = load_rows(args.run_dir, family)
        if rows:
            parts.append(table(rows, dict(fi) if family == "mamba2" else {}, family))
            parts.append(variants_table(rows, family))
            plot(rows, fi if family == "mamba2" else {}, args.out / f"{family}_speedup.png", family)
    (args.out / "tables.md").write_text("\n".join(parts))
    print("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
