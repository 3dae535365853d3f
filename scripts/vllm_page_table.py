#!/usr/bin/env python3
"""Write docs/integrations-vllm-pages.md's table of bytes per vLLM cache page from the package.

    python scripts/vllm_page_table.py           # rewrite the block between the markers
    python scripts/vllm_page_table.py --check   # exit 1 (with a diff) if the block is stale

Each row is what the vLLM plugin declares for one layer of a model of core/models.py
(integrations/vllm/page_hooks.pages_for, at the plugin's default window): vLLM's own entries as
its calculators give them (conv state (d_conv - 1 + num_spec, conv_dim) in BF16, d_conv = 4;
the SSM state in FP32), then the layout's rings and cursors with page_entries' pads.
tests/docs/test_vllm_page_table.py runs the check on the CPU.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from replayssm_jit.core.models import MODELS  # noqa: E402
from replayssm_jit.integrations.vllm.page_hooks import pages_for  # noqa: E402

DOC = ROOT / "docs/integrations-vllm-pages.md"
BEGIN = "<!-- page-table: written by scripts/vllm_page_table.py -->"
END = "<!-- /page-table -->"
WINDOW, D_CONV = 16, 4
NAMES = {
    "nemotron-3-nano-4b": "Nemotron-3-Nano-4B (Mamba-2)",
    "nemotron-3-super-120b": "Nemotron-3-Super-120B (Mamba-2)",
    "qwen3.5-4b": "Qwen3.5-4B (GDN)",
    "qwen3.5-122b": "Qwen3.5-122B (GDN)",
    "kimi-linear-48b": "Kimi-Linear-48B (KDA)",
}


def declared(model, drafts: int):
    """(vLLM's bytes, ours by tensor name (pads as "pads"), the page's bytes) of one layer."""
    conv_dim = model.value_heads * model.d_v + 2 * model.key_heads * model.d_k
    shapes = [(D_CONV - 1 + drafts - 1, conv_dim), (model.value_heads, model.d_v, model.d_k)]
    saved = os.environ.get("REPLAYSSM_VLLM_WINDOW")
    os.environ["REPLAYSSM_VLLM_WINDOW"] = str(WINDOW)
    try:
        pages = pages_for(model.family, shapes, [torch.bfloat16, torch.float32],
                          act_dtype=torch.bfloat16, drafts=drafts)  # fmt: skip
    finally:
        if saved is None:
            del os.environ["REPLAYSSM_VLLM_WINDOW"]
        else:
            os.environ["REPLAYSSM_VLLM_WINDOW"] = saved
    e = pages.entries
    sizes = [math.prod(s) * d.itemsize for s, d in zip(e.shapes, e.dtypes)]
    ours: dict[str, int] = {}
    for i, (name, size) in enumerate(zip(e.names, sizes)):
        if i >= pages.own:
            key = name or "pads"
            ours[key] = ours.get(key, 0) + size
    return sizes[: pages.own], ours, e.page_bytes


def _n(x: int) -> str:
    return f"{x:,}"


def table() -> str:
    head = (
        "| model | vLLM's entries, T = 1 (conv + SSM state) | + rings and cursors, T = 1 | "
        "page | vLLM's entries, T = 2 | + rings and cursors, T = 2 | page |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for key, name in NAMES.items():
        model = MODELS[key]
        cells = []
        for drafts in (1, 2):
            own, ours, page = declared(model, drafts)
            added = sum(ours.values())
            parts = ", ".join(f"{n} {_n(b)}" for n, b in ours.items())
            if drafts == 1:
                cells.append(" + ".join(_n(b) for b in own))
                cells.append(f"{_n(added)} ({parts})")
            else:
                cells.append(_n(sum(own)))
                cells.append(_n(added))
            cells.append(f"{_n(page)} (×{page / sum(own):.3f})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |\n")
    return head + "".join(rows)


def split_doc(text: str) -> tuple[str, str, str]:
    start, end = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
    return text[:start], text[start:end], text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the block is stale")
    args = parser.parse_args(argv)
    before, block, after = split_doc(DOC.read_text())
    want = table()
    if args.check:
        if block != want:
            sys.stdout.writelines(difflib.unified_diff(block.splitlines(True),
                                                       want.splitlines(True)))  # fmt: skip
            return 1
        return 0
    DOC.write_text(before + want + after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
