"""Mamba-2 decode cache and plan()/run() wrapper (ReplaySSM or conventional)."""

from __future__ import annotations

import torch

from replayssm_jit.families import MAMBA2
from replayssm_jit.families.layout import mamba2_layout
from replayssm_jit.ops.mamba2 import mamba2_decode
from replayssm_jit.ops.verify import mamba2_verify
from replayssm_jit.wrappers.base import DecodeWrapper
from replayssm_jit.wrappers.cache import FamilyCache


class Mamba2DecodeCache(FamilyCache):
    """Per-slot Mamba-2 checkpoints and record rings: Mamba2DecodeCache(num_slots, num_heads=,
    headdim=, dstate=, ngroups=, window=16, drafts=1, state_dtype=float32, act_dtype=bfloat16,
    device=None (CUDA where available, else the CPU), pad_slot_id=-1). The tensors are those of
    mamba2_layout: state, rec_x, rec_b, rec_dt and cursors, [num_slots, ...] each.
    """

    make_layout = staticmethod(mamba2_layout)


class Mamba2DecodeWrapper(DecodeWrapper):
    __doc__ = DecodeWrapper.__doc__
    family = MAMBA2

    def run(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            C: torch.Tensor, slot_indices: torch.Tensor, **optional) -> torch.Tensor:  # fmt: skip
        """One decode step; returns out [batch, H, P]. optional: D, z, dt_bias (as planned),
        out, seed (an int, or an int64 device tensor read on the device); shapes as in
        replayssm_jit.ops.mamba2. Everything is checked first; on error nothing is touched."""
        return self._run(mamba2_decode, x=x, dt=dt, A=A, B=B, C=C, slot_indices=slot_indices,
                         **optional)  # fmt: skip

    def verify(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        slot_indices: torch.Tensor,
        **optional,
    ) -> torch.Tensor:
        """Verify T draft tokens per row; returns out [batch, T, H, P]. Inputs as run()'s with a
        draft dim after the batch (x, z [batch, T, H, P], dt [batch, T, H], B, C [batch, T, G,
        N]); optional as run()'s plus num_drafts, parents, num_accepted (replayssm_jit.ops.verify).
        Everything is checked first; on error nothing is touched."""
        return self._verify(mamba2_verify, x=x, dt=dt, A=A, B=B, C=C, slot_indices=slot_indices,
                            **optional)  # fmt: skip
