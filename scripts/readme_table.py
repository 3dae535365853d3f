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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = "benchmarks/results"
BEGIN = "<!-- perf-table: written by scripts/readme_table.py -->"
END = "<!-- /perf-table -->"

# The headline setting: every row is this batch, checkpoint dtype and window.
BATCH, STATE, WINDOW = 256, "f32", 16

ARCHITECTURE = "2026-12-01-h200-architecture"
SESSION10 = "2026-11-30-h200-session10"
KDA_SPLIT = "2026-12-02-h200-kda-split"
# The checkpoint formats' line: issue 40's one run, ours beside FlashInfer and fla on one machine.
FORMATS, FORMATS_DEVICE = "2026-12-06-h200-formats", "one H200"
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
FORMAT_BATCHES = (8, 1)  # beside batch 256, each against its own conventional step

# The speculative verify's line: one H100 run of every shape beside FlashInfer (issue 39).
VERIFY = "2026-12-05-h100-verify-grand"
VERIFY_T, VERIFY_BATCHES = 4, (256, 1)


@dataclass(frozen=True)
class Peer:
    """The fastest other library measured at a row's shape: its name, file and row selector."""

    name: str
    folder: str
    file: str
    kernel: str  # the benchmark's kernel label (bench_*.py's "fla", or a FlashInfer label)


@dataclass(frozen=True)
class Row:
    model: str
    family: str
    folder: str
    file: str
    shape: str  # the benchmark's shape name (benchmarks/*.py)
    peer: Peer | None
    no_peer: str = ""  # why a row has no peer


ROWS = (
    Row("Nemotron-3-Super-120B", "Mamba-2", ARCHITECTURE, "mamba2.json", "super120b",
        Peer("FlashInfer `checkpointing_ssu` (tuned)", SESSION10, "flashinfer_peers.json",
             "FI checkpointing_ssu[auto] tuned amortized")),
    Row("Nemotron-3-Nano-4B", "Mamba-2", ARCHITECTURE, "mamba2.json", "nano4b", None,
        no_peer="none (FlashInfer lacks headdim 80)"),
    Row("Qwen3.5-4B", "GDN", ARCHITECTURE, "gdn.json", "qwen4b",
        Peer("fla `fused_recurrent_gated_delta_rule`", ARCHITECTURE, "gdn.json", "fla")),
    Row("Qwen3.5-122B-A10B", "GDN", ARCHITECTURE, "gdn.json", "qwen122b",
        Peer("fla", ARCHITECTURE, "gdn.json", "fla")),
    Row("Kimi-Linear-48B", "KDA", KDA_SPLIT, "kda-split.json", "kimi48b",
        Peer("fla `fused_recurrent_kda`", KDA_SPLIT, "kda-split.json", "fla")),
)  # fmt: skip


def _load(folder: str, file: str) -> dict:
    return json.loads((ROOT / RESULTS / folder / file).read_text())


def _one(matches: list[float], what: str) -> float:
    # A selector that matches no row, or two, means the JSON changed under the script: say so.
    if len(matches) != 1:
        raise ValueError(f"{what}: expected one row, found {len(matches)}")
    return matches[0]


def step_us(folder: str, file: str, shape: str, kernel: str) -> float:
    """The µs of one kernel label at the headline setting, in either of the two row layouts the
    results hold: one row per kernel ("kernel", "us") or one row per shape ("<kernel>_us")."""
    data = _load(folder, file)
    rows = data.get("rows", data.get("results"))
    what = f"{folder}/{file} {shape} {kernel}"
    if file == "flashinfer_peers.json":
        return _one([r["timing"]["us"] for r in rows if r["shape"] == shape
                     and r["batch"] == BATCH and r["kernel"] == kernel], what)  # fmt: skip
    setting = [r for r in rows if r["shape"] == shape and r["batch"] == BATCH
               and r["state"] == STATE and r["window"] == WINDOW]  # fmt: skip
    if setting and "kernel" in setting[0]:
        return _one([r["us"] for r in setting if r["kernel"] == kernel], what)
    return _one([r[f"{kernel}_us"] for r in setting if f"{kernel}_us" in r], what)


def verify_us(shape: str, batch: int, kernel: str) -> float:
    """Our verify's (or T = 1 step's) µs at VERIFY_T drafts in the verify run's call-4 files."""
    rows = _load(VERIFY, f"call4/b{batch}-{shape}-verify.json")["rows"]
    return _one([r["us"] for r in rows if r.get("T") == VERIFY_T and r.get("kernel") == kernel],
                f"{VERIFY} {shape} b={batch} {kernel}")  # fmt: skip


def flashinfer_verify_us(batch: int) -> float:
    """FlashInfer checkpointing_ssu's faster of default and monolith, mixed acceptance, super120b."""
    rows = _load(VERIFY, "call5/fi-lp_spec.json")["results"]
    return min(r["timing"]["us"] for r in rows if r.get("part") == "spec" and r["batch"] == batch
               and r["T"] == VERIFY_T and " mixed " in r["kernel"])  # fmt: skip


def verify_table() -> list[str]:
    peer = ", ".join(f"{flashinfer_verify_us(b):.1f} at batch {b}" for b in VERIFY_BATCHES)
    lines = [
        f"Verify of T = {VERIFY_T} drafts, one H100, mixed acceptance, commit fused; µs per step "
        f"(x our T = 1) ({_link(VERIFY)}). FlashInfer's `checkpointing_ssu` (super120b only): "
        f"{peer}.",
        "",
        "| model | " + " | ".join(f"batch {b}" for b in VERIFY_BATCHES) + " |",
        "|---|" + "---|" * len(VERIFY_BATCHES),
    ]
    for row in ROWS:
        cells = []
        for batch in VERIFY_BATCHES:
            ours = verify_us(row.shape, batch, "verify_mixed")
            cells.append(f"{ours:.1f} ({ours / verify_us(row.shape, batch, 't1'):.2f}x)")
        lines.append(f"| {row.model} | " + " | ".join(cells) + " |")
    return lines


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
    lines = [
        f"Checkpoint formats, {FORMATS_DEVICE}, L = {WINDOW}, µs per step amortized ({_link(FORMATS)}, "
        f"commit {_load(FORMATS, 'mamba2.json')['commit_measured'][:7]}); "
        "(x): the format's own conventional step over ours; peers: FlashInfer's `checkpointing_ssu`, "
        "fla's FP32 step.",
        "",
        "| model | checkpoint | batch 256 | non-flush, of the copy ceiling | "
        + " | ".join(f"batch {b}" for b in FORMAT_BATCHES)
        + " | peer, batch 256 |",
        "|---|---|---|---|" + "---|" * len(FORMAT_BATCHES) + "---|",
    ]
    for model, shape, state, peer_state in FORMAT_ROWS:
        cells = [
            f"{format_us(shape, state, BATCH, 'amortized'):.1f}",
            f"{nonflush_pct(shape, state):.0f}%",
        ]
        for batch in FORMAT_BATCHES:
            ours = format_us(shape, state, batch, "amortized")
            conv = format_us(shape, state, batch, "conventional")
            cells.append(f"{ours:.1f}" + (f" ({conv / ours:.2f}x)" if conv else ""))
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
    lines = [
        BEGIN,
        "",
        f"One H200, batch {BATCH}, FP32 checkpoints, L = {WINDOW}, BF16 activations; µs per step "
        "(ReplaySSM amortized over its flushes).",
        "",
        "| model | conventional | ReplaySSM | speed-up | fastest peer | results |",
        "|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        conv = step_us(row.folder, row.file, row.shape, "conventional")
        replay = step_us(row.folder, row.file, row.shape, "amortized")
        folders = [row.folder]
        if row.peer is None:
            peer = row.no_peer
        else:
            us = step_us(row.peer.folder, row.peer.file, row.shape, row.peer.kernel)
            peer = f"{row.peer.name} {us:.1f}"
            folders += [row.peer.folder] if row.peer.folder != row.folder else []
        links = ", ".join(_link(f) for f in folders)
        lines.append(f"| {row.model} ({row.family}) | {conv:.1f} | {replay:.1f} | "
                     f"{conv / replay:.2f}x | {peer} | {links} |")  # fmt: skip
    lines += ["", *formats_table(), "", *verify_table(), "", END]
    return "\n".join(lines)


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
