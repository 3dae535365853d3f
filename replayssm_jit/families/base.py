"""What every kernel family declares: its head shape, spec dims, rings, flags and inputs, and
apart from those facts the launch traits of the kernels its module compiles (LaunchTraits).

Shared code asks a `Family` instead of branching on a family's name. A family's state per
value head is [value_dim, key_dim] (key_dim contiguous); its records live in per-slot rings of
CAP = L + T rows, each on the key or the value heads.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from replayssm_jit.core.checks import check_at_most, check_bool, check_positive_int
from replayssm_jit.core.dtypes import MAX_HEADS
from replayssm_jit.core.tiles import (
    SHARED_BYTES_PER_SM,
    SHARED_BYTES_RESERVED_PER_CTA,
    SPLIT_RECORDS_FULL_SM_CTAS,
)
from replayssm_jit.families.schema import Input, cpp_params


@dataclass(frozen=True)
class HeadShape:
    """A layer's heads in family-neutral terms.

    key_heads: Mamba-2 groups G, GDN key heads H; value_heads: Mamba-2 heads H, GDN value
    heads HV; key_dim: Mamba-2 dstate N, GDN K; value_dim: Mamba-2 headdim P, GDN V.
    """

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def heads_per_key(self) -> int:
        return self.value_heads // self.key_heads


@dataclass(frozen=True)
class RingLayout:
    """One record ring: [slots, heads, CAP, width] (or [slots, heads, CAP] for a scalar).

    heads: "key" or "value"; width: "key_dim", "value_dim" or None; dtype: "act" (the
    activation dtype, records stored exactly as given) or "f32". read_copy_only: the ring
    exists only in separate mode (a layout with a read copy).
    """

    name: str
    heads: str
    width: str | None
    dtype: str
    read_copy_only: bool = False

    def per_slot_shape(self, shape: HeadShape, capacity: int) -> tuple[int, ...]:
        heads = shape.key_heads if self.heads == "key" else shape.value_heads
        width = () if self.width is None else (getattr(shape, self.width),)
        return (heads, capacity, *width)

    def torch_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return act_dtype if self.dtype == "act" else torch.float32


@dataclass(frozen=True)
class LaunchTraits:
    """The kernel variants a family's module compiles and the launch policy's thresholds for
    them (launch/policy.py reads these; they are measured choices, not facts of the model).

    records_warps: the warp counts the split step's records kernel is compiled for.
    capped_state_registers: the split state kernel has a variant capped at 96 registers.
    flush_every_step_kernel: the flush-every-step step is its own per-item instantiation.
    tile_targets: per step ("conventional", "split", "per-item", "flush-every-step") the CTAs
        per SM its row tile aims for, tried in order; "per-item read copy", where present, is
        separate mode's per-item step's (GDN: every CTA of its flush forms the held weights).
    verify_split_min_pairs_per_sm: from this many (batch row, head) pairs per SM the split
        verify beats the per-item one (docs/tuning-verify.md).
    """

    records_warps: tuple[int, ...]
    capped_state_registers: bool
    flush_every_step_kernel: bool
    tile_targets: Mapping[str, tuple[int, ...]] = field(hash=False, compare=False)
    verify_split_min_pairs_per_sm: float = 8.0


@dataclass(frozen=True)
class Family:
    """One kernel family. Subclasses add the family's records-kernel shared-memory bound.

    shape_args: the user-facing names of (key_heads, value_heads, key_dim, value_dim).
    spec_dims: the spec's (URI key, HeadShape field or "heads_per_key", user-facing name), in
        URI order.
    rings: the record rings in the order the module's replay_step binding takes them (a
        layout holds those it needs: RingLayout.read_copy_only).
    default_flags: the compile-time features a spec has by default (Family.flags: all it may name).
    launch: the kernel variants its module compiles and the launch policy's thresholds.
    decay_per_channel: the decay is a vector over key_dim (KDA), not a scalar per head.
    read_copy: the CUDA modules compile separate mode's read copy (Mamba-2 and GDN, per item
        and split; KDA's kernels do not yet, and check_cuda_spec refuses such a module). Every
        family's ops take a read copy on the torch path.
    nvfp4: the module compiles NVFP4 checkpoints (whole heads per CTA, for the head scale).
    verify_scaled_checkpoint: the CUDA verify kernels read (and an early flush writes) e4m3 and
        NVFP4 checkpoints, as the decode kernels do; verify_read_copy: separate mode's read copy
        too ("per-item": the per-item kernel only, so the launch policy never splits such a
        verify). Modules with drafts the kernels do not take are refused (check_cuda_spec).
    inputs: the token inputs of the family's ops, in the order its bindings take them
        (families/schema.py derives the checks, the bindings and the custom-op schemas).
    bound_scalars: the per-plan scalars (plan_scalars) the bindings take after the inputs.
    fold_inputs: the model parameters the materialize binding folds held records with besides
        the records (Mamba-2's A: its records hold dt, not the decay).
    """

    name: str
    template: str
    shape_args: tuple[str, str, str, str]
    spec_dims: tuple[tuple[str, str, str], ...]
    rings: tuple[RingLayout, ...]
    default_flags: tuple[str, ...]
    plan_options: Mapping[str, tuple[str, bool]] = field(hash=False, compare=False)
    launch: LaunchTraits
    decay_per_channel: bool = False
    read_copy: bool = False
    nvfp4: bool = False
    verify_scaled_checkpoint: bool = False
    verify_read_copy: bool | str = False
    inputs: tuple[Input, ...] = ()
    bound_scalars: tuple[str, ...] = ()
    fold_inputs: tuple[str, ...] = ()

    @property
    def flags(self) -> frozenset[str]:
        """The compile-time features a spec may name: those of the plan options."""
        return frozenset(flag for flag, _ in self.plan_options.values())

    # --- shapes -------------------------------------------------------------------------
    def head_shape(self, **kwargs: object) -> HeadShape:
        """A HeadShape from the family's own argument names, each checked."""
        names = dict(zip(("key_heads", "value_heads", "key_dim", "value_dim"), self.shape_args))
        missing = [arg for arg in self.shape_args if arg not in kwargs]
        unknown = sorted(set(kwargs) - set(self.shape_args))
        if missing or unknown:
            raise TypeError(
                f"{self.name} shape: expected arguments {list(self.shape_args)}, "
                f"got missing {missing} and unknown {unknown}"
            )
        values = {role: check_positive_int(arg, kwargs[arg]) for role, arg in names.items()}
        for role in ("key_heads", "value_heads"):
            check_at_most(names[role], values[role], MAX_HEADS, "the launch grid's x dimension")
        if values["value_heads"] % values["key_heads"]:
            raise ValueError(
                f"{names['key_heads']}: expected a divisor of "
                f"{names['value_heads']}={values['value_heads']}, got {values['key_heads']}"
            )
        return HeadShape(**values)

    def dims_of(self, shape: HeadShape) -> tuple[tuple[str, int], ...]:
        """The spec dims of `shape` (checked as head_shape checks the family's arguments), in
        URI order."""
        if not isinstance(shape, HeadShape):
            raise TypeError(f"shape: expected a HeadShape, got {type(shape).__name__}")
        roles = ("key_heads", "value_heads", "key_dim", "value_dim")
        shape = self.head_shape(
            **{arg: getattr(shape, r) for r, arg in zip(roles, self.shape_args)}
        )
        return tuple(
            (key, shape.heads_per_key if role == "heads_per_key" else getattr(shape, role))
            for key, role, _ in self.spec_dims
        )

    def dim_arg(self, key: str) -> str:
        """The user-facing name of spec dim `key`, for error messages."""
        return next(arg for k, _, arg in self.spec_dims if k == key)

    def role_key(self, role: str) -> str:
        """The spec dim key of a HeadShape field, e.g. "value_dim" -> "p" for Mamba-2."""
        return next(k for k, r, _ in self.spec_dims if r == role)

    # --- what a spec of this family compiles -------------------------------------------------
    def records_shared_bytes(self, spec) -> int:
        """Upper bound on the split step's records-kernel shared memory for `spec`."""
        raise NotImplementedError

    def verify_records_shared_bytes(self, spec) -> int | None:
        """Shared memory of the split verify step's records kernel for `spec`, or None where the
        family has no split verify step."""
        return None

    @staticmethod
    def held_rows_where_they_fit(base: int, held_rows: int, placeholder: int) -> int:
        """A records CTA's shared bytes: `base` plus its held record rows where a full SM of
        8-warp records CTAs still fits with them, else `placeholder` (one row stands in for the
        array and the rows are read through L2)."""
        per_cta = base + held_rows + SHARED_BYTES_RESERVED_PER_CTA
        fits = SHARED_BYTES_PER_SM // per_cta >= SPLIT_RECORDS_FULL_SM_CTAS
        return base + (held_rows if fits else placeholder)

    def template_context(self) -> dict:
        """What the family's module template needs beyond the spec itself."""
        return {
            "records_warps": list(self.launch.records_warps),
            "capped_state_registers": self.launch.capped_state_registers,
            "flush_every_step_kernel": self.launch.flush_every_step_kernel,
            "decay_per_channel": self.decay_per_channel,
            # params(binding, indent): a binding's C++ parameters, rendered from the schema.
            "params": functools.partial(cpp_params, self),
        }

    # --- planning -------------------------------------------------------------------------
    def plan_flags(
        self, options: Mapping[str, object], shape: HeadShape
    ) -> tuple[tuple[str, ...], dict]:
        """Spec flags (from the bool `plan_options`, each checked) and per-plan scalars (from
        `plan_scalars`) of plan()'s keyword options."""
        scalars = self.plan_scalars(options, shape)
        unknown = sorted(set(options) - set(self.plan_options) - set(scalars))
        if unknown:
            raise TypeError(
                f"plan(): expected options among {sorted([*self.plan_options, *scalars])} for "
                f"{self.name}, got unexpected {unknown}"
            )
        flags = tuple(
            flag
            for option, (flag, default) in self.plan_options.items()
            if check_bool(option, options.get(option, default))
        )
        return flags, scalars

    def plan_scalars(self, options: Mapping[str, object], shape: HeadShape) -> dict:
        """The family's non-flag plan() options, checked, with their defaults applied."""
        return {}
