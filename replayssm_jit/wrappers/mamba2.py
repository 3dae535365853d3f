"""Mamba-2 decode cache and plan()/run() wrapper (ReplaySSM or conventional)."""

from __future__ import annotations

import torch

from replayssm_jit.families import MAMBA2
from replayssm_jit.families.layout import mamba2_layout
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.ops.mamba2 import mamba2_decode
from replayssm_jit.spec import KernelSpec
from replayssm_jit.wrappers.base import DecodeWrapper
from replayssm_jit.wrappers.cache import SlotCache


class Mamba2DecodeCache(SlotCache):
    """Per-slot Mamba-2 checkpoints and record rings (mamba2_layout; CAP = window + drafts):

    state  [num_slots, H, P, N] state_dtype (fp32/bf16/fp16); rec_x [num_slots, H, CAP, P] and
    rec_b [num_slots, G, CAP, N] act_dtype; rec_dt [num_slots, H, CAP] float32; cursors
    [num_slots, 4] int32. device: default CUDA where available, else the CPU.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        num_heads: int,
        headdim: int,
        dstate: int,
        ngroups: int,
        window: int = 16,
        drafts: int = 1,
        state_dtype: torch.dtype | str = torch.float32,
        act_dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        pad_slot_id: int = -1,
    ) -> None:
        layout = mamba2_layout(
            num_heads=num_heads, headdim=headdim, dstate=dstate, ngroups=ngroups, window=window,
            drafts=drafts, state_dtype=state_dtype, act_dtype=act_dtype,
        )  # fmt: skip
        super().__init__(layout, num_slots, device=device, pad_slot_id=pad_slot_id)


class Mamba2DecodeWrapper(DecodeWrapper):
    __doc__ = DecodeWrapper.__doc__
    family = MAMBA2

    def plan(
        self,
        batch_size: int,
        *,
        has_D: bool = True,
        has_z: bool = False,
        has_dt_bias: bool = True,
        dt_softplus: bool = True,
        stochastic_rounding: bool = False,
        seed: int = 0,
        config: LaunchConfig | None = None,
    ) -> KernelSpec:
        """Choose and load the kernel for `batch_size` rows; returns its spec.

        stochastic_rounding: round bf16/fp16 checkpoints stochastically at a flush; the noise
        is a hash of (seed, slot, element, flush epoch), so the same seed gives the same bits.
        config: launch choices to fix (LaunchConfig; "auto" fields are the policy's).
        """
        return self._plan_step(
            batch_size, config=config, seed=seed, has_D=has_D, has_z=has_z,
            has_dt_bias=has_dt_bias, dt_softplus=dt_softplus,
            stochastic_rounding=stochastic_rounding,
        )  # fmt: skip

    def run(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        slot_indices: torch.Tensor,
        *,
        D: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        seed: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step; returns out [batch, H, P] (shapes: replayssm_jit.ops.mamba2).

        seed: overrides the plan's stochastic-rounding seed (an int64 device tensor of one
        element is read on the device). Everything is checked before the launch; on error
        nothing is touched.
        """
        return self._run(
            mamba2_decode, out, seed, x=x, dt=dt, A=A, B=B, C=C, slot_indices=slot_indices,
            D=D, z=z, dt_bias=dt_bias,
        )  # fmt: skip
