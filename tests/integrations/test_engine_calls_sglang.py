"""SGLang's GDN decode calls made as SGLang's kernel dispatcher makes them (keyword-only
arguments, q/k/v [1, B, ...], raw gates [B, HV], query_start_loc, PAD_SLOT_ID -1), with the pad
rows of a CUDA graph mapped from mamba_cache_indices, on the CPU path against the float64
references; a pad row never touches the live slot its request index 0 names."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import gdn_layout
from replayssm_jit.integrations.sglang import PAD_SLOT_ID, SGLangLayer, mamba_slots
from replayssm_jit.reference import gdn_gates
from replayssm_jit.reference.gdn import gdn_step

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
KH, HV, K, V = 2, 4, 16, 8
SLOTS, L, MAX_BS = 8, 4, 6
TOL = 2e-5

pytestmark = pytest.mark.usefixtures("no_launch_env")


def rel(actual, expected):
    a, e = actual.to(F64), expected.to(F64)
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))


def setup():
    layout = gdn_layout(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                        act_dtype=F32)  # fmt: skip
    ssm_states = torch.zeros(SLOTS, HV, V, K)  # SGLang's mamba pool for this layer
    return SGLangLayer(layout, ssm_states, max_batch=MAX_BS), ssm_states


def test_pad_rows_never_alias_a_live_slot():
    """The issue's case: req_pool_indices [1, 2, 0, 0] (two live rows, two CUDA-graph pads with
    request index 0) gave slots [5, 1, 3, 3]; slot 3 belongs to request 0, live elsewhere."""
    layer, _ = setup()
    req_to_mamba_slot = torch.tensor([3, 5, 1, 7], dtype=I32)
    req_pool_indices = torch.tensor([1, 2, 0, 0], dtype=I64)
    mamba_cache_indices = req_to_mamba_slot[req_pool_indices]  # SGLang's get_mamba_indices
    assert mamba_cache_indices.tolist() == [5, 1, 3, 3]
    for live in (2, torch.tensor(2)):
        assert layer.pad_rows(mamba_cache_indices, live).tolist() == [5, 1, -1, -1]
        got = mamba_slots(req_pool_indices, req_to_mamba_slot, live)
        assert got.tolist() == [5, 1, -1, -1]
    # A replay with more live rows reuses the same buffers.
    assert layer.pad_rows(mamba_cache_indices, 3).tolist() == [5, 1, 3, -1]


def tokens(gen, bs):
    q = torch.randn(1, bs, KH, K, generator=gen)
    k = torch.randn(1, bs, KH, K, generator=gen)
    v = torch.randn(1, bs, HV, V, generator=gen)
    a = torch.randn(bs, HV, generator=gen)
    b = torch.randn(bs, HV, generator=gen)
    return q, k, v, a, b


def oracle(ref, slots, q, k, v, a, b, A_log, dt_bias):
    o = torch.zeros(len(slots), HV, V, dtype=F64)
    for r, s in enumerate(slots):
        if s == PAD_SLOT_ID:
            continue
        g, beta = gdn_gates(A_log, a[r][None], dt_bias, b[r][None])
        o_r, st = gdn_step(ref[s][None], q[0, r][None], k[0, r][None], v[0, r][None], g, beta)
        o[r], ref[s] = o_r[0], st[0]
    return o


@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed_decode"])
def test_gdn_decode_as_sglang_calls_it(packed):
    gen = torch.Generator().manual_seed(11)
    layer, ssm_states = setup()
    A_log = torch.rand(HV, generator=gen) - 1.0
    dt_bias = 0.5 * torch.randn(HV, generator=gen)
    req_to_mamba_slot = torch.tensor([3, 5, 1, 7, 6], dtype=I32)
    req_pool_indices = torch.tensor([1, 2, 4, 0, 0], dtype=I64)  # 3 live rows, 2 pads
    bs, live = 5, 3
    ref = torch.zeros(SLOTS, HV, V, K, dtype=F64)
    before = {n: t.clone() for n, t in layer.pool.items()}
    for _ in range(2 * L + 1):
        cache_indices = layer.pad_rows(req_to_mamba_slot[req_pool_indices], live)
        slots = cache_indices.tolist()
        q, k, v, a, b = tokens(gen, bs)
        if packed:
            mixed_qkv = torch.cat([q[0].flatten(1), k[0].flatten(1), v[0].flatten(1)], dim=1)
            o = layer.packed_decode(mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias,
                                    scale=K**-0.5, ssm_states=ssm_states,
                                    cache_indices=cache_indices, num_v_heads=HV,
                                    head_v_dim=V)  # fmt: skip
        else:
            o = layer.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                             cache_indices=cache_indices,
                             query_start_loc=torch.arange(bs + 1, dtype=I32))  # fmt: skip
        assert o.shape == (1, bs, HV, V)
        assert rel(o[0], oracle(ref, slots, q, k, v, a, b, A_log, dt_bias)) < TOL
        assert torch.equal(o[0, live:], torch.zeros(bs - live, HV, V))
    for name, t in layer.pool.items():  # slot 3 is request 0's: the pads must not touch it
        for s in (0, 2, 3, 4, 7):
            assert torch.equal(before[name][s], t[s]), (name, s)


def test_unsupported_dispatcher_inputs_are_refused_and_change_nothing():
    gen = torch.Generator().manual_seed(12)
    layer, ssm_states = setup()
    q, k, v, a, b = tokens(gen, 2)
    before = {n: t.clone() for n, t in layer.pool.items()}
    with pytest.raises(TypeError, match="not supported yet"):
        layer.decode(q, k, v, a, b, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
                     ssm_states=ssm_states, cache_indices=torch.tensor([1, 2], dtype=I32),
                     query_start_loc=torch.arange(3, dtype=I32),
                     mamba_track_mask=torch.ones(2, dtype=torch.bool))  # fmt: skip
    for name, t in layer.pool.items():
        assert torch.equal(before[name], t), name


def test_pad_rows_traces_whole_and_allocates_nothing():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    layer, _ = setup()
    indices = torch.tensor([5, 1, 3, 3], dtype=I64)
    explained = torch._dynamo.explain(layer.pad_rows)(indices, torch.tensor(2))
    assert explained.graph_break_count == 0, explained.break_reasons
    with Recorder() as rec:
        got = layer.pad_rows(indices, torch.tensor(2))
    assert got.tolist() == [5, 1, -1, -1]
    assert not {"empty", "zeros", "clone", "arange", "full"} & set(rec.ops), rec.ops


def test_mamba2_decode_as_sglang_calls_it():
    """x_h [bs, H, P], dt and the parameters head-expanded, state_batch_indices
    cache_indices.unsqueeze(-1), pads -1 from pad_rows."""
    from replayssm_jit import mamba2_layout
    from replayssm_jit.reference.mamba2 import mamba2_step

    H, G, P, N = 4, 2, 8, 16
    gen = torch.Generator().manual_seed(13)
    layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, act_dtype=F32)
    ssm_state = torch.zeros(SLOTS, H, P, N)
    layer = SGLangLayer(layout, ssm_state, max_batch=MAX_BS, dt_softplus=True)
    A, D, dt_bias = -(0.5 + torch.rand(H, generator=gen)), torch.randn(H), torch.rand(H) - 0.5
    A_expanded = A.view(H, 1, 1).expand(H, P, N)
    D_expanded = D.view(H, 1).expand(H, P)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    before = {n: t.clone() for n, t in layer.pool.items()}
    req_to_mamba_slot = torch.tensor([3, 5, 1], dtype=I32)
    cache_indices = layer.pad_rows(req_to_mamba_slot[torch.tensor([1, 2, 0, 0])], 2)
    for _ in range(2 * L + 1):
        x_h = torch.randn(4, H, P, generator=gen)
        dt = torch.rand(4, H, generator=gen)
        B_h, C_h = torch.randn(4, G, N, generator=gen), torch.randn(4, G, N, generator=gen)
        out = torch.empty_like(x_h)
        layer.selective_state_update(
            ssm_state, x_h, dt[:, :, None].expand(-1, -1, P), A_expanded, B_h, C_h, D_expanded,
            z=None, dt_bias=dt_bias.view(H, 1).expand(H, P), dt_softplus=True,
            state_batch_indices=cache_indices.unsqueeze(-1), out=out,
        )  # fmt: skip
        o, new = mamba2_step(ref[[5, 1]], x_h[:2], dt[:2], A, B_h[:2], C_h[:2], D=D,
                             dt_bias=dt_bias, dt_softplus=True)  # fmt: skip
        ref[[5, 1]] = new
        assert rel(out[:2], o) < TOL and torch.equal(out[2:], torch.zeros(2, H, P))
    for name, t in layer.pool.items():
        for s in (0, 2, 3, 4, 6, 7):
            assert torch.equal(before[name][s], t[s]), (name, s)
    with pytest.raises(ValueError, match="disable_state_update: expected False for a one-token"):
        layer.selective_state_update(
            ssm_state, x_h, dt[:, :, None].expand(-1, -1, P), A_expanded, B_h, C_h, D_expanded,
            dt_bias=dt_bias.view(H, 1).expand(H, P), dt_softplus=True,
            state_batch_indices=cache_indices, out=out, disable_state_update=True,
        )  # fmt: skip
