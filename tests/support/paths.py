"""The checkout's folders that tests reach outside tests/, found from this one file."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/support/paths.py: two folders below the root
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = ROOT / "scripts"
