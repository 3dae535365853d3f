"""Kimi Delta Attention (KDA) decode cache and plan()/run() wrapper (ReplaySSM or conventional)."""

from __future__ import annotations

import torch

from replayssm_jit.families import KDA
from replayssm_jit.families.layout import kda_layout
from replayssm_jit.ops.kda import kda_decode
from replayssm_jit.ops.verify import kda_verify
from replayssm_jit.wrappers.base import DecodeWrapper
from replayssm_jit.wrappers.cache import FamilyCache


class KDADecodeCache(FamilyCache):
    """Per-slot KDA checkpoints and record rings: KDADecodeCache(num_slots, num_k_heads=,
    num_v_heads=, head_k_dim=, head_v_dim=, window=16, drafts=1, state_dtype=float32,
    act_dtype=bfloat16, device=None (CUDA where available, else the CPU), pad_slot_id=-1). The
    tensors are those of kda_layout: state, rec_u, rec_k, rec_g (per key channel) and cursors.
    """

    make_layout = staticmethod(kda_layout)


class KDADecodeWrapper(DecodeWrapper):
    __doc__ = DecodeWrapper.__doc__
    family = KDA

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_indices: torch.Tensor,
            **gates_and_options) -> torch.Tensor:  # fmt: skip
        """One decode step; returns out [batch, HV, V]. Gates: a [batch, HV, K], b with A_log,
        dt_bias [HV * K] (planned gates_in_kernel=True, optionally with lower_bound) or g
        [batch, HV, K], beta; options: out, seed; shapes as in replayssm_jit.ops.kda.
        Everything is checked first; on error nothing is touched."""
        return self._run(kda_decode, q=q, k=k, v=v, slot_indices=slot_indices,
                         **gates_and_options)  # fmt: skip

    def verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_indices: torch.Tensor,
               **gates_and_options) -> torch.Tensor:  # fmt: skip
        """Verify T draft tokens per row; returns out [batch, T, HV, V]. Inputs as run()'s with a
        draft dim after the batch (q, k [batch, T, H, K], v [batch, T, HV, V], a or g [batch, T,
        HV, K], b or beta [batch, T, HV]); options as run()'s plus num_drafts, parents,
        num_accepted (replayssm_jit.ops.verify). Everything is checked first; on error nothing
        is touched."""
        return self._verify(kda_verify, q=q, k=k, v=v, slot_indices=slot_indices,
                            **gates_and_options)  # fmt: skip
