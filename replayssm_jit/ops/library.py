"""The functional ops as torch.library custom ops (namespace `replayssm`), for torch.compile and
CUDA graphs:

    handle = plan_handle(plan)                       # once, where the plan is made
    torch.ops.replayssm.mamba2_decode(handle, state=..., x=..., ..., out=out)   # returns None

A custom op's schema holds tensors and scalars only, so a plan reaches its op as an int handle:
plan_handle() files the plan in a process-wide registry (the same plan object keeps its handle)
and the op looks it up when it runs. Keep the handle a constant of the compiled code (a module
attribute, a closure value): dynamo then bakes it into the graph like any int constant, and a
CUDA graph replays the launch the lookup chose at capture. release_plan() drops the entry.

Each op's arguments come from its family's schema (families/schema.py: op_args) and are
keyword-only after the plan, so that no caller, compiled graphs included, binds by position.
Every op mutates `out` (required) and the caller's slot tensors in place and returns nothing;
its schema marks each tensor it may write, so functionalization and reinplacing see them. The
kernel is the functional op itself (one code path, same checks); the fake kernel writes and
allocates nothing. `workspace` may be left out where the op's launch reads none (only the
split step and the split verify do; a zero-element tensor made at plan_handle() stands in), so
no op allocates. A seed comes as an
int (`seed`) or an int64 device tensor (`seed_tensor`), not both. commit_drafts takes the
layout's rings by role (COMMIT_RING_ARGS): value_ring, key_ring, decay_ring.
"""

from __future__ import annotations

import itertools
import string
import threading
from collections.abc import Callable, Sequence

import torch

from replayssm_jit.families import FAMILIES
from replayssm_jit.families.schema import (
    COMMIT_DRAFTS_ARGS,
    COMMIT_READ_RING_PARAMS,
    COMMIT_RING_PARAMS,
    COMMIT_SNAPSHOTS_ARGS,
    SEED,
    Param,
    commit_ring_roles,
    op_args,
)
from replayssm_jit.families.schema import OPS as SCHEMA_OPS
from replayssm_jit.ops.commit import commit_drafts
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.registry import family_ops
from replayssm_jit.ops.snapshot import commit_snapshots

NAMESPACE = "replayssm"

__all__ = ["NAMESPACE", "OPS", "lookup_plan", "plan_handle", "release_plan"]

# ---------------------------------------------------------------------------------------------
# Plan registry: the handle an op's schema carries in place of the DecodePlan
# ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
_plans: dict[int, DecodePlan] = {}
_handles: dict[int, int] = {}  # id(plan) -> handle; the entry in _plans keeps the id unique
_scratch: dict[int, torch.Tensor] = {}  # handle -> zero-element float32 workspace
_next = itertools.count(1)


def plan_handle(plan: DecodePlan) -> int:
    """The int handle of `plan` for the registered ops (the same one for the same object)."""
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    with _lock:
        handle = _handles.get(id(plan))
        if handle is None:
            handle = next(_next)
            _plans[handle], _handles[id(plan)] = plan, handle
            # Made here, not in the op, so that no registered op allocates.
            _scratch[handle] = torch.empty(0, dtype=torch.float32, device=plan.device)
        return handle


def lookup_plan(handle: int) -> DecodePlan:
    """The plan filed under `handle` by plan_handle()."""
    plan = _plans.get(handle) if isinstance(handle, int) else None
    if plan is None:
        raise ValueError(f"plan: expected a handle from plan_handle(), got {handle!r}")
    return plan


def release_plan(handle: int) -> None:
    """Forget `handle` (ops called with it raise afterwards); compiled code that holds it must
    be dropped first."""
    with _lock:
        plan = _plans.pop(handle, None)
        if plan is not None:
            _handles.pop(id(plan), None)
            _scratch.pop(handle, None)


# ---------------------------------------------------------------------------------------------
# The one registration helper
# ---------------------------------------------------------------------------------------------


def _schema_types(args: Sequence[Param]) -> list[tuple[str, str, bool]]:
    """(name, schema type, written) of each argument (required ones first, as the schema
    needs); the seed (an int or an int64 device tensor) becomes seed and seed_tensor."""
    parsed = []
    for p in args:
        if p is SEED:
            parsed += [("seed", "SymInt?", False), ("seed_tensor", "Tensor?", False)]
        else:
            parsed.append((p.name, "Tensor?" if p.optional else "Tensor", p.written))
    return sorted(parsed, key=lambda arg: arg[1].endswith("?"))


def _schema(args: Sequence[Param]) -> tuple[str, list[str], list[str]]:
    """The schema "(int plan, ...) -> ()" of `args`, its argument names in order, and the
    names it marks written."""
    parts, names, mutated = ["int plan"], [], []
    aliases = iter(string.ascii_lowercase)
    for name, kind, writes in _schema_types(args):
        if writes:
            base, opt = kind.rstrip("?"), kind[len(kind.rstrip("?")) :]
            kind = f"{base}({next(aliases)}!){opt}"
            mutated.append(name)
        parts.append(f"{kind} {name}" + ("=None" if kind.endswith("?") else ""))
        names.append(name)
    # Keyword-only after the plan: callers (and compiled graphs) bind by name, never by position.
    return f"({parts[0]}, *, {', '.join(parts[1:])}) -> ()", names, mutated


def _seeded(kwargs: dict) -> dict:
    """kwargs with `seed` / `seed_tensor` merged into the functional ops' one `seed`."""
    seed, seed_tensor = kwargs.pop("seed", None), kwargs.pop("seed_tensor", None)
    if seed is not None and seed_tensor is not None:
        raise ValueError("seed, seed_tensor: expected at most one of them, got both")
    return {**kwargs, "seed": seed_tensor if seed_tensor is not None else seed}


def _with_workspace(plan: DecodePlan, handle: int, kwargs: dict, verify: bool) -> dict:
    """kwargs with the plan's zero-element workspace where none is given and none is needed."""
    if kwargs.get("workspace") is None:
        if plan.workspace_floats and plan.reads_workspace(verify):
            raise ValueError(
                f"workspace: expected a float32 tensor of at least {plan.workspace_floats} "
                "elements (the registered ops allocate nothing), got None"
            )
        kwargs = {**kwargs, "workspace": _scratch[handle]}
    return kwargs


# Defined with Library.define / impl rather than torch.library.custom_op: custom_op's Python
# ADInplaceOrView kernel indexes written arguments by position, which fails on torch <= 2.11
# when a written optional argument (workspace, the rings) is left at its default. The kernel
# bumps the written tensors' versions itself, as that kernel would.
_LIB = torch.library.Library(NAMESPACE, "DEF")


def register_op(
    name: str, args: Sequence[Param], call: Callable[[DecodePlan, int, dict], None]
) -> torch._ops.OpOverloadPacket:
    """Register replayssm::`name` with a plan handle then `args` (families/schema.py's op_args;
    callers should pass tensors by keyword); `call(plan, handle, kwargs)` runs the functional
    op."""
    schema, names, written = _schema(args)

    def kernel(plan: int, *given, **kwargs) -> None:
        kwargs = {**dict(zip(names, given)), **kwargs}
        call(lookup_plan(plan), plan, dict(kwargs))
        for name in written:
            tensor = kwargs.get(name)
            # Inference tensors carry no version counter.
            if isinstance(tensor, torch.Tensor) and not tensor.is_inference():
                torch.autograd.graph.increment_version(tensor)

    _LIB.define(name + schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")

    def _fake(plan, *given, **kwargs) -> None:
        # A stale handle fails at trace time rather than at the first real call.
        if isinstance(plan, int):
            lookup_plan(plan)
        # Writes in place and returns nothing: no shapes to produce, no tensor to allocate.

    torch.library.register_fake(f"{NAMESPACE}::{name}", _fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name)


# ---------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------


def _step(fn: Callable, verify: bool = False) -> Callable[[DecodePlan, int, dict], None]:
    return lambda plan, handle, kw: fn(plan, **_seeded(_with_workspace(plan, handle, kw, verify)))


def _without_workspace_or_seed(fn: Callable) -> Callable[[DecodePlan, int, dict], None]:
    return lambda plan, handle, kw: fn(plan, **kw)


# commit_drafts' ring arguments by role, in every family's ring order (families/*, rings): the
# rows on value heads (Mamba-2 x, GDN/KDA u), the rows on key heads (B, k), the decay inputs.
COMMIT_RING_ARGS = COMMIT_RING_PARAMS


def _commit_drafts(plan: DecodePlan, handle: int, kw: dict) -> None:
    # (rings by role, in the layout's order: families/schema.py; commit_drafts names any missing)
    rings = {name: kw.pop(role, None) for role, name in commit_ring_roles(plan.layout.ring_names)}
    extra = [role for role in COMMIT_READ_RING_PARAMS if kw.pop(role, None) is not None]
    if extra:
        raise ValueError(
            f"{extra[0]}: expected none (the layout has no read copy's rings: "
            f"{list(plan.layout.ring_names)}), got a tensor"
        )
    commit_drafts(plan, {"cursors": kw.pop("cursors"), **rings}, **kw)


def _call(op: str, fn: Callable) -> Callable[[DecodePlan, int, dict], None]:
    if op == "snapshot_verify":  # (reads no workspace and no seed)
        return _without_workspace_or_seed(fn)
    return _step(fn, verify=op == "verify")


OPS = {
    f"{family.name}_{op}": register_op(
        f"{family.name}_{op}",
        op_args(family, op),
        _call(op, getattr(family_ops(family), op)),
    )
    for family in FAMILIES.values()
    for op in SCHEMA_OPS
}
OPS["commit_drafts"] = register_op("commit_drafts", COMMIT_DRAFTS_ARGS, _commit_drafts)
OPS["commit_snapshots"] = register_op(
    "commit_snapshots", COMMIT_SNAPSHOTS_ARGS, _without_workspace_or_seed(commit_snapshots)
)
