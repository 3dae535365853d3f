"""Gated DeltaNet (GDN) decode step on caller-owned tensors.

Shapes (H key heads, HV value heads, HV % H == 0, value head hv reads key head hv // (HV // H);
K head_k_dim, V head_v_dim; CAP = L + T ring rows):
    state        [slots, HV, V, K]  checkpoint dtype, each slot's block contiguous ([slots, HV,
                                    V, K / 2] float4_e2m1fn_x2 for nvfp4)
    state_scale  [slots, HV, V]     float32 row scales where state is e4m3
                 [slots, HV]        float32 head scales where state is nvfp4
    state_block_scale [slots, HV, V, K / 16]  float8_e4m3fn block scales where state is nvfp4
    rec_u        [slots, HV, CAP, V] float32 (computed corrections u)  } ReplaySSM records
    rec_k        [slots, H, CAP, K] act dtype (raw k)                  } (families.layout.
    rec_g        [slots, HV, CAP]   float32 (log-decay g)              }  gdn_layout)
    rec_v        [slots, HV, CAP, V] act dtype (raw v)   } separate mode only: a flush
    rec_beta     [slots, HV, CAP]   float32 (beta)       } recomputes each held u from state
    read_state   [slots, HV, V, K]  separate mode's read copy (layout.read_dtype: bf16, f16,
                                    e4m3 or nvfp4), with read_scale and read_block_scale as
                                    state's
    cursors      [slots, 4]         int32
    q, k         [batch, H, K]      act dtype, unit stride in K, 16-byte aligned rows
    v            [batch, HV, V]     act dtype, unit stride in V, 16-byte aligned rows
    a, b         [batch, HV]        float32, any strides: raw gates (plan gates_in_kernel=True),
                                    with A_log, dt_bias [HV] float32 contiguous; the kernel forms
                                    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    g, beta      [batch, HV]        float32: precomputed gates (gates_in_kernel=False)
    out          [batch, HV, V]     act dtype, contiguous
    slot_indices [batch]            int32; pad_slot_id rows get out = 0 and write nothing
With use_qk_l2norm, q and k are normalised in the kernel (x * rsqrt(sum(x^2) + 1e-6)); q is then
multiplied by the plan's scale (default K**-0.5) either way.
"""

from __future__ import annotations

import torch

from replayssm_jit.core.checks import check_aligned_rows, check_tensor
from replayssm_jit.families import GDN
from replayssm_jit.ops import torch_path
from replayssm_jit.ops.decode import check_plan, checkpoint_tensors, output_buffer, run_step
from replayssm_jit.ops.plan import DecodePlan


def _check_gates(
    plan: DecodePlan, given: dict[str, torch.Tensor | None], lead: tuple[int, ...]
) -> tuple:
    """(gate_a, gate_b, A_log, dt_bias) in the bindings' order, from the named gates. With a
    decay per key channel (KDA) a and g are [*lead, HV, K] (unit stride in K) and dt_bias
    [HV * K]."""
    shape, dev = plan.layout.shape, plan.device
    HV, K = shape.value_heads, shape.key_dim
    per_channel = plan.family.decay_per_channel
    decay_shape = (*lead, HV, K) if per_channel else (*lead, HV)
    raw = "gates_in_kernel" in plan.spec.flags
    wanted = ("a", "b", "A_log", "dt_bias") if raw else ("g", "beta")
    for name, t in given.items():
        if (t is not None) != (name in wanted):
            raise ValueError(
                f"{name}: expected {'a tensor' if name in wanted else 'None'} (plan() had "
                f"gates_in_kernel={raw}: pass {', '.join(wanted)}), "
                f"got {'a tensor' if t is not None else 'None'}"
            )
    check_tensor(wanted[0], given[wanted[0]], shape=decay_shape, dtype=torch.float32, device=dev,
                 inner_contiguous=per_channel)  # fmt: skip
    check_tensor(wanted[1], given[wanted[1]], shape=(*lead, HV), dtype=torch.float32, device=dev)
    for name in wanted[2:]:
        length = HV * K if per_channel and name == "dt_bias" else HV
        check_tensor(
            name, given[name], shape=(length,), dtype=torch.float32, device=dev, contiguous=True
        )
    if raw:
        return given["a"], given["b"], given["A_log"], given["dt_bias"]
    return given["g"], given["beta"], None, None


def check_inputs(
    plan: DecodePlan,
    lead: tuple[int, ...],
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: dict[str, torch.Tensor | None],
) -> dict[str, object]:
    """The token inputs, each checked, in the bindings' order (the plan's scale, then KDA's
    lower_bound, 0 for none, last). lead: the
    per-token dims, (batch,) for a step or (batch, T) for drafts; gates: a, b, A_log, dt_bias, g
    and beta by name (None where not given)."""
    shape = plan.layout.shape
    H, HV, K, V = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
    act, dev = plan.layout.act_dtype, plan.device
    check_tensor("q", q, shape=(*lead, H, K), dtype=act, device=dev, inner_contiguous=True)
    check_tensor("k", k, shape=(*lead, H, K), dtype=act, device=dev, inner_contiguous=True)
    check_tensor("v", v, shape=(*lead, HV, V), dtype=act, device=dev, inner_contiguous=True)
    gate_a, gate_b, A_log, dt_bias = _check_gates(plan, gates, lead)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_aligned_rows(name, t)
    inputs = {
        "q": q, "k": k, "v": v, "gate_a": gate_a, "gate_b": gate_b,
        "A_log": A_log, "dt_bias": dt_bias, "scale": plan.family_options["scale"],
    }  # fmt: skip
    if plan.family.decay_per_channel:
        inputs["lower_bound"] = plan.family_options["lower_bound"] or 0.0
    return inputs


# A decode step is inference: the kernels ignore autograd, and so does the CPU path (an
# input that requires grad would otherwise pull the cache's tensors into its graph).
@torch.no_grad()
def gdn_decode(
    plan: DecodePlan,
    *,
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_indices: torch.Tensor,
    state_scale: torch.Tensor | None = None,
    read_state: torch.Tensor | None = None,
    read_scale: torch.Tensor | None = None,
    state_block_scale: torch.Tensor | None = None,
    read_block_scale: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    rec_u: torch.Tensor | None = None,
    rec_k: torch.Tensor | None = None,
    rec_g: torch.Tensor | None = None,
    rec_v: torch.Tensor | None = None,
    rec_beta: torch.Tensor | None = None,
    cursors: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GDN decode step; returns out [batch, HV, V] (allocated when None).

    Gates: a, b with A_log, dt_bias where the plan has gates_in_kernel=True, else g, beta. The
    rings and cursors are required in replay mode; state_scale where the layout's state is e4m3
    or nvfp4, state_block_scale where it is nvfp4 (shapes above). Separate mode (a layout with
    read_dtype): read_state (and read_scale, read_block_scale), rec_v and rec_beta too;
    non-flush steps read the read copy, a flush recomputes the held u from state, folds in FP32
    and stores both copies. workspace (scratch the step overwrites), seed and num_accepted (the
    fused commit of the last verify) as in mamba2_decode.
    Everything is checked before the launch; a failed call changes nothing.
    """
    copies = checkpoint_tensors(state, state_scale, read_state, read_scale, state_block_scale,
                                read_block_scale)  # fmt: skip
    tensors = {**copies, "rec_u": rec_u, "rec_k": rec_k, "rec_g": rec_g, "cursors": cursors}
    # Separate mode's rings, named only where given (other layouts have none).
    tensors.update({k: t for k, t in (("rec_v", rec_v), ("rec_beta", rec_beta)) if t is not None})
    gates = {"a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias, "g": g, "beta": beta}
    return delta_decode(plan, GDN, torch_path.gdn_step, tensors, q, k, v, gates, slot_indices, out,
                        workspace, seed, num_accepted)  # fmt: skip


def delta_decode(plan, family, torch_step, tensors, q, k, v, gates, slot_indices, out, workspace,
                 seed, num_accepted=None) -> torch.Tensor:  # fmt: skip
    """The body of gdn_decode and kda_decode (their families' checks, then one step)."""
    check_plan(plan, family)
    shape = plan.layout.shape
    inputs = check_inputs(plan, (plan.batch_size,), q=q, k=k, v=v, gates=gates)
    out = output_buffer(plan, out, (shape.value_heads, shape.value_dim))
    return run_step(
        plan, tensors, inputs, out=out, slot_indices=slot_indices, workspace=workspace,
        seed=seed, torch_step=torch_step, num_accepted=num_accepted,
    )  # fmt: skip
