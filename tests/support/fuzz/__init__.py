"""Fuzzing of every public entry (tests/ops/test_fuzz_entries.py runs them): the registry and the
property are in core.py; each module below registers the entries of one area."""

# (importing each module registers its entries)
from . import caches, cli, decode, launch, layouts, nan, plans, snapshot, verify  # noqa: F401
from .core import COUNTS, ENTRIES, Call, Entry, check_call, entry

__all__ = ["COUNTS", "ENTRIES", "Call", "Entry", "check_call", "entry"]
