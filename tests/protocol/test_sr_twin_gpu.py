"""The kernels' stochastic rounding draws the same bits as the CPU path (core.codecs.rounding_bits,
round_stochastic): a conventional step of each family from the same FP32-exact inputs, with the
same seed, stores the same BF16 / FP16 state on the GPU as on the CPU, up to the rare element
whose FP32 value before rounding differs by an ulp between the two (FMA order). A generator
that differs from its twin changes about half of the rounded elements."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    KDADecodeCache,
    KDADecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_launch_env")]

BATCH, SEED = 4, 1234
F32 = torch.float32


def _mamba2(gen):
    H, P, N = 16, 64, 128
    cache = dict(num_heads=H, headdim=P, dstate=N, ngroups=1)
    tok = dict(x=torch.randn(BATCH, H, P, generator=gen), dt=torch.randn(BATCH, H, generator=gen) - 1,
               A=-(0.5 + torch.rand(H, generator=gen)), B=torch.randn(BATCH, 1, N, generator=gen),
               C=torch.randn(BATCH, 1, N, generator=gen), D=torch.randn(H, generator=gen),
               dt_bias=0.1 * torch.randn(H, generator=gen))  # fmt: skip
    order = ("x", "dt", "A", "B", "C")
    return Mamba2DecodeCache, Mamba2DecodeWrapper, cache, tok, order, (H, P, N)


def _delta(cache_type, wrapper_type, per_channel):
    def make(gen):
        HV, K, V = 2, 128, 128
        gate = (BATCH, HV, K) if per_channel else (BATCH, HV)
        cache = dict(num_k_heads=1, num_v_heads=HV, head_k_dim=K, head_v_dim=V)
        tok = dict(q=torch.randn(BATCH, 1, K, generator=gen), k=torch.randn(BATCH, 1, K, generator=gen),
                   v=torch.randn(BATCH, HV, V, generator=gen), a=torch.randn(gate, generator=gen),
                   b=torch.randn(BATCH, HV, generator=gen),
                   A_log=torch.log(torch.rand(HV, generator=gen) * 4 + 0.5),
                   dt_bias=0.1 * torch.randn(HV * (K if per_channel else 1), generator=gen))  # fmt: skip
        return cache_type, wrapper_type, cache, tok, ("q", "k", "v"), (HV, V, K)

    return make


FAMILIES = {
    "mamba2": _mamba2,
    "gdn": _delta(GDNDecodeCache, GDNDecodeWrapper, False),
    "kda": _delta(KDADecodeCache, KDADecodeWrapper, True),
}


def _conventional_step(name, state_dtype, device, init, sr=True):
    cache_type, wrapper_type, dims, tok, order, _ = FAMILIES[name](torch.Generator().manual_seed(7))
    cache = cache_type(
        BATCH, **dims, window=1, state_dtype=state_dtype, act_dtype=F32, device=device
    )
    cache.state.copy_(init.to(state_dtype))
    wrapper = wrapper_type(cache, mode="conventional")
    wrapper.plan(BATCH, stochastic_rounding=sr, seed=SEED)
    tok = {k: v.to(device) for k, v in tok.items()}
    slots = torch.arange(BATCH, dtype=torch.int32, device=device)
    wrapper.run(*[tok.pop(k) for k in order], slots, **tok)
    return cache.state.cpu()


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gpu_stochastic_rounding_is_the_cpu_twin(name, state_dtype):
    shape = FAMILIES[name](torch.Generator().manual_seed(7))[5]
    init = 0.5 * torch.randn((BATCH, *shape), generator=torch.Generator().manual_seed(3))
    gpu = _conventional_step(name, state_dtype, "cuda", init)
    cpu = _conventional_step(name, state_dtype, "cpu", init)
    assert torch.isfinite(gpu.float()).all()
    differ = (gpu.view(torch.int16) != cpu.view(torch.int16)).float().mean().item()
    assert differ < 1e-3, f"{differ:.2%} of the stored elements differ from the CPU twin"
    # The rounding is stochastic: many elements leave their round-to-nearest value.
    nearest = _conventional_step(name, state_dtype, "cpu", init, sr=False)
    moved = (cpu.view(torch.int16) != nearest.view(torch.int16)).float().mean().item()
    assert moved > 0.1, moved
