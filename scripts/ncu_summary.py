"""ncu_summary.py CSV...: one markdown table per Nsight Compute CSV (`ncu --csv --page details`),
a row per profiled kernel: duration, DRAM throughput, registers, occupancy and issue figures.

The CSV may start with the profiled program's own output; the table starts at ncu's header.
"""

from __future__ import annotations

import csv
import io
import re
import sys
from pathlib import Path

COLUMNS = (  # (heading, ncu metric name)
    ("µs", "Duration"),
    ("DRAM %", "DRAM Throughput"),
    ("SM %", "Compute (SM) Throughput"),
    ("regs", "Registers Per Thread"),
    ("occupancy % (theory)", "Achieved Occupancy"),
    ("issued / scheduler / cycle", "Issued Warp Per Scheduler"),
    ("cycles / issued", "Warp Cycles Per Issued Instruction"),
    ("no eligible %", "No Eligible"),
)


def kernels(text: str) -> list[dict[str, str]]:
    """Each profiled kernel's metrics by name (plus its name, grid and block), in launch order."""
    start = text.find('"ID"')
    if start < 0:
        return []
    rows = list(csv.reader(io.StringIO(text[start:])))
    col = {name: i for i, name in enumerate(rows[0])}
    found: dict[str, dict[str, str]] = {}
    for row in rows[1:]:
        if len(row) <= col["Metric Value"]:
            continue
        k = found.setdefault(row[col["ID"]], {"kernel": row[col["Kernel Name"]],
                                               "grid": row[col["Grid Size"]],
                                               "block": row[col["Block Size"]]})  # fmt: skip
        k.setdefault(row[col["Metric Name"]], row[col["Metric Value"]])
    return list(found.values())


def short_name(name: str) -> str:
    """`void per_item_kernel<State<64, 128, ...>>(Params)` -> `State<64, 128, ...>`."""
    inner = re.sub(r"^void \w+<(.*)>\(.*\)$", r"\1", name)
    return inner.replace("__nv_bfloat16", "bf16").replace("__nv_fp8_e4m3", "e4m3")


def number(value: str) -> float:
    return float(value.replace(",", ""))


def table(path: Path) -> str:
    found = kernels(path.read_text())
    if not found:
        return f"### {path.name}\n\nno kernel profiled\n"
    lines = [f"### {path.name}", "", "| # | kernel | grid | " + " | ".join(h for h, _ in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 3) + "|"]  # fmt: skip
    for i, k in enumerate(found):
        cells = []
        for _heading, metric in COLUMNS:
            v = k.get(metric, "")
            if metric == "Duration" and v:
                v = f"{number(v) / 1000:.1f}"
            elif metric == "Achieved Occupancy" and v:
                v = f"{number(v):.1f} ({number(k.get('Theoretical Occupancy', 'nan')):.1f})"
            cells.append(v)
        lines.append(
            f"| {i} | `{short_name(k['kernel'])}` | {k['grid']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print("\n".join(table(Path(p)) for p in sys.argv[1:]))
