"""Fuzzing of every public entry (tests/test_fuzz_entries.py runs them): the registry and the
property are in core.py; each module below registers the entries of one area."""

# (importing each module registers its entries)
from fuzz import caches, cli, decode, launch, layouts, plans, verify  # noqa: F401
from fuzz.core import COUNTS, ENTRIES, Call, Entry, check_call, entry

__all__ = ["COUNTS", "ENTRIES", "Call", "Entry", "check_call", "entry"]
