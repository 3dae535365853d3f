"""Checkpoint formats side by side: one benchmark run's steps per format, with each format's bytes
per sequence per layer (what caps an engine's concurrency), as a markdown table and a plot.

    python benchmarks/report_formats.py RUN_DIR [--out DIR]

RUN_DIR holds bench_mamba2.py / bench_gdn.py JSON (mamba2.json, gdn.json, and kda.json for a
second bench_gdn.py run at KDA shapes, whose formats differ) whose --states are
checkpoint formats (f32, bf16sr, e4m3, f32+e4m3, ...; harness.parse_format). Bytes per sequence
come from the layouts themselves (checkpoint copies, their scales, the record rings, the
cursor). Writes formats.md and formats.png into --out (default RUN_DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import COPY_CEILING_TBPS, parse_format

from replayssm_jit.core.models import get_model
from replayssm_jit.families import get_family
from replayssm_jit.families.layout import family_layout

KERNELS = ("nonflush", "flush", "amortized", "conventional")


def sequence_bytes(shape: str, state: str, window: int) -> int:
    """Bytes per sequence per layer of `state`'s layout (ReplaySSM, drafts 1, BF16 records)."""
    model = get_model(shape.partition("@")[0])
    fmt = parse_format(state)
    args = dict(zip(get_family(model.family).shape_args,
                    (model.key_heads, model.value_heads, model.d_k, model.d_v)))  # fmt: skip
    layout = family_layout(model.family, window=window, state_dtype=fmt.state,
                           read_dtype=fmt.read, **args)  # fmt: skip
    return layout.bytes_per_slot()


def collect(run_dir: Path) -> dict[tuple, dict[str, dict]]:
    """{(shape, batch, window, state): {kernel: row}} over the run's JSON files, in order."""
    out: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for name in ("mamba2.json", "gdn.json", "kda.json"):
        path = run_dir / name
        if path.exists():
            for row in json.loads(path.read_text())["rows"]:
                key = (row["shape"], row["batch"], row["window"], row["state"])
                out[key][row["kernel"]] = row
    return out


def table(rows: dict[tuple, dict[str, dict]]) -> str:
    lines = [
        "Steps in us (median; % of the copy ceiling, "
        f"{COPY_CEILING_TBPS} TB/s, counting the bytes each step must move). Bytes per sequence "
        "per layer from the layouts (checkpoint copies with their scales, record rings, cursor); "
        "x: sequences per GB against FP32.",
        "",
        "| shape | batch | format | kernel | non-flush | flush | amortized | conventional "
        "| bytes / sequence |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[str, int] = {}
    for (shape, batch, window, state), kernels in rows.items():
        seq = sequence_bytes(shape, state, window)
        base.setdefault(shape, sequence_bytes(shape, "f32", window))
        cells = []
        for k in KERNELS:
            r = kernels.get(k)
            cells.append(f"{r['us']:.1f} ({r['pct_ceiling']:.0f}%)" if r else "-")
        kernel = next(iter(kernels.values())).get("replay_kernel", "")
        lines.append(
            f"| {shape} | {batch} | {state} | {kernel} | " + " | ".join(cells)
            + f" | {seq / 1e3:,.0f} kB ({base[shape] / seq:.2f}x) |"
        )  # fmt: skip
    return "\n".join(lines)


def plot(rows: dict[tuple, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in rows if "amortized" in rows[k]]
    if not keys:
        return
    labels = [f"{s}\nb{b} {st}" for s, b, _, st in keys]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(keys)), 4))
    xs = range(len(keys))
    for offset, kernel in ((-0.2, "nonflush"), (0.2, "amortized")):
        ax.bar([x + offset for x in xs], [rows[k].get(kernel, {}).get("us", 0) for k in keys],
               width=0.4, label=kernel)  # fmt: skip
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("us per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    out = args.out or args.run_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(args.run_dir)
    (out / "formats.md").write_text(table(rows) + "\n")
    plot(rows, out / "formats.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
