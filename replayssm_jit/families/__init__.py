"""The family registry: one `Family` per kernel family; shared code asks it, never a name.

The ops sit above this layer, so each family's op functions are listed in ops/registry.py,
keyed by these Family objects (docs/design.md, "Adding a family")."""

from __future__ import annotations

from replayssm_jit.families.base import Family, HeadShape, RingLayout
from replayssm_jit.families.gdn import GDN
from replayssm_jit.families.kda import KDA
from replayssm_jit.families.mamba2 import MAMBA2

FAMILIES: dict[str, Family] = {f.name: f for f in (MAMBA2, GDN, KDA)}


def get_family(name: object) -> Family:
    """The registered family called `name`, else a ValueError listing them."""
    if isinstance(name, Family):
        return name
    if not isinstance(name, str) or name not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


__all__ = ["FAMILIES", "GDN", "KDA", "MAMBA2", "Family", "HeadShape", "RingLayout", "get_family"]
