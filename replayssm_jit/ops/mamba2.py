"""Mamba-2 decode ops: argument validation (launch choice: ops/tiling.py).

Shapes (tied head dim; G groups, H heads, P headdim, N dstate, CAP = L + T ring rows):
    state       [slots, H, P, N]   checkpoint dtype, (P, N) contiguous per head
    x, z        [batch, H, P]      activation dtype, unit stride in P
    dt          [batch, H]         float32 (raw; bias and softplus applied in the kernel)
    A, D, dt_bias [H]              float32
    B, C        [batch, G, N]      activation dtype, unit stride in N
    out         [batch, H, P]      activation dtype, contiguous
    slot_indices [batch]           int32; pad_slot_id rows get out = 0 and write nothing
Records (ReplaySSM):
    rec_x  [slots, H, CAP, P] act, rec_b [slots, G, CAP, N] act, rec_dt [slots, H, CAP] f32
    cursors [slots, 4] int32: records held, flush epoch, CTA arrivals (scratch), spare
Split kernel workspace (float32; spec.split_workspace_floats, templates/common/split.cuh): per (batch row, head)
    extra [P], total [1], coef [CAP]; per batch row info [4] int32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm_jit.checks import (
    check_aligned_rows,
    check_cuda,
    check_planned,
    check_slot_pool,
    check_tensor,
)
from replayssm_jit.ops import tiling
from replayssm_jit.spec import TORCH_DTYPES, KernelSpec

ROWS_ENV = tiling.rows_env("mamba2")


@dataclass(frozen=True)
class Mamba2Dims:
    num_heads: int
    ngroups: int
    headdim: int
    dstate: int


def dims_of(spec: KernelSpec, num_heads: int) -> Mamba2Dims:
    return Mamba2Dims(num_heads, num_heads // spec.dim("hpg"), spec.dim("p"), spec.dim("n"))


def validate_step(
    spec: KernelSpec,
    dims: Mamba2Dims,
    *,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    out: torch.Tensor,
) -> int:
    """Check every tensor against `spec`; return the batch size. Raises before any launch."""
    H, G, P, N = dims.num_heads, dims.ngroups, dims.headdim, dims.dstate
    act = TORCH_DTYPES[spec.act_dtype]
    check_tensor("state", state, shape=(None, H, P, N), dtype=TORCH_DTYPES[spec.state_dtype])
    device = state.device
    check_slot_pool("state", state, "[H, P, N]")
    check_tensor("x", x, shape=(None, H, P), dtype=act, device=device, inner_contiguous=True)
    batch = x.shape[0]
    check_tensor("dt", dt, shape=(batch, H), dtype=torch.float32, device=device)
    check_tensor("A", A, shape=(H,), dtype=torch.float32, device=device, contiguous=True)
    check_tensor("B", B, shape=(batch, G, N), dtype=act, device=device, inner_contiguous=True)
    check_tensor("C", C, shape=(batch, G, N), dtype=act, device=device, inner_contiguous=True)
    check_tensor("out", out, shape=(batch, H, P), dtype=act, device=device, contiguous=True)
    for name, t, flag, plan_arg in (
        ("D", D, "d", "has_D"),
        ("dt_bias", dt_bias, "dt_bias", "has_dt_bias"),
        ("z", z, "z", "has_z"),
    ):
        planned = flag in spec.flags
        check_planned(name, t, planned, f"{plan_arg}={planned}")
    if D is not None:
        check_tensor("D", D, shape=(H,), dtype=torch.float32, device=device, contiguous=True)
    if dt_bias is not None:
        check_tensor(
            "dt_bias", dt_bias, shape=(H,), dtype=torch.float32, device=device, contiguous=True
        )
    if z is not None:
        check_tensor("z", z, shape=(batch, H, P), dtype=act, device=device, inner_contiguous=True)
    for name, t in (("x", x), ("B", B), ("C", C), ("z", z)):
        check_aligned_rows(name, t)
    check_cuda("state", device)
    return batch
