"""Tables and a plot from bench_verify.py's JSON (one or more files of one run): per (shape, batch,
T) our verify step (mixed and paper acceptance), its ratio to our T = 1 step, the conventional
snapshot baseline, fla's forms and, with --flashinfer, FlashInfer's checkpointing_ssu verify
(anchor_lp_spec.py's JSON: default "auto" and monolith, mixed acceptance).

    python benchmarks/report_verify.py DIR/*verify.json [--flashinfer DIR/fi-lp_spec.json]
        [--plot DIR/verify.png]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

FLA = ("fla_per_token_states", "fla_T_tokens", "fla_spec_decode")
FI_SHAPE = "super120b"  # the one model shape anchor_lp_spec.py runs
FI_MIXED = re.compile(r"FI checkpointing_ssu\[(\w+)\] T=(\d+) mixed")


def flashinfer_rows(path: Path) -> dict[tuple[str, int, int], dict[str, float]]:
    """{(shape, batch, T): {"auto": us, "monolith": us}} from anchor_lp_spec.py's mixed rows."""
    out: dict[tuple[str, int, int], dict[str, float]] = defaultdict(dict)
    for r in json.loads(path.read_text())["results"]:
        m = FI_MIXED.match(r.get("kernel", ""))
        if r.get("part") == "spec" and m and r.get("timing", {}).get("us") is not None:
            out[(FI_SHAPE, r["batch"], int(m.group(2)))][m.group(1)] = r["timing"]["us"]
    return out


def by_config(rows: list[dict]) -> dict[tuple[str, int, int], dict[str, dict]]:
    by: dict[tuple[str, int, int], dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if "error" not in r:
            by[(r["shape"], r["batch"], r["T"])][r["kernel"]] = r
    return by


def _us(k: dict, name: str) -> str:
    return f"{k[name]['us']:.1f}" if name in k else ""


def table(rows: list[dict], fi: dict | None = None) -> str:
    fi = fi or {}
    lines = [
        "| shape | batch | T | verify kernel | verify mixed | verify paper | T = 1 step | mixed / T1 "
        "| FlashInfer auto / monolith | mixed / FlashInfer best | snapshot baseline | tree (T = 8) "
        "| fla per-token states / T tokens / spec decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, k in sorted(by_config(rows).items(), key=lambda x: (x[0][0], -x[0][1], x[0][2])):
        if "verify_mixed" not in k or "t1" not in k:
            continue
        mixed, t1 = k["verify_mixed"]["us"], k["t1"]["us"]
        peers = fi.get(key, {})
        fi_cell = " / ".join(f"{peers[a]:.1f}" if a in peers else "-" for a in ("auto", "monolith"))
        vs_fi = f"{mixed / min(peers.values()):.2f}" if peers else ""
        fla = " / ".join(_us(k, n) or "-" for n in FLA) if any(n in k for n in FLA) else ""
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {k['verify_mixed'].get('verify_kernel', '')} | "
            f"{mixed:.1f} | {_us(k, 'verify_paper')} | {t1:.1f} | {mixed / t1:.2f} | "
            f"{fi_cell if peers else ''} | {vs_fi} | {_us(k, 'snapshot')} | "
            f"{_us(k, 'tree_verify_commit')} | {fla} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, fi: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fi = fi or {}
    by = by_config(rows)
    shapes = sorted({s for s, _, _ in by})
    batches = sorted({b for _, b, _ in by}, reverse=True)
    fig, axes = plt.subplots(
        len(batches), len(shapes), figsize=(3.2 * len(shapes), 2.6 * len(batches)), squeeze=False
    )
    for i, batch in enumerate(batches):
        for j, shape in enumerate(shapes):
            ax = axes[i][j]
            ts = sorted(T for s, b, T in by if s == shape and b == batch)
            series = {
                "ours, verify": [by[(shape, batch, T)].get("verify_mixed") for T in ts],
                "ours, T = 1": [by[(shape, batch, T)].get("t1") for T in ts],
                "snapshot": [by[(shape, batch, T)].get("snapshot") for T in ts],
                "fla spec decode": [by[(shape, batch, T)].get("fla_spec_decode") for T in ts],
                "fla per-token states": [
                    by[(shape, batch, T)].get("fla_per_token_states") for T in ts
                ],
            }
            for (label, pts), style in zip(series.items(), ("o-", "k:", "s--", "^-.", "v-.")):
                xy = [(T, r["us"]) for T, r in zip(ts, pts) if r]
                if xy:
                    ax.plot(*zip(*xy), style, label=label)
            xy = [(T, min(fi[(shape, batch, T)].values())) for T in ts if (shape, batch, T) in fi]
            if xy:
                ax.plot(*zip(*xy), "d-", label="FlashInfer (best)")
            ax.set_title(f"{shape}, batch {batch}", fontsize=9)
            ax.set_xticks(ts)
            ax.set_xlabel("drafts T", fontsize=8)
            ax.set_ylabel("us per step", fontsize=8)
            ax.set_yscale("log")  # the snapshot baseline is several times the rest
            if ax.lines:
                ax.legend(fontsize=6)
            else:
                ax.set_axis_off()  # nothing measured at this (shape, batch)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", type=Path, nargs="+")
    p.add_argument("--flashinfer", type=Path, help="anchor_lp_spec.py's JSON of the same run")
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    rows = [r for f in args.json for r in json.loads(f.read_text())["rows"]]
    fi = flashinfer_rows(args.flashinfer) if args.flashinfer else {}
    print(table(rows, fi))
    if args.plot:
        plot(rows, args.plot, fi)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
