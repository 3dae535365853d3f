"""A stochastic-rounding seed passed as a device tensor: the same bits as the same int seed,
other bits for another seed, and changeable between replays of a captured CUDA graph."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import GDNDecodeCache, GDNDecodeWrapper, Mamba2DecodeCache, Mamba2DecodeWrapper

pytestmark = pytest.mark.gpu

WINDOW, STEPS, BATCH = 16, 20, 4  # a flush at step 16 rounds the checkpoints


def _mamba2(gen):
    def cache():
        return Mamba2DecodeCache(BATCH, num_heads=16, headdim=64, dstate=128, ngroups=1,
                                 window=WINDOW, state_dtype=torch.bfloat16, device="cuda")  # fmt: skip

    A = -(0.5 + torch.rand(16, generator=gen, device="cuda"))
    D, dt_bias = torch.randn(16, device="cuda"), 0.1 * torch.randn(16, device="cuda")

    def token():
        return dict(
            x=torch.randn(BATCH, 16, 64, generator=gen, device="cuda").bfloat16(),
            dt=torch.randn(BATCH, 16, generator=gen, device="cuda") - 1,
            A=A, B=torch.randn(BATCH, 1, 128, generator=gen, device="cuda").bfloat16(),
            C=torch.randn(BATCH, 1, 128, generator=gen, device="cuda").bfloat16(),
            D=D, dt_bias=dt_bias,
        )  # fmt: skip

    def run(wrapper, tok, slots, **kw):
        tok = dict(tok)
        args = [tok.pop(k) for k in ("x", "dt", "A", "B", "C")]
        return wrapper.run(*args, slots, **tok, **kw)

    return cache, Mamba2DecodeWrapper, token, run


def _gdn(gen):
    def cache():
        return GDNDecodeCache(BATCH, num_k_heads=1, num_v_heads=2, head_k_dim=128,
                              head_v_dim=128, window=WINDOW, state_dtype=torch.bfloat16,
                              device="cuda")  # fmt: skip

    A_log = torch.log(torch.rand(2, generator=gen, device="cuda") * 4 + 0.5)
    dt_bias = 0.1 * torch.randn(2, generator=gen, device="cuda")

    def token():
        return dict(
            q=torch.randn(BATCH, 1, 128, generator=gen, device="cuda").bfloat16(),
            k=torch.randn(BATCH, 1, 128, generator=gen, device="cuda").bfloat16(),
            v=torch.randn(BATCH, 2, 128, generator=gen, device="cuda").bfloat16(),
            a=torch.randn(BATCH, 2, generator=gen, device="cuda"),
            b=torch.randn(BATCH, 2, generator=gen, device="cuda"),
            A_log=A_log, dt_bias=dt_bias,
        )  # fmt: skip

    def run(wrapper, tok, slots, **kw):
        tok = dict(tok)
        args = [tok.pop(k) for k in ("q", "k", "v")]
        return wrapper.run(*args, slots, **tok, **kw)

    return cache, GDNDecodeWrapper, token, run


@pytest.mark.parametrize("make", [_mamba2, _gdn], ids=["mamba2", "gdn"])
def test_seed_tensor_matches_the_int_seed_and_changes_in_a_graph(make):
    gen = torch.Generator(device="cuda").manual_seed(5)
    make_cache, wrapper_cls, token, run = make(gen)
    caches = [(make_cache(), wrapper_cls) for _ in range(4)]
    tokens = [token() for _ in range(STEPS)]
    init = torch.randn(caches[0][0].state.shape, generator=gen, device="cuda").bfloat16()
    wrappers = []
    for i, (cache, wrapper_cls) in enumerate(caches):
        cache.state.copy_(init)
        wrapper = wrapper_cls(cache, use_cuda_graph=i == 3)
        wrapper.plan(BATCH, stochastic_rounding=True, device_seed=True, seed=0)
        wrappers.append(wrapper)
    slots = torch.arange(BATCH, dtype=torch.int32, device="cuda")
    seed = torch.tensor([7], dtype=torch.int64, device="cuda")
    for tok in tokens:
        run(wrappers[0], tok, slots, seed=7)
        run(wrappers[1], tok, slots, seed=seed)
        run(wrappers[2], tok, slots, seed=8)
    states = [c.state for c, _ in caches]
    assert torch.equal(states[0], states[1])  # same seed, int or tensor: same bits
    assert not torch.equal(states[0], states[2])  # another seed rounds otherwise
    assert torch.equal(caches[0][0].cursors, caches[1][0].cursors)

    # Graph mode: capture one step reading `seed`, then change its value between replays.
    graph_wrapper, graph_cache = wrappers[3], caches[3][0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    static = {k: v.clone() for k, v in tokens[0].items()}
    seed.fill_(7)
    with torch.cuda.stream(stream):
        run(graph_wrapper, static, slots, seed=seed)  # warm-up: step 1 of the replayed run
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(graph_wrapper, static, slots, seed=seed)
    graph_cache.state.copy_(init)
    graph_cache.cursors.zero_()
    for step, tok in enumerate(tokens):
        for k, v in tok.items():
            static[k].copy_(v)
        seed.fill_(7 if step < WINDOW - 1 else 8)  # the flush at step 16 rounds with seed 8
        graph.replay()
    reference = caches[0][0]
    reference.state.copy_(init)
    reference.cursors.zero_()
    for step, tok in enumerate(tokens):
        run(wrappers[0], tok, slots, seed=7 if step < WINDOW - 1 else 8)
    torch.cuda.synchronize()
    assert torch.equal(graph_cache.state, reference.state)
