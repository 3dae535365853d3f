"""Gated DeltaNet (GDN) decode cache and plan()/run() wrapper (ReplaySSM or conventional)."""

from __future__ import annotations

import torch

from replayssm_jit.families import GDN
from replayssm_jit.families.layout import gdn_layout
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.ops.gdn import gdn_decode
from replayssm_jit.spec import KernelSpec
from replayssm_jit.wrappers.base import DecodeWrapper
from replayssm_jit.wrappers.cache import SlotCache


class GDNDecodeCache(SlotCache):
    """Per-slot GDN checkpoints and record rings (gdn_layout; CAP = window + drafts):

    state [num_slots, HV, V, K] state_dtype (fp32/bf16/fp16); rec_u [num_slots, HV, CAP, V]
    float32; rec_k [num_slots, H, CAP, K] act_dtype; rec_g [num_slots, HV, CAP] float32;
    cursors [num_slots, 4] int32. device: default CUDA where available, else the CPU.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        window: int = 16,
        drafts: int = 1,
        state_dtype: torch.dtype | str = torch.float32,
        act_dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        pad_slot_id: int = -1,
    ) -> None:
        layout = gdn_layout(
            num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
            head_v_dim=head_v_dim, window=window, drafts=drafts, state_dtype=state_dtype,
            act_dtype=act_dtype,
        )  # fmt: skip
        super().__init__(layout, num_slots, device=device, pad_slot_id=pad_slot_id)


class GDNDecodeWrapper(DecodeWrapper):
    __doc__ = DecodeWrapper.__doc__
    family = GDN

    def plan(
        self,
        batch_size: int,
        *,
        use_qk_l2norm: bool = True,
        gates_in_kernel: bool = True,
        scale: float | None = None,
        stochastic_rounding: bool = False,
        seed: int = 0,
        config: LaunchConfig | None = None,
    ) -> KernelSpec:
        """Choose and load the kernel for `batch_size` rows; returns its spec.

        use_qk_l2norm: the kernel L2-normalises q and k (x * rsqrt(sum(x^2) + 1e-6)).
        gates_in_kernel: run() takes raw a, b [batch, HV] plus A_log, dt_bias [HV] and the
            kernel forms g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); otherwise
            run() takes g (log-decay) and beta.
        scale: multiplies q (after normalisation); default head_k_dim ** -0.5.
        stochastic_rounding, seed, config: as for Mamba2DecodeWrapper.plan.
        """
        return self._plan_step(
            batch_size, config=config, seed=seed, use_qk_l2norm=use_qk_l2norm,
            gates_in_kernel=gates_in_kernel, scale=scale, stochastic_rounding=stochastic_rounding,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_indices: torch.Tensor,
        *,
        a: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
        A_log: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        g: torch.Tensor | None = None,
        beta: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        seed: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step; returns out [batch, HV, V] (shapes: replayssm_jit.ops.gdn).

        Gates: a, b with A_log, dt_bias (planned gates_in_kernel=True), else g, beta. seed as
        for Mamba2DecodeWrapper.run. Everything is checked before the launch; on error nothing
        is touched.
        """
        return self._run(
            gdn_decode, out, seed, q=q, k=k, v=v, slot_indices=slot_indices, a=a, b=b,
            A_log=A_log, dt_bias=dt_bias, g=g, beta=beta,
        )  # fmt: skip
