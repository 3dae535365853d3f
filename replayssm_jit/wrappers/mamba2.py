"""Mamba-2 decode cache and plan/run wrapper (ReplaySSM or conventional)."""

from __future__ import annotations

import torch

from replayssm_jit.ops import mamba2 as ops
from replayssm_jit.spec import KernelSpec, dtype_name, mamba2_spec
from replayssm_jit.wrappers.base import DecodeWrapper
from replayssm_jit.wrappers.cache import SlotCache


class Mamba2DecodeCache(SlotCache):
    """Per-slot Mamba-2 checkpoint and record rings (CAP = window + drafts rows).

    state   [num_slots, H, P, N]   state_dtype (fp32/bf16/fp16)
    x ring  [num_slots, H, CAP, P] act_dtype (inputs are stored exactly)
    B ring  [num_slots, G, CAP, N] act_dtype
    dt ring [num_slots, H, CAP]    float32 (dt after bias and softplus)
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
        state_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        pad_slot_id: int = -1,
    ) -> None:
        for name, value in (
            ("num_heads", num_heads),
            ("headdim", headdim),
            ("dstate", dstate),
            ("ngroups", ngroups),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_heads % ngroups:
            raise ValueError(f"ngroups: expected a divisor of num_heads={num_heads}, got {ngroups}")
        dtype_name(state_dtype, "state_dtype")
        dtype_name(act_dtype, "act_dtype")
        self.num_heads, self.headdim, self.dstate, self.ngroups = (
            num_heads,
            headdim,
            dstate,
            ngroups,
        )
        self.window, self.drafts, self.act_dtype = window, drafts, act_dtype
        cap = window + drafts
        super().__init__(
            num_slots,
            (num_heads, headdim, dstate),
            state_dtype,
            {
                "x": ((num_heads, cap, headdim), act_dtype),
                "B": ((ngroups, cap, dstate), act_dtype),
                "dt": ((num_heads, cap), torch.float32),
            },
            device=device,
            pad_slot_id=pad_slot_id,
        )


class Mamba2DecodeWrapper(DecodeWrapper):
    __doc__ = DecodeWrapper.__doc__

    cache: Mamba2DecodeCache

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
    ) -> KernelSpec:
        """Choose and load the kernel for `batch_size` rows; returns its spec.

        stochastic_rounding: round bf16/fp16 checkpoints stochastically at flush; the noise is
        a hash of (seed, slot, element, flush count), so the same seed gives the same bits.
        """
        self._check_batch_size(batch_size)
        c = self.cache
        flags = {
            "d": has_D,
            "z": has_z,
            "dt_bias": has_dt_bias,
            "dt_softplus": dt_softplus,
            "sr": stochastic_rounding,
        }
        spec = mamba2_spec(
            headdim=c.headdim,
            dstate=c.dstate,
            heads_per_group=c.num_heads // c.ngroups,
            window=self.window,
            drafts=c.drafts,
            act_dtype=c.act_dtype,
            state_dtype=c.state.dtype,
            flags=tuple(name for name, on in flags.items() if on),
        )
        self._plan(spec, batch_size, seed)
        return spec

    def _out_row_shape(self) -> tuple[int, ...]:
        return (self.cache.num_heads, self.cache.headdim)

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
    ) -> torch.Tensor:
        """One decode step; returns out [batch, H, P].

        x, z [batch, H, P] act dtype; dt [batch, H] float32 (raw); A, D, dt_bias [H] float32;
        B, C [batch, G, N] act dtype; slot_indices [batch] int32 (pad_slot_id rows: zero output,
        nothing written). Everything is validated before the launch; on error nothing is touched.
        """
        out = self._begin_run(x, slot_indices, out)
        c, spec = self.cache, self.spec
        ops.validate_step(
            spec, ops.dims_of(spec, c.num_heads),
            state=c.state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, out=out,
        )  # fmt: skip
        self._launch((x, z, dt, A, D, dt_bias, B, C), out, slot_indices)
        return out
