"""The one place a decode step is launched: checks shared by every family, then the module's
binding (CUDA) or the PyTorch path (CPU)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from replayssm_jit.core.checks import (
    check_disjoint,
    check_no_alias,
    check_slot_indices,
    check_tensor,
)
from replayssm_jit.families.base import Family
from replayssm_jit.families.layout import check_pool_layout
from replayssm_jit.families.schema import (
    CHECKPOINT_NAMES,
    bind,
    check_token_inputs,
    commit_ring_roles,
)
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.plan import DecodePlan
from replayssm_jit.ops.torch_path import Pool, Rows, StepScalars


def check_plan(plan: object, family: Family) -> DecodePlan:
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    if plan.family is not family:
        raise ValueError(f"plan: expected a {family.name} plan, got a {plan.family.name} plan")
    return plan


def resolve_seed(plan: DecodePlan, seed: object) -> tuple[int, torch.Tensor | None]:
    """(seed, seed_tensor): the plan's seed, an int, or an int64 device tensor of one element
    that the kernels read on the device (so a CUDA graph may change it)."""
    if seed is None:
        return plan.seed, None
    if isinstance(seed, torch.Tensor):
        if "device_seed" not in plan.spec.flags:
            raise ValueError(
                "seed: expected an int (the module keeps its seed in the launch's parameters; "
                "plan with device_seed=True to read it from a tensor), got a tensor"
            )
        check_tensor("seed", seed, dtype=torch.int64, device=plan.device)
        if seed.numel() != 1:
            raise ValueError(f"seed: expected a tensor of 1 element, got shape {list(seed.shape)}")
        return plan.seed, seed.reshape(1)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(
            f"seed: expected None, an int or an int64 tensor, got {type(seed).__name__}"
        )
    return seed & (2**63 - 1), None


def reads_device_values(plan: DecodePlan) -> bool:
    """Whether the ops check values held on the device (slot ids, draft counts, parents, ...):
    on the CPU always (no sync to save), on CUDA with check_slot_values and outside a capture."""
    if plan.backend == "cpu":
        return True
    return plan.check_slot_values and not torch.cuda.is_current_stream_capturing()


def check_slot_tensors(
    plan: DecodePlan,
    tensors: Mapping[str, torch.Tensor | None],
    slot_indices: torch.Tensor,
    *,
    optional: tuple[str, ...] = (),
    written: Mapping[str, torch.Tensor | None] | None = None,
    read: Mapping[str, object] | None = None,
) -> int:
    """The slot tensors against the plan's layout (those in `optional` may be None) and the
    layout their pool was made with, the slot ids (values where `reads_device_values`), and
    that the slot tensors and the other tensors the step writes (`written`: out, workspace)
    share no memory with each other nor with what it reads (`read`); returns the slot count."""
    num_slots = plan.layout.check_tensors(tensors, device=plan.device, optional=optional)
    check_pool_layout(plan.layout, tensors.get("cursors"))
    check_disjoint({**tensors, **(written or {})})
    check_no_alias({**tensors, **(written or {})}, {**(read or {}), "slot_indices": slot_indices})
    check_slot_indices(
        slot_indices, plan.batch_size, num_slots, plan.pad_slot_id, plan.device,
        read_values=reads_device_values(plan),
    )  # fmt: skip
    return num_slots


def live_rows(plan: DecodePlan, slot_indices: torch.Tensor) -> list[tuple[int, int]]:
    """(batch row, slot) of the rows that are not pad rows (reads the ids from the device)."""
    return [(b, s) for b, s in enumerate(slot_indices.tolist()) if s != plan.pad_slot_id]


def live_cursors(
    plan: DecodePlan, cursors: torch.Tensor, slot_indices: torch.Tensor
) -> list[tuple[int, int, list[int]]]:
    """(row, slot, cursor words) of each non-pad row, read from the device (a host sync on
    CUDA: call only where `reads_device_values`)."""
    live = live_rows(plan, slot_indices)
    words = cursors[[s for _, s in live]].tolist() if live else []
    return [(b, s, w) for (b, s), w in zip(live, words)]


def cursor_fault(plan: DecodePlan, words: list[int], *, step: bool) -> str | None:
    """Why a cursor is one no launch leaves (None where it is valid): n records held, p pending
    drafts; a standard step (`step`) checks n only, as the kernels do."""
    n, p, L, T = words[0], words[3], plan.layout.window, plan.layout.drafts
    if step:
        limit = L if T == 1 else L + T
        return None if 0 <= n < limit else f"n={n} records held, expected 0..{limit - 1}"
    if n >= 0 and 0 <= p <= T and n + p < L + T:
        return None
    return f"n={n} records held and p={p} pending drafts, expected 0 <= p <= {T}, n + p < {L + T}"


def check_cursors(
    plan: DecodePlan, cursors: torch.Tensor, slot_indices: torch.Tensor, *, step: bool
) -> list[tuple[int, int, list[int]]]:
    """Eager mode: every live row's cursor is one a launch may leave (the kernels give a bad
    one NaN outputs; here it is an error). Returns live_cursors'."""
    rows = live_cursors(plan, cursors, slot_indices)
    if not plan.check_slot_values:  # the caller asked for the kernels' containment: NaN rows
        return rows
    for b, s, w in rows:
        why = cursor_fault(plan, w, step=step)
        if why is not None:
            raise ValueError(
                f"cursors: expected a cursor a step leaves in slot {s} (row {b}), got {why} "
                f"(a corrupted cursor, or one of another layout: reset_slots starts a slot)"
            )
    return rows


def check_step_cursors(
    plan: DecodePlan,
    tensors: Mapping[str, torch.Tensor | None],
    slot_indices: torch.Tensor,
    num_accepted: torch.Tensor | None,
) -> None:
    """Eager mode, before a standard step: valid cursors; a conventional plan only on slots
    holding no records; pending drafts only with num_accepted (in [0, p]), never dropped."""
    cursors = tensors.get("cursors")
    if cursors is None or not plan.check_slot_values:  # (as check_cursors)
        return
    if not plan.replay:
        for b, s, w in live_cursors(plan, cursors, slot_indices):
            if w[0]:
                raise ValueError(
                    f"plan: expected mode='replay' for slot {s} (row {b}), which holds {w[0]} "
                    f"records (a conventional step would ignore them), got mode='conventional'"
                )
        return
    accepted = None if num_accepted is None else num_accepted.tolist()
    for b, s, w in check_cursors(plan, cursors, slot_indices, step=True):
        # (a p no verify leaves is the kernels' to ignore, as a step checks n only)
        p = w[3] if plan.spec.has_verify and 0 < w[3] <= plan.layout.drafts else 0
        if num_accepted is None and p:
            raise ValueError(
                f"num_accepted: expected the accepted counts of the last verify (slot {s}, row "
                f"{b}, holds {p} pending drafts, which a plain step would drop: pass "
                f"num_accepted=, 0 to reject them, or commit_drafts first), got None"
            )
        if accepted is not None and not 0 <= accepted[b] <= p:
            raise ValueError(
                f"num_accepted: expected values in [0, {p}] (the pending drafts of the last "
                f"verify, cursor word 3), got {accepted[b]} in row {b}"
            )


def check_step_accepted(plan: DecodePlan, num_accepted: object) -> torch.Tensor | None:
    """A standard step's num_accepted: None, or int32 [batch] for a replay plan with drafts."""
    if num_accepted is None:
        return None
    if not plan.replay or not plan.spec.has_verify:
        raise ValueError(
            f"num_accepted: expected None (a plan of mode={plan.mode!r} with drafts="
            f"{plan.layout.drafts} has no verify to commit), got a tensor"
        )
    return check_tensor("num_accepted", num_accepted, shape=(plan.batch_size,),
                        dtype=torch.int32, device=plan.device, contiguous=True)  # fmt: skip


def check_flush_mask(plan: DecodePlan, flush_mask: object) -> torch.Tensor | None:
    """A decode step's flush_mask: None, or for a plan with flush_mask=True a [batch] bool or
    uint8 tensor on its device, contiguous; a nonzero row flushes at this step (read on the
    device: no sync). A plan with the flag and no mask forces nothing."""
    if flush_mask is None:
        return None
    if "flush_mask" not in plan.spec.flags:
        raise ValueError(
            "flush_mask: expected None (a plan without flush_mask=True never reads a mask; plan "
            "with flush_mask=True to force flushes), got a tensor"
        )
    return check_tensor("flush_mask", flush_mask, shape=(plan.batch_size,),
                        dtype=(torch.bool, torch.uint8), device=plan.device,
                        contiguous=True)  # fmt: skip


def torch_scalars(
    plan: DecodePlan, seed_value: int, seed_tensor: torch.Tensor | None
) -> StepScalars:
    """The torch path's scalars for `plan` (a device seed tensor is read here: no sync to save)."""
    if seed_tensor is not None:
        seed_value = int(seed_tensor.item()) & (2**63 - 1)
    return StepScalars(
        replay=plan.replay, flush_every_step=plan.kernel == "flush-every-step",
        window=plan.spec.window, flags=frozenset(plan.spec.flags),
        pad_slot_id=plan.pad_slot_id, seed=seed_value, drafts=plan.layout.drafts,
    )  # fmt: skip


def resolve_workspace(
    plan: DecodePlan, workspace: torch.Tensor | None, verify: bool = False
) -> torch.Tensor:
    """`workspace` (checked: float32 on the plan's device, contiguous, at least
    plan.workspace_floats elements where the step's launch reads it) or a new one."""
    needed = plan.workspace_floats if plan.reads_workspace(verify) else 0
    if workspace is None:
        return torch.empty(needed, dtype=torch.float32, device=plan.device)
    check_tensor("workspace", workspace, dtype=torch.float32, device=plan.device, contiguous=True)
    if workspace.numel() < needed:
        raise ValueError(
            f"workspace: expected at least {plan.workspace_floats} float32 elements "
            f"(plan.workspace_floats), got {workspace.numel()}"
        )
    return workspace


def run_step(
    plan: DecodePlan,
    tensors: Mapping[str, torch.Tensor | None],
    inputs: Mapping[str, object],
    *,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    workspace: torch.Tensor | None,
    seed: object,
    torch_step: Callable[..., None],
    num_accepted: object = None,
    flush_mask: object = None,
) -> torch.Tensor:
    """Check the slot tensors, slot ids, workspace, seed and flush mask (and in eager mode the
    cursors), then commit num_accepted of the last verify (where given) and launch. `inputs`
    holds the family's token inputs in its bindings' order (already checked)."""
    # A conventional step reads and writes only the state.
    optional = () if plan.replay else (*plan.layout.ring_names, "cursors")
    scratch = workspace if isinstance(workspace, torch.Tensor) else None  # (checked below)
    num_accepted = check_step_accepted(plan, num_accepted)
    flush_mask = check_flush_mask(plan, flush_mask)
    seed_arg = seed if isinstance(seed, torch.Tensor) else None
    check_slot_tensors(plan, tensors, slot_indices, optional=optional,
                       written={"out": out, "workspace": scratch},
                       read={**inputs, "seed": seed_arg, "num_accepted": num_accepted,
                             "flush_mask": flush_mask})  # fmt: skip
    seed_value, seed_tensor = resolve_seed(plan, seed)
    workspace = resolve_workspace(plan, workspace)
    if reads_device_values(plan):
        check_step_cursors(plan, tensors, slot_indices, num_accepted)
    if num_accepted is not None:  # the fused commit: every check above has passed
        commit_rings = [tensors[name] for name in plan.layout.ring_names]
        if plan.backend == "cpu":
            pool = Pool(None, None, dict(zip(plan.layout.ring_names, commit_rings)),
                        tensors["cursors"])  # fmt: skip
            torch_path.commit(torch_scalars(plan, plan.seed, None), pool,
                              Rows(slot_indices, num_accepted=num_accepted), None)  # fmt: skip
        else:
            plan.module.commit_step(*commit_args(plan, tensors, num_accepted, None, slot_indices))
    if plan.backend == "cpu":
        setup = torch_scalars(plan, seed_value, seed_tensor)
        # Every ring the step takes, None where the layout has none (separate mode's own).
        names = [r.name for r in plan.family.rings]
        rings = [tensors.get(name) if plan.replay else None for name in names]
        cursors = tensors.get("cursors") if plan.replay else None
        copies = {k: tensors.get(k) for k in plan.layout.checkpoint_names}
        pool = Pool.named({**copies, **dict(zip(names, rings)), "cursors": cursors})
        torch_step(setup, pool, inputs, Rows(slot_indices, out, flush_mask=flush_mask))
        return out
    values = {
        **tensors, **inputs, "state_block_scale": _raw_bytes(tensors.get("state_block_scale")),
        "read_block_scale": _raw_bytes(tensors.get("read_block_scale")), "out": out,
        "slot_indices": slot_indices, "pad_slot_id": plan.pad_slot_id, "seed": seed_value,
        "seed_tensor": seed_tensor, "rows": plan.rows_per_cta, "flags": plan.flag_bits,
        "workspace": workspace, "flush_mask": flush_mask,
    }  # fmt: skip
    if plan.replay:
        plan.module.replay_step(*bind(plan.family, "replay_step", values))
    else:
        plan.module.conventional_step(*bind(plan.family, "conventional_step", values))
    return out


def commit_args(
    plan: DecodePlan,
    tensors: Mapping[str, torch.Tensor | None],
    num_accepted: torch.Tensor,
    accepted_path: torch.Tensor | None,
    slot_indices: torch.Tensor,
) -> list[object]:
    """commit_step's arguments, bound by name (the layout's rings by role, in ring order)."""
    rings = {role: tensors[name] for role, name in commit_ring_roles(plan.layout.ring_names)}
    values = {**rings, "cursors": tensors["cursors"], "num_accepted": num_accepted,
              "accepted_path": accepted_path, "slot_indices": slot_indices,
              "pad_slot_id": plan.pad_slot_id}  # fmt: skip
    return bind(plan.family, "commit_step", values)


def check_inputs(
    plan: DecodePlan, lead: tuple[int, ...], given: Mapping[str, object]
) -> dict[str, object]:
    """The family's token inputs from `given` (by name), checked against its schema, as the
    binding parameters they fill, then the plan scalars the bindings take (None binds as 0).
    lead: the per-token dims, (batch,) for a step or (batch, T) for drafts."""
    fam = plan.family
    inputs: dict[str, object] = check_token_inputs(
        fam, {arg.name: given.get(arg.name) for arg in fam.inputs}, shape=plan.layout.shape,
        act_dtype=plan.layout.act_dtype, device=plan.device, flags=plan.spec.flags, lead=lead,
    )  # fmt: skip
    for name in fam.bound_scalars:
        value = plan.family_options[name]
        inputs[name] = 0.0 if value is None else value
    return inputs


def slot_tensors(family: Family, given: Mapping[str, object], names: tuple[str, ...]) -> dict:
    """The slot tensors of a call by name: `names` (state, cursors, the checkpoint's scales and
    read copy) and the family's rings, those given (state, cursors and the rings every layout
    has always, so that the layout's check names what is missing)."""
    tensors = {
        n: given.get(n) for n in names if given.get(n) is not None or n in ("state", "cursors")
    }
    for ring in family.rings:
        if not ring.read_copy_only or given.get(ring.name) is not None:
            tensors[ring.name] = given.get(ring.name)
    return tensors


def _raw_bytes(blocks: torch.Tensor | None) -> torch.Tensor | None:
    """NVFP4 block scales as the bytes the kernels read (uint8 views cross every binding)."""
    return None if blocks is None else blocks.view(torch.uint8)


def run_decode(
    plan: DecodePlan, family: Family, torch_step: Callable[..., None], args: Mapping[str, object]
) -> torch.Tensor:
    """The body of every family's decode op: `args` are the op's arguments by name (its
    token inputs as the family's schema names them)."""
    check_plan(plan, family)
    shape = plan.layout.shape
    inputs = check_inputs(plan, (plan.batch_size,), args)
    out = output_buffer(plan, args.get("out"), (shape.value_heads, shape.value_dim))
    tensors = slot_tensors(family, args, (*CHECKPOINT_NAMES, "cursors"))
    return run_step(
        plan, tensors, inputs, out=out, slot_indices=args["slot_indices"],
        workspace=args.get("workspace"), seed=args.get("seed"), torch_step=torch_step,
        num_accepted=args.get("num_accepted"), flush_mask=args.get("flush_mask"),
    )  # fmt: skip


def output_buffer(
    plan: DecodePlan, out: torch.Tensor | None, row_shape: tuple[int, ...]
) -> torch.Tensor:
    """`out` (checked: [batch, *row_shape], activation dtype, contiguous) or a new one."""
    shape = (plan.batch_size, *row_shape)
    if out is None:
        return torch.empty(shape, dtype=plan.layout.act_dtype, device=plan.device)
    return check_tensor("out", out, shape=shape, dtype=plan.layout.act_dtype, device=plan.device,
                        contiguous=True)  # fmt: skip
