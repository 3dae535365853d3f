"""Gated DeltaNet (GDN) decode ops: argument validation (launch choice: ops/tiling.py).

Shapes (H key heads, HV value heads, HV % H == 0 and value head hv reads key head
hv // (HV // H); K head_k_dim, V head_v_dim; CAP = L + T ring rows):
    state        [slots, HV, V, K]  checkpoint dtype; each slot's [HV, V, K] block contiguous,
                                    16-byte aligned slot stride
    q, k         [batch, H, K]      activation dtype, unit stride in K, 16-byte aligned rows
    v            [batch, HV, V]     activation dtype, unit stride in V, 16-byte aligned rows
    gate_a, gate_b [batch, HV]      float32, any strides. Flag "gates_in_kernel": raw a and b;
                                    the kernel forms g = -exp(A_log) softplus(a + dt_bias) and
                                    beta = sigmoid(b). Without it: g (log-decay) and beta.
    A_log, dt_bias [HV]             float32, contiguous; given exactly with "gates_in_kernel"
    out          [batch, HV, V]     activation dtype, contiguous
    slot_indices [batch]            int32; pad_slot_id rows get out = 0 and write nothing
Flag "qk_l2norm": q and k are normalised in the kernel (x * rsqrt(sum(x^2) + 1e-6)); q is
then multiplied by `scale` (default K**-0.5) either way.
Records (ReplaySSM):
    rec_u [slots, HV, CAP, V] float32 (computed corrections u), rec_k [slots, H, CAP, K] act
    (k as given; normalised again on replay), rec_g [slots, HV, CAP] float32 (log-decay g)
    cursors [slots, 4] int32: records held, flush epoch, CTA arrivals (scratch), spare
Split kernel workspace (float32; spec.split_workspace_floats, templates/common/split.cuh): per (batch row, value head)
    [pred | osum] [2 V], 5 replay scalars, coef [CAP]; per batch row info [4] int32
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

ROWS_ENV = tiling.rows_env("gdn")


@dataclass(frozen=True)
class GDNDims:
    num_k_heads: int  # H
    num_v_heads: int  # HV
    head_k_dim: int  # K
    head_v_dim: int  # V


def dims_of(spec: KernelSpec, num_v_heads: int) -> GDNDims:
    return GDNDims(num_v_heads // spec.dim("vph"), num_v_heads, spec.dim("k"), spec.dim("v"))


def validate_step(
    spec: KernelSpec,
    dims: GDNDims,
    *,
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_a: torch.Tensor,
    gate_b: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    out: torch.Tensor,
) -> int:
    """Check every tensor against `spec`; return the batch size. Raises before any launch.

    Shapes and dtypes are checked before the device, so CPU tensors reach every message.
    """
    H, HV, K, V = dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim
    act = TORCH_DTYPES[spec.act_dtype]
    in_kernel = "gates_in_kernel" in spec.flags
    a_name, b_name = ("a", "b") if in_kernel else ("g", "beta")
    check_tensor("state", state, shape=(None, HV, V, K), dtype=TORCH_DTYPES[spec.state_dtype])
    device = state.device
    check_slot_pool("state", state, "[HV, V, K]")
    check_tensor("q", q, shape=(None, H, K), dtype=act, device=device, inner_contiguous=True)
    batch = q.shape[0]
    check_tensor("k", k, shape=(batch, H, K), dtype=act, device=device, inner_contiguous=True)
    check_tensor("v", v, shape=(batch, HV, V), dtype=act, device=device, inner_contiguous=True)
    for name, t, role in (("gate_a", gate_a, a_name), ("gate_b", gate_b, b_name)):
        check_tensor(f"{name} ({role})", t, shape=(batch, HV), dtype=torch.float32, device=device)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_planned(name, t, in_kernel, f"gates_in_kernel={in_kernel}")
        if t is not None:
            check_tensor(name, t, shape=(HV,), dtype=torch.float32, device=device, contiguous=True)
    check_tensor("out", out, shape=(batch, HV, V), dtype=act, device=device, contiguous=True)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_aligned_rows(name, t)
    check_cuda("state", device)
    return batch
