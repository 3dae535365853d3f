"""Cross-check our conventional Mamba-2 step against FlashInfer's selective_state_update."""

import pytest
import torch
from support.checks import rel_err

from replayssm_jit import Mamba2DecodeCache, Mamba2DecodeWrapper
from replayssm_jit.reference import mamba2_step_pool

pytestmark = pytest.mark.gpu


def test_conventional_matches_flashinfer_selective_state_update():
    fi_mamba = pytest.importorskip("flashinfer.mamba")
    H, P, N, G, batch, slots = 128, 64, 128, 8, 16, 40
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = Mamba2DecodeCache(
        slots, num_heads=H, headdim=P, dstate=N, ngroups=G, window=16, device="cuda"
    )
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen, device="cuda"))
    fi_pool = cache.state.clone()
    ref_pool = cache.state.double()
    idx = torch.randperm(slots, generator=gen, device="cuda")[:batch].to(torch.int32)
    A = -(0.5 + torch.rand(H, generator=gen, device="cuda"))
    D = torch.randn(H, generator=gen, device="cuda")
    dt_bias = 0.1 * torch.randn(H, generator=gen, device="cuda")
    ours = Mamba2DecodeWrapper(cache, mode="conventional")
    ours.plan(batch)
    for _ in range(8):
        x = torch.randn(batch, H, P, generator=gen, device="cuda").to(torch.bfloat16)
        dt = torch.randn(batch, H, generator=gen, device="cuda") * 0.5 - 1
        B = torch.randn(batch, G, N, generator=gen, device="cuda").to(torch.bfloat16)
        C = torch.randn(batch, G, N, generator=gen, device="cuda").to(torch.bfloat16)
        y_ours = torch.full((batch, H, P), float("nan"), dtype=torch.bfloat16, device="cuda")
        y_fi = torch.full_like(y_ours, float("nan"))
        ours.run(x, dt, A, B, C, idx, D=D, dt_bias=dt_bias, out=y_ours)
        fi_mamba.selective_state_update(
            fi_pool,
            x,
            dt[:, :, None].expand(batch, H, P),
            A[:, None, None].expand(H, P, N),
            B,
            C,
            D[:, None].expand(H, P),
            dt_bias=dt_bias[:, None].expand(H, P),
            dt_softplus=True,
            state_batch_indices=idx,
            out=y_fi,
        )
        y_ref = mamba2_step_pool(
            ref_pool, idx, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True
        )
        assert not torch.isnan(y_ours).any() and not torch.isnan(y_fi).any()
        assert rel_err(y_ours, y_fi) < 1e-2
        assert rel_err(y_ours, y_ref) <= 2 * rel_err(y_fi, y_ref) + 1e-3
    assert rel_err(cache.state, fi_pool) < 1e-5
    assert rel_err(cache.state, ref_pool) < 1e-5
