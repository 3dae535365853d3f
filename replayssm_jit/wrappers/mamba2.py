"""Mamba-2 decode cache and plan/run wrapper (ReplaySSM or conventional)."""

from __future__ import annotations

import torch

from replayssm_jit.checks import check_slot_indices
from replayssm_jit.ops import mamba2 as ops
from replayssm_jit.spec import KernelSpec, dtype_name, mamba2_spec
from replayssm_jit.wrappers.cache import SlotCache


class Mamba2DecodeCache(SlotCache):
    """Per-slot Mamba-2 checkpoint and record rings.

    state  [num_slots, H, P, N]   state_dtype (fp32/bf16/fp16)
    x ring [num_slots, H, L+T, P] act_dtype
    B ring [num_slots, G, L+T, N] act_dtype
    dt ring [num_slots, H, L+T]   float32 (dt after bias and softplus)
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
        self.window, self.drafts = window, drafts
        self.act_dtype = act_dtype
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


class Mamba2DecodeWrapper:
    """plan() once per batch shape, run() once per decode step.

    mode="replay": ReplaySSM (non-flush steps read the checkpoint and append a record; every
    L-th step of a slot flushes). mode="conventional": read, update and write the state.
    With use_cuda_graph=True, run() writes into a fixed output buffer and skips the
    host-side slot-value check (it would sync), so the step can be captured.
    """

    def __init__(
        self, cache: Mamba2DecodeCache, *, mode: str = "replay", use_cuda_graph: bool = False
    ) -> None:
        if mode not in ("replay", "conventional"):
            raise ValueError(f"mode: expected 'replay' or 'conventional', got {mode!r}")
        self.cache, self.mode, self.use_cuda_graph = cache, mode, use_cuda_graph
        self._planned: tuple[KernelSpec, int, int] | None = None
        self._out: torch.Tensor | None = None
        self.seed = 0

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
        """Choose and load the kernel for `batch_size` rows; returns its spec."""
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
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
            window=c.window if self.mode == "replay" else 1,
            drafts=c.drafts,
            act_dtype=c.act_dtype,
            state_dtype=c.state.dtype,
            flags=tuple(name for name, on in flags.items() if on),
        )
        self._module = ops.module_for(spec)
        rows = ops.choose_rows_per_cta(spec, batch_size, c.num_heads, c.device)
        self._planned = (spec, batch_size, rows)
        self.seed = int(seed) & (2**63 - 1)
        if self.use_cuda_graph:
            self._out = torch.empty(
                (batch_size, c.num_heads, c.headdim), dtype=c.act_dtype, device=c.device
            )
        return spec

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
        """One decode step. Shapes: see replayssm_jit.ops.mamba2. Returns out [batch, H, P]."""
        if self._planned is None:
            raise RuntimeError("run() called before plan()")
        spec, batch, rows = self._planned
        c = self.cache
        if x.dim() != 3 or x.shape[0] != batch:
            raise ValueError(
                f"x: expected batch size {batch} from plan(), got shape {list(x.shape)}"
            )
        if out is None:
            out = (
                self._out
                if self._out is not None
                else torch.empty_like(x, memory_format=torch.contiguous_format)
            )
        dims = ops.dims_of(spec, c.num_heads)
        ops.validate_step(
            spec, dims, state=c.state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, out=out
        )
        if self.use_cuda_graph:
            # Shape and dtype only: reading values would sync and break capture.
            if slot_indices.dtype != torch.int32 or tuple(slot_indices.shape) != (batch,):
                check_slot_indices(slot_indices, batch, c.num_slots, c.pad_slot_id, c.device)
        else:
            check_slot_indices(slot_indices, batch, c.num_slots, c.pad_slot_id, c.device)
        common = dict(
            state=c.state,
            x=x,
            dt=dt,
            A=A,
            B=B,
            C=C,
            D=D,
            z=z,
            dt_bias=dt_bias,
            out=out,
            slot_indices=slot_indices,
            pad_slot_id=c.pad_slot_id,
            seed=self.seed,
            rows=rows,
        )
        if self.mode == "replay":
            ops.launch_replay(
                self._module,
                rec_x=c.rings["x"],
                rec_b=c.rings["B"],
                rec_dt=c.rings["dt"],
                cursors=c.cursors,
                **common,
            )
        else:
            ops.launch_conventional(self._module, **common)
        return out
