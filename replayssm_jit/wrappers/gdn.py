"""Gated DeltaNet (GDN) decode cache and plan/run wrapper (ReplaySSM or conventional)."""

from __future__ import annotations

import math

import torch

from replayssm_jit.ops import gdn as ops
from replayssm_jit.spec import KernelSpec, dtype_name, gdn_spec
from replayssm_jit.wrappers.base import DecodeWrapper
from replayssm_jit.wrappers.cache import SlotCache


class GDNDecodeCache(SlotCache):
    """Per-slot GDN checkpoint and record rings (CAP = window + drafts rows).

    H key heads, HV value heads (HV % H == 0), K head_k_dim, V head_v_dim:

    state   [num_slots, HV, V, K]   state_dtype (fp32/bf16/fp16), K contiguous
    u ring  [num_slots, HV, CAP, V] float32 (u = beta (v - alpha S k) is computed, so kept in FP32)
    k ring  [num_slots, H, CAP, K]  act_dtype (k as given; normalised again on replay)
    g ring  [num_slots, HV, CAP]    float32 (log-decay g = log alpha)
    cursors [num_slots, 4]          int32: records held, flush epoch, CTA arrivals, spare
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
        state_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        pad_slot_id: int = -1,
    ) -> None:
        for name, value in (
            ("num_k_heads", num_k_heads),
            ("num_v_heads", num_v_heads),
            ("head_k_dim", head_k_dim),
            ("head_v_dim", head_v_dim),
            ("window", window),
            ("drafts", drafts),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"num_k_heads: expected a divisor of num_v_heads={num_v_heads}, got {num_k_heads}"
            )
        dtype_name(state_dtype, "state_dtype")
        dtype_name(act_dtype, "act_dtype")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.window, self.drafts, self.act_dtype = window, drafts, act_dtype
        cap = window + drafts
        super().__init__(
            num_slots,
            (num_v_heads, head_v_dim, head_k_dim),
            state_dtype,
            {
                "u": ((num_v_heads, cap, head_v_dim), torch.float32),
                "k": ((num_k_heads, cap, head_k_dim), act_dtype),
                "g": ((num_v_heads, cap), torch.float32),
            },
            device=device,
            pad_slot_id=pad_slot_id,
        )


class GDNDecodeWrapper(DecodeWrapper):
    __doc__ = DecodeWrapper.__doc__

    cache: GDNDecodeCache

    def __init__(
        self, cache: GDNDecodeCache, *, mode: str = "replay", use_cuda_graph: bool = False
    ) -> None:
        super().__init__(cache, mode=mode, use_cuda_graph=use_cuda_graph)
        self.scale = 0.0

    def plan(
        self,
        batch_size: int,
        *,
        use_qk_l2norm: bool = True,
        gates_in_kernel: bool = True,
        scale: float | None = None,
        stochastic_rounding: bool = False,
        seed: int = 0,
    ) -> KernelSpec:
        """Choose and load the kernel for `batch_size` rows; returns its spec.

        use_qk_l2norm: the kernel L2-normalises q and k (x * rsqrt(sum(x^2) + 1e-6)).
        gates_in_kernel: run() takes raw a, b [batch, HV] plus A_log, dt_bias [HV] and the
            kernel forms g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); otherwise
            run() takes g (log-decay) and beta [batch, HV] and no A_log / dt_bias.
        scale: multiplies q (after normalisation); default head_k_dim ** -0.5.
        stochastic_rounding: round bf16/fp16 checkpoints stochastically at flush; the noise is
            a hash of (seed, slot, element, flush count), so the same seed gives the same bits.
        """
        self._check_batch_size(batch_size)
        c = self.cache
        if scale is None:
            scale = c.head_k_dim**-0.5
        if (
            not isinstance(scale, (int, float))
            or isinstance(scale, bool)
            or not math.isfinite(scale)
        ):
            raise ValueError(f"scale: expected a finite float, got {scale!r}")
        flags = {
            "qk_l2norm": use_qk_l2norm,
            "gates_in_kernel": gates_in_kernel,
            "sr": stochastic_rounding,
        }
        spec = gdn_spec(
            head_k_dim=c.head_k_dim,
            head_v_dim=c.head_v_dim,
            value_heads_per_key_head=c.num_v_heads // c.num_k_heads,
            window=self.window,
            drafts=c.drafts,
            act_dtype=c.act_dtype,
            state_dtype=c.state.dtype,
            flags=tuple(name for name, on in flags.items() if on),
        )
        self._plan(spec, batch_size, seed)
        self.scale = float(scale)
        return spec

    def _out_row_shape(self) -> tuple[int, ...]:
        return (self.cache.num_v_heads, self.cache.head_v_dim)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gate_a: torch.Tensor,
        gate_b: torch.Tensor,
        slot_indices: torch.Tensor,
        *,
        A_log: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step; returns out [batch, HV, V] (act dtype).

        q, k [batch, H, K] and v [batch, HV, V] act dtype, unit stride in the last dim;
        gate_a, gate_b [batch, HV] float32 (any strides, e.g. views of one [batch, 2 * HV]
        projection): raw a, b when planned with
        gates_in_kernel=True (then A_log, dt_bias [HV] float32 are required), else g (log-decay)
        and beta (then A_log, dt_bias must be None); slot_indices [batch] int32 (pad_slot_id
        rows: zero output, nothing written); out [batch, HV, V] act dtype, contiguous, or None.
        Everything is validated before the launch; on error nothing is touched.
        """
        out = self._begin_run(q, slot_indices, out)
        c, spec = self.cache, self.spec
        ops.validate_step(
            spec, ops.dims_of(spec, c.num_v_heads),
            state=c.state, q=q, k=k, v=v, gate_a=gate_a, gate_b=gate_b,
            A_log=A_log, dt_bias=dt_bias, out=out,
        )  # fmt: skip
        self._launch((q, k, v, gate_a, gate_b, A_log, dt_bias, self.scale), out, slot_indices)
        return out
