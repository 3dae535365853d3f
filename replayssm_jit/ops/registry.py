"""Each family's ops, keyed by its registered Family: the one place the ops layer lists them.

The family registry (families/__init__.py) sits below the ops, so it cannot hold their
functions; this table holds them instead, one line per family, and shared code (the custom ops,
materialize_slots, the CLIs) looks a family's ops up here rather than by its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from replayssm_jit.families import GDN, KDA, MAMBA2, Family, get_family
from replayssm_jit.ops.gdn import delta_fold_held, delta_fold_rows, gdn_decode
from replayssm_jit.ops.kda import kda_decode
from replayssm_jit.ops.mamba2 import (
    check_mamba2_fold_params,
    mamba2_decode,
    mamba2_fold_held,
    mamba2_fold_rows,
)
from replayssm_jit.ops.snapshot import (
    gdn_snapshot_verify,
    kda_snapshot_verify,
    mamba2_snapshot_verify,
)
from replayssm_jit.ops.verify import gdn_verify, kda_verify, mamba2_verify

__all__ = ["FAMILY_OPS", "FamilyOps", "family_ops"]


def _no_fold_params(plan, tensors, params) -> None:
    """A family whose records fold without model parameters has none to check."""


@dataclass(frozen=True)
class FamilyOps:
    """A family's public ops (by the schema's op names: decode, verify, snapshot_verify) and
    materialize_slots' fold of a slot's held records: fold(plan, tensors, slot, held, params),
    materialize_states' of many slots, each its own count: fold_rows(plan, tensors, rows,
    held, params) (rows and held [n] tensors), with the model parameters they need besides the records (fold_params) and
    their check."""

    decode: Callable
    verify: Callable
    snapshot_verify: Callable
    fold: Callable
    fold_rows: Callable
    fold_params: tuple[str, ...] = ()
    check_fold_params: Callable = _no_fold_params


FAMILY_OPS: dict[Family, FamilyOps] = {
    MAMBA2: FamilyOps(mamba2_decode, mamba2_verify, mamba2_snapshot_verify, mamba2_fold_held,
                      mamba2_fold_rows, ("A",), check_mamba2_fold_params),
    GDN: FamilyOps(gdn_decode, gdn_verify, gdn_snapshot_verify, delta_fold_held,
                   delta_fold_rows),
    KDA: FamilyOps(kda_decode, kda_verify, kda_snapshot_verify, delta_fold_held,
                   delta_fold_rows),
}  # fmt: skip


def family_ops(family: object) -> FamilyOps:
    """The ops of a registered family (a Family or its name), else an error naming them."""
    fam = get_family(family)
    if fam not in FAMILY_OPS:
        raise ValueError(
            f"family: expected one with ops in ops/registry.py "
            f"({sorted(f.name for f in FAMILY_OPS)}), got {fam.name!r}"
        )
    return FAMILY_OPS[fam]
