"""DecodePlan: everything plan() decides once per batch shape, for the functional ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replayssm_jit.core.checks import (
    check_at_most,
    check_bool,
    check_int,
    check_positive_int,
    resolve_device,
)
from replayssm_jit.families.layout import CacheLayout
from replayssm_jit.families.spec import KernelSpec, check_cuda_spec, make_spec
from replayssm_jit.launch.config import resolve_config
from replayssm_jit.launch.policy import FLAG_SPLIT, plan_launch
from replayssm_jit.launch.tuning import tuned_config

MODES = ("replay", "conventional")
# A launch's grid carries the batch rows in its y dimension (templates/common/replay.cuh,
# launch_per_item; split.cuh), which CUDA caps at 65535.
MAX_BATCH = 65535
# Slot ids and the pad id are int32 on the device (the bindings narrow pad_slot_id to it).
INT32_RANGE = (-(2**31), 2**31 - 1)
BACKENDS = ("cuda", "cpu")


@dataclass(frozen=True)
class DecodePlan:
    """A planned decode step of one layer layout at one batch size.

    backend: "cuda" (the JIT/AOT kernels) or "cpu" (the PyTorch path with the same cursor, ring
    and flush semantics). kernel: "conventional", "split", "per-item" or "flush-every-step".
    workspace_floats: float32 elements of scratch a step or verify needs (the split kernels'
    hand-over between their two launches; 0 otherwise). verify_kernel: "split" or "per-item"
    for the verify step ("" on the CPU or without drafts). verify_rows_per_cta: the row tile of
    the speculative kernels (verify and snapshot steps; 0 on the CPU or without them).
    flag_bits, verify_flag_bits: the flags words the module's step and verify bindings take
    (launch/policy.py FLAG_*; 0 on the CPU).
    family_options: the family's plan() scalars (GDN: scale; KDA: scale, lower_bound).
    """

    layout: CacheLayout
    spec: KernelSpec
    mode: str
    batch_size: int
    device: torch.device
    backend: str
    kernel: str
    rows_per_cta: int
    flag_bits: int
    workspace_floats: int
    pad_slot_id: int
    seed: int
    check_slot_values: bool
    verify_rows_per_cta: int = 0
    verify_kernel: str = ""
    verify_flag_bits: int = 0
    family_options: dict = field(default_factory=dict, compare=False)
    module: object = field(default=None, compare=False, repr=False)

    @property
    def family(self):
        return self.layout.family

    @property
    def replay(self) -> bool:
        return self.mode == "replay"

    def reads_workspace(self, verify: bool = False) -> bool:
        """Whether this plan's standard step (or, `verify`, its verify step) reads the
        workspace: only the split kernels do, and they need workspace_floats elements."""
        if verify:
            return self.verify_kernel == "split"
        return bool(self.flag_bits & FLAG_SPLIT)


def check_pad_slot_id(pad_slot_id: object) -> int:
    """An int32 pad id (the kernels compare int32 slot ids with it)."""
    check_int("pad_slot_id", pad_slot_id)
    lo, hi = INT32_RANGE
    if not lo <= pad_slot_id <= hi:
        raise ValueError(f"pad_slot_id: expected an int32 in [{lo}, {hi}], got {pad_slot_id}")
    return pad_slot_id


def plan_decode(
    layout: CacheLayout,
    batch_size: int,
    *,
    device: torch.device | str,
    mode: str = "replay",
    pad_slot_id: int = -1,
    check_slot_values: bool = True,
    config=None,
    seed: int = 0,
    tuning=None,
    **options,
) -> DecodePlan:
    """Plan a decode step of `batch_size` rows over tensors laid out as `layout` on `device`.

    mode: "replay" (ReplaySSM) or "conventional". config: a LaunchConfig ("auto" fields are
    the launch policy's). seed: the stochastic-rounding seed (a run may pass a device tensor
    instead). options: the family's plan() flags (Mamba-2: has_D, has_z, has_dt_bias,
    dt_softplus, stochastic_rounding; GDN: use_qk_l2norm, gates_in_kernel, scale,
    stochastic_rounding). tuning: a file of `python -m replayssm_jit autotune` (default:
    the REPLAYSSM_TUNING environment variable; none: the built-in policy), whose choice for this
    device, spec, mode and batch fills the fields `config` leaves "auto". check_slot_values:
    eager steps read slot ids and cursors on the host and refuse bad ones (corrupted cursors,
    pending drafts a plain step would drop, records a conventional plan would ignore); False
    reads none (as inside a CUDA graph; the CPU path still range-checks slot ids), and a bad
    row gets the kernels' containment instead: NaN outputs, nothing written. On a CUDA device
    the module is loaded (AOT, else JIT); on the CPU nothing is compiled.
    """
    if not isinstance(layout, CacheLayout):
        raise TypeError(f"layout: expected a CacheLayout, got {type(layout).__name__}")
    check_positive_int("batch_size", batch_size)
    check_at_most("batch_size", batch_size, MAX_BATCH, "the launch grid's y dimension")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    check_pad_slot_id(pad_slot_id)
    check_bool("check_slot_values", check_slot_values)
    check_int("seed", seed)
    device = resolve_device(device)
    fam = layout.family
    flags, extras = fam.plan_flags(options, layout.shape)
    replay = mode == "replay"
    if layout.read_dtype is not None and not replay:
        raise ValueError(
            "mode: expected 'replay' for a layout with a read copy (separate mode: a "
            "conventional step would leave the read copy stale), got 'conventional'"
        )
    spec = make_spec(
        fam.name, layout.shape, window=layout.window if replay else 1, drafts=layout.drafts,
        act_dtype=layout.act_dtype, state_dtype=layout.state_dtype, flags=flags,
        read_dtype=layout.read_dtype,
    )  # fmt: skip
    if device.type == "cuda":  # (before the launch policy, whose choices would not matter)
        check_cuda_spec(spec)
    config = tuned_config(resolve_config(config), tuning, spec, mode, batch_size, device)
    if replay and spec.has_verify:  # (the verify kernel and tile, timed apart)
        config = tuned_config(config, tuning, spec, "verify", batch_size, device)
    heads = layout.shape.value_heads
    launch = plan_launch(spec, batch_size, heads, device, replay=replay, config=config)
    module, floats = None, 0
    if device.type == "cuda":
        from replayssm_jit.jit.build import load_module

        module = load_module(spec)
        if launch.flag_bits & FLAG_SPLIT:
            floats = int(module.split_workspace_floats(batch_size, heads))
        if launch.verify_kernel == "split":
            floats = max(floats, int(module.verify_workspace_floats(batch_size, heads)))
    choice = dict(kernel=launch.kernel, rows_per_cta=launch.rows_per_cta, flag_bits=launch.flag_bits,
                  workspace_floats=floats, verify_rows_per_cta=launch.verify_rows_per_cta,
                  verify_kernel=launch.verify_kernel, verify_flag_bits=launch.verify_flag_bits)  # fmt: skip
    return DecodePlan(
        layout, spec, mode, batch_size, device, device.type, **choice, pad_slot_id=pad_slot_id,
        seed=seed & (2**63 - 1), check_slot_values=check_slot_values, family_options=extras,
        module=module,
    )  # fmt: skip
