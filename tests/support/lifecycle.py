"""Shared scaffolding of the slot lifecycle tests (test_lifecycle_scenarios.py,
test_lifecycle_slot_ops.py, and test_long_run_gpu.py): bit-for-bit slot checks, the two families
engine-style (layout, plan options, parameters, tokens, the op, the float64 reference) and slot
tensors with random bits.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import gdn_decode, gdn_layout, mamba2_decode, mamba2_layout
from replayssm_jit.reference import gdn_gates, gdn_step, mamba2_step
from support.checks import same_bits

GPU = pytest.mark.gpu


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def assert_slots_kept(before: dict, tensors: dict, slots) -> None:
    """Every tensor's rows of `slots` have the bits they had in `before`."""
    slots = sorted(slots)
    if not slots:
        return
    for name, t in tensors.items():
        index = torch.tensor(slots, dtype=torch.long, device=t.device)
        if not same_bits(t[index], before[name][index]):
            changed = [s for s in slots if not same_bits(t[s], before[name][s])]
            raise AssertionError(f"{name} of slots {changed} changed")


# ---------------------------------------------------------------------------------------------
# The two families, engine-style: layout, plan, parameters, tokens, the op, the reference
# ---------------------------------------------------------------------------------------------


class Mamba2:
    """The odd test shape of tests/mamba2/test_mamba2_gpu.py (H = 6, P = 24, N = 64, G = 3) with z."""

    name = "mamba2"
    heads, headdim, dstate, groups = 6, 24, 64, 3

    def layout(self, window, state_dtype):
        return mamba2_layout(num_heads=self.heads, headdim=self.headdim, dstate=self.dstate,
                             ngroups=self.groups, window=window, state_dtype=state_dtype,
                             act_dtype=torch.float32)  # fmt: skip

    def plan_options(self):
        return dict(has_z=True)

    def params(self, gen, dev):
        H = self.heads
        return dict(
            A=-(0.5 + 1.5 * torch.rand(H, generator=gen, device=dev)),
            D=torch.randn(H, generator=gen, device=dev),
            dt_bias=0.1 * torch.randn(H, generator=gen, device=dev),
        )

    def token(self, batch, gen, dev):
        H, P, N, G = self.heads, self.headdim, self.dstate, self.groups
        return dict(
            x=torch.randn(batch, H, P, generator=gen, device=dev),
            z=torch.randn(batch, H, P, generator=gen, device=dev),
            dt=torch.randn(batch, H, generator=gen, device=dev) * 0.5 - 1.0,
            B=torch.randn(batch, G, N, generator=gen, device=dev) / N**0.25,
            C=torch.randn(batch, G, N, generator=gen, device=dev) / N**0.25,
        )

    def decode(self, plan, tensors, params, tok, slot_indices, out, workspace):
        mamba2_decode(plan, **tensors, **params, **tok, slot_indices=slot_indices, out=out,
                      workspace=workspace)  # fmt: skip

    def reference(self, states, params, tok):
        return mamba2_step(states, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"],
                           D=params["D"], z=tok["z"], dt_bias=params["dt_bias"], dt_softplus=True)  # fmt: skip


class GDN:
    """The k64 test shape of tests/gdn/test_gdn_gpu.py (H = 4, HV = 8, K = V = 64), raw gates."""

    name = "gdn"
    k_heads, v_heads, kdim, vdim = 4, 8, 64, 64

    def layout(self, window, state_dtype):
        return gdn_layout(num_k_heads=self.k_heads, num_v_heads=self.v_heads, head_k_dim=self.kdim,
                          head_v_dim=self.vdim, window=window, state_dtype=state_dtype,
                          act_dtype=torch.float32)  # fmt: skip

    def plan_options(self):
        return {}

    def params(self, gen, dev):
        HV = self.v_heads
        return dict(
            A_log=torch.log(0.5 + torch.rand(HV, generator=gen, device=dev)),
            dt_bias=0.5 * torch.rand(HV, generator=gen, device=dev) - 0.25,
        )

    def token(self, batch, gen, dev):
        H, HV, K, V = self.k_heads, self.v_heads, self.kdim, self.vdim
        return dict(
            q=torch.randn(batch, H, K, generator=gen, device=dev),
            k=torch.randn(batch, H, K, generator=gen, device=dev),
            v=torch.randn(batch, HV, V, generator=gen, device=dev),
            a=-4.0 + 3.0 * torch.rand(batch, HV, generator=gen, device=dev),
            b=torch.randn(batch, HV, generator=gen, device=dev),
        )

    def decode(self, plan, tensors, params, tok, slot_indices, out, workspace):
        gdn_decode(plan, **tensors, **params, **tok, slot_indices=slot_indices, out=out,
                   workspace=workspace)  # fmt: skip

    def reference(self, states, params, tok):
        g, beta = gdn_gates(params["A_log"], tok["a"], params["dt_bias"], tok["b"])
        return gdn_step(states, tok["q"], tok["k"], tok["v"], g, beta)


FAMILIES = [pytest.param(Mamba2(), id="mamba2"), pytest.param(GDN(), id="gdn")]


def engine_tensors(layout, num_slots, gen, device, window) -> dict[str, torch.Tensor]:
    """Every slot tensor with random bits, cursors included (word 0 a valid held count)."""
    tensors = {}
    for t in layout.tensors():
        shape = t.shape(num_slots)
        if t.name == "cursors":
            words = torch.randint(0, 1000, shape, generator=gen, device=device)
            words[:, 0] = torch.randint(0, window, (num_slots,), generator=gen, device=device)
            tensors[t.name] = words.to(torch.int32)
        else:
            tensors[t.name] = torch.randn(shape, generator=gen, device=device).to(t.dtype)
    return tensors
