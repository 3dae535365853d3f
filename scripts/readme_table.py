#!/usr/bin/env python3
"""Write README.md's performance table from the committed results JSON.

    python scripts/readme_table.py           # rewrite the block between the markers
    python scripts/readme_table.py --check   # exit 1 (with a diff) if the README's block is stale

Every figure in the table is read from a JSON file under benchmarks/results/, and every row links
the folders its figures come from, so a figure lives in its results folder and nowhere by hand.
tests/docs/test_readme_table.py runs the check on the CPU.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = "benchmarks/results"
BEGIN = "<!-- perf-table: written by scripts/readme_table.py -->"
END = "<!-- /perf-table -->"

# Batch 256 leads the table (the peers' column); L = 16 throughout.
BATCH, WINDOW = 256, 16

# The checkpoint formats' line: issue 40's one run, ours beside FlashInfer and fla on one machine.
FORMATS, FORMATS_DEVICE = "2026-12-06-h200-formats", "One H200"
# (model, shape, checkpoint format, the peer's state where a peer runs it: FlashInfer's
# checkpointing_ssu state at Mamba-2 shapes, fla's FP32 step at GDN and KDA ones)
FORMAT_ROWS = (
    ("Nemotron-3-Super-120B", "super120b", "f32", "f32"),
    ("", "super120b", "bf16", "bf16"),
    ("", "super120b", "bf16sr", None),
    ("", "super120b", "e4m3", "fp8+scale"),
    ("", "super120b", "f32+e4m3", None),
    ("", "super120b", "f32+nvfp4", None),
    ("Qwen3.5-122B-A10B", "qwen122b", "f32", "f32"),
    ("", "qwen122b", "f32+e4m3", None),
    ("Kimi-Linear-48B", "kimi48b", "f32", "f32"),
)
FORMAT_NAMES = {"f32": "FP32", "bf16": "BF16", "bf16sr": "BF16 + SR", "e4m3": "e4m3",
                "f32+e4m3": "FP32 + e4m3 read copy", "f32+nvfp4": "FP32 + NVFP4 read copy"}  # fmt: skip
FORMAT_BATCHES = (256, 8, 1)  # each against the format's own conventional step


def _load(folder: str, file: str) -> dict:
    return json.loads((ROOT / RESULTS / folder / file).read_text())


def _one(matches: list[float], what: str) -> float:
    # A selector that matches no row, or two, means the JSON changed under the script: say so.
    if len(matches) != 1:
        raise ValueError(f"{what}: expected one row, found {len(matches)}")
    return matches[0]


def format_us(shape: str, state: str, batch: int, kernel: str) -> float | None:
    """Our step's µs in the formats run (None where the format has no such step: a read copy
    has no conventional step)."""
    family_file = {"super120b": "mamba2.json", "qwen122b": "gdn.json", "kimi48b": "kda.json"}
    rows = _load(FORMATS, family_file[shape])["rows"]
    found = [r for r in rows if r["shape"] == shape and r["state"] == state and r["batch"] == batch
             and r["window"] == WINDOW and r["kernel"] == kernel]  # fmt: skip
    return (
        _one([r["us"] for r in found], f"{FORMATS} {shape} {state} b={batch} {kernel}")
        if found
        else None
    )


def nonflush_pct(shape: str, state: str) -> float:
    """The non-flush step's bytes per second at BATCH against the copy ceiling its run measured."""
    family_file = {"super120b": "mamba2.json", "qwen122b": "gdn.json", "kimi48b": "kda.json"}
    data = _load(FORMATS, family_file[shape])
    tbps = _one([r["tbps"] for r in data["rows"] if r["shape"] == shape and r["state"] == state
                 and r["batch"] == BATCH and r["kernel"] == "nonflush"], f"{shape} {state} nonflush")  # fmt: skip
    return 100 * tbps / data["copy"]["tbps"]


def peer_format_us(shape: str, peer_state: str) -> tuple[str, float]:
    """The fastest peer's amortized step at BATCH in the formats run: FlashInfer's
    checkpointing_ssu (default or monolith launch) with `peer_state` at Mamba-2 shapes, fla's
    FP32 step at GDN and KDA ones."""
    if shape == "super120b":
        rows = _load(FORMATS, "fi/lp_spec.json")["results"]
        return "FlashInfer", min(r["timing"]["us"] for r in rows if r.get("api") == "ckpt"
                                 and r["state"] == peer_state and r["batch"] == BATCH
                                 and r.get("phase") == "amortized")  # fmt: skip
    return "fla", format_us(shape, peer_state, BATCH, "fla")


def formats_table() -> list[str]:
    commit = _load(FORMATS, "mamba2.json")["commit_measured"][:7]
    lines = [
        f"{FORMATS_DEVICE}, L = {WINDOW}, BF16 activations, µs per step (ReplaySSM "
        f"amortized over its flushes) ({_link(FORMATS)}, commit {commit}); (x): the format's own "
        "conventional step over ours; non-flush: its bytes against the copy ceiling; peers: "
        "FlashInfer's `checkpointing_ssu`, fla's FP32 step.",
        "",
        "| model | checkpoint | "
        + " | ".join(f"batch {b}" for b in FORMAT_BATCHES)
        + f" | non-flush, batch {BATCH} | peer, batch {BATCH} |",
        "|---|---|" + "---|" * len(FORMAT_BATCHES) + "---|---|",
    ]
    for model, shape, state, peer_state in FORMAT_ROWS:
        cells = []
        for batch in FORMAT_BATCHES:
            ours = format_us(shape, state, batch, "amortized")
            conv = format_us(shape, state, batch, "conventional")
            cells.append(f"{ours:.1f}" + (f" ({conv / ours:.2f}x)" if conv else ""))
        cells.append(f"{nonflush_pct(shape, state):.0f}%")
        if peer_state:
            name, us = peer_format_us(shape, peer_state)
            cells.append(f"{name} {us:.1f}")
        else:
            cells.append("-")
        lines.append(f"| {model} | {FORMAT_NAMES[state]} | " + " | ".join(cells) + " |")
    return lines


def _link(folder: str) -> str:
    # The label drops the folder's date and device (the text above each table names the device).
    return f"[{folder.split('-', 4)[-1]}]({RESULTS}/{folder}/)"


def table() -> str:
    """The README's block between the markers, markers included."""
    return "\n".join([BEGIN, "", *formats_table(), "", END])


def split_readme(text: str) -> tuple[str, str, str]:
    """(before, block, after) of README text around the markers (block includes them)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md: expected the markers {BEGIN!r} ... {END!r} in order")
    end += len(END)
    return text[:start], text[start:end], text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = parser.parse_args(argv)
    text = README.read_text()
    before, block, after = split_readme(text)
    fresh = table()
    if args.check:
        if block == fresh:
            return 0
        diff = difflib.unified_diff(block.splitlines(), fresh.splitlines(), "README.md",
                                    "scripts/readme_table.py", lineterm="")  # fmt: skip
        print("\n".join(diff))
        return 1
    README.write_text(before + fresh + after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
