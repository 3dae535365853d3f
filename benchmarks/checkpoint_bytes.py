"""Bytes per sequence per SSM layer of each checkpoint configuration of issue 18 (what caps an
engine's concurrency): the high-precision (HP) checkpoint, the low-precision (LP) read copy with
its scales, and the record rings of capacity L + T (the layouts' ring rows; BF16 activations). Analytic, from the
model shapes and the layouts' ring definitions; no GPU.

    python benchmarks/checkpoint_bytes.py [--window 16] [--drafts 1]

Formats (docs/precision.md): FP8 e4m3 with one FP32 scale per state row; NVFP4 with 4-bit values,
one e4m3 scale per 16 elements and one FP32 scale per head. Two-precision GDN and KDA records
also keep each token's v (activation dtype) and beta (FP32), so that a flush can recompute the
corrections u from the HP checkpoint.
"""

from __future__ import annotations

import argparse

import torch

from replayssm_jit.core.models import MODELS
from replayssm_jit.families import HeadShape, get_family

# Bytes per element, and per-row / per-head extras, of each checkpoint format.
ELEMENT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5}

# (name, HP format or None, LP format or None, replay?): the configurations.
CONFIGS = (
    ("conventional FP32", "fp32", None, False),
    ("conventional BF16/FP16", "bf16", None, False),
    ("conventional FP8", None, "fp8", False),
    ("replay FP32", "fp32", None, True),
    ("shared FP16", None, "fp16", True),
    ("shared FP8", None, "fp8", True),
    ("shared NVFP4", None, "nvfp4", True),
    ("separate FP32 + FP8", "fp32", "fp8", True),
    ("separate FP32 + NVFP4", "fp32", "nvfp4", True),
    ("separate FP16 + FP8", "fp16", "fp8", True),
    ("separate FP16 + NVFP4", "fp16", "nvfp4", True),
)


def checkpoint_bytes(fmt: str | None, heads: int, rows: int, cols: int) -> float:
    """One checkpoint of `heads` [rows, cols] matrices in `fmt`, with its scales."""
    if fmt is None:
        return 0.0
    elements = heads * rows * cols
    scales = 0.0
    if fmt == "fp8":
        scales = heads * rows * 4  # an FP32 scale per state row
    elif fmt == "nvfp4":
        scales = elements / 16 + heads * 4  # an e4m3 scale per 16 elements, an FP32 one per head
    return elements * ELEMENT_BYTES[fmt] + scales


def record_bytes(model, capacity: int, two_precision: bool) -> float:
    """The record rings of one sequence: the family's rings (BF16 activations), with separate
    mode's own (a delta-rule family's v and beta per token) where `two_precision`."""
    family = get_family(model.family)
    shape = HeadShape(model.key_heads, model.value_heads, model.d_k, model.d_v)
    total = sum(
        torch.Size(ring.per_slot_shape(shape, capacity)).numel()
        * ring.torch_dtype(torch.bfloat16).itemsize
        for ring in family.rings
        if two_precision or not ring.read_copy_only
    )
    return float(total)


def table(window: int, drafts: int) -> str:
    capacity = window + drafts  # CacheLayout.capacity
    lines = [
        f"Bytes per sequence per layer (L = {window}, T = {drafts}, ring capacity {capacity}, "
        "BF16 activations); in brackets, sequences per GB against conventional FP32 (x).",
        "",
        "| configuration | " + " | ".join(MODELS) + " |",
        "|---|" + "---|" * len(MODELS),
    ]
    base = {}
    for name, hp, lp, replay in CONFIGS:
        cells = []
        for key, model in MODELS.items():
            # [heads, rows, cols] of the state: Mamba-2 [H, P, N], GDN / KDA [HV, V, K].
            dims = (model.value_heads, model.d_v, model.d_k)
            two = hp is not None and lp is not None
            total = checkpoint_bytes(hp, *dims) + checkpoint_bytes(lp, *dims)
            if replay:
                total += record_bytes(model, capacity, two)
            base.setdefault(key, total)
            cells.append(f"{total / 1e3:,.1f} kB ({base[key] / total:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--drafts", type=int, default=1)
    args = p.parse_args(argv)
    print(table(args.window, args.drafts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
