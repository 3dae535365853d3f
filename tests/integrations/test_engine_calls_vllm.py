"""vLLM's decode calls made exactly as vLLM's current code makes them (argument names and order,
dtypes, head-expanded stride-0 parameters, index tensors, the null block 0 pad, MTP's packed
tokens with cu_seqlens and num_accepted_tokens), on the CPU path, against the float64
references; pads and unnamed slots stay bit-identical. Engine code read: docs/integrations.md.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import gdn_layout, kda_layout, mamba2_layout, reset_slots
from replayssm_jit.integrations.vllm import ReplaySSMBackend
from replayssm_jit.integrations.vllm.rows import LayerRows
from replayssm_jit.reference import gdn_gates, kda_gates
from replayssm_jit.reference.gdn import gdn_step
from replayssm_jit.reference.kda import kda_step
from replayssm_jit.reference.mamba2 import mamba2_step

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
H, G, P, N = 4, 2, 8, 16  # Mamba-2 heads, groups, headdim, dstate
KH, HV, K, V = 2, 4, 16, 8  # GDN key heads, value heads, head dims
SLOTS, L = 9, 4
TOL = 2e-5

pytestmark = pytest.mark.usefixtures("no_launch_env")


def rel(actual, expected):
    a, e = actual.to(F64), expected.to(F64)
    return float(torch.linalg.vector_norm(a - e) / max(torch.linalg.vector_norm(e), 1e-30))


def snapshot(layer):
    return {n: t.clone() for n, t in layer.pool.items()}


def assert_untouched(before, layer, slots):
    """Slots in `slots` (the null block, slots no row names) keep every bit of every tensor."""
    for name, t in layer.pool.items():
        for s in slots:
            assert torch.equal(before[name][s], t[s]), (name, s)


# ---------------------------------------------------------------------------------------------
# Mamba-2: mamba_mixer2._run_decode -> selective_state_update / ssu_dispatch
# ---------------------------------------------------------------------------------------------


class Mamba2Params:
    def __init__(self, gen):
        self.A = -(0.5 + 1.5 * torch.rand(H, generator=gen))
        self.D = torch.randn(H, generator=gen)
        self.dt_bias = torch.rand(H, generator=gen) - 0.5

    def expanded(self):
        """As the mixer builds them: A [H, P, N] float32, D and dt_bias [H, P], stride 0."""
        return (self.A[:, None, None].expand(-1, P, N).to(F32),
                self.D[:, None].expand(-1, P), self.dt_bias[:, None].expand(-1, P))  # fmt: skip


def m2_tokens(gen, n, dtype=F32):
    x = torch.randn(n, H, P, generator=gen)
    dt = -3.0 + 3.5 * torch.rand(n, H, generator=gen)
    B = 0.5 * torch.randn(n, G, N, generator=gen)
    C = 0.5 * torch.randn(n, G, N, generator=gen)
    return tuple(t.to(dtype) for t in (x, dt, B, C))


def m2_setup(T=1, dtype=F32):
    layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, drafts=T,
                           act_dtype=dtype)  # fmt: skip
    ssm_state = torch.zeros(SLOTS, H, P, N)  # vLLM's per-layer SSM state
    backend = ReplaySSMBackend()
    layer = backend.register(ssm_state, layout, dt_softplus=True)
    return backend, layer, ssm_state


def m2_oracle_step(ref, slots, x, dt, B, C, prm):
    live = [b for b, s in enumerate(slots) if s != 0]
    sel = [slots[b] for b in live]
    y = torch.zeros(len(slots), H, P, dtype=F64)
    o, new = mamba2_step(ref[sel], x[live], dt[live], prm.A, B[live], C[live], D=prm.D,
                         dt_bias=prm.dt_bias, dt_softplus=True)  # fmt: skip
    y[live] = o
    ref[sel] = new
    return y


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("order", ["mixer", "ssu_dispatch", "backend_lookup"])
def test_mamba2_decode_as_vllm_calls_it(order, dtype):
    """x, dt, B, C and out in the model dtype (bf16 in vLLM); A, D, dt_bias float32."""
    gen = torch.Generator().manual_seed(1)
    tol = TOL if dtype == F32 else 1e-2
    backend, layer, ssm_state = m2_setup(dtype=dtype)
    prm = Mamba2Params(gen)
    A_d, D_d, dt_bias_d = prm.expanded()
    slots = [3, 5, 0, 2]  # row 2: a CUDA-graph pad row on the null block
    state_indices_tensor_d = torch.tensor(slots, dtype=I32)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    before = snapshot(layer)
    preallocated_ssm_out_d = torch.empty(len(slots), H * P, dtype=dtype)
    for _ in range(2 * L + 1):
        x, dt, B, C = m2_tokens(gen, len(slots), dtype)
        dt_d = dt[:, :, None].expand(-1, -1, P)  # vLLM expands dt over head_dim
        out = preallocated_ssm_out_d.view(len(slots), -1, P)
        if order == "mixer":
            layer.selective_state_update(
                ssm_state, x, dt_d, A_d, B, C, D_d, z=None, dt_bias=dt_bias_d, dt_softplus=True,
                state_batch_indices=state_indices_tensor_d,
                dst_state_batch_indices=state_indices_tensor_d, out=out,
            )  # fmt: skip
        elif order == "ssu_dispatch":
            layer.ssu(ssm_state, x, dt_d, A_d, B, C, D_d, dt_bias_d, z=None, dt_softplus=True,
                      state_batch_indices=state_indices_tensor_d,
                      dst_state_batch_indices=state_indices_tensor_d, null_block_id=0,
                      out=out)  # fmt: skip
        else:
            backend.ssu(ssm_state, x, dt_d, A_d, B, C, D_d, dt_bias_d, z=None, dt_softplus=True,
                        state_batch_indices=state_indices_tensor_d, out=out)  # fmt: skip
        expected = m2_oracle_step(ref, slots, x, dt, B, C, prm)
        assert rel(out, expected) < tol
        assert torch.equal(out[2], torch.zeros(H, P, dtype=dtype))  # the pad row's output is 0
    assert_untouched(before, layer, [0, 1, 4, 6, 7, 8])


def test_mamba2_refuses_a_foreign_state_and_a_copy_to_another_slot():
    gen = torch.Generator().manual_seed(2)
    backend, layer, ssm_state = m2_setup()
    prm = Mamba2Params(gen)
    A_d, D_d, dt_bias_d = prm.expanded()
    x, dt, B, C = m2_tokens(gen, 2)
    dt_d = dt[:, :, None].expand(-1, -1, P)
    idx, out = torch.tensor([1, 2], dtype=I32), torch.empty(2, H, P)
    before = snapshot(layer)
    with pytest.raises(ValueError, match="state: expected"):
        backend.ssu(torch.zeros(SLOTS, H, P, N), x, dt_d, A_d, B, C, D_d, dt_bias_d,
                    state_batch_indices=idx, out=out, dt_softplus=True)  # fmt: skip
    with pytest.raises(ValueError, match="dst_state_batch_indices: expected the slots"):
        layer.ssu(ssm_state, x, dt_d, A_d, B, C, D_d, dt_bias_d, dt_softplus=True,
                  state_batch_indices=idx, dst_state_batch_indices=torch.tensor([1, 3], dtype=I32),
                  out=out)  # fmt: skip
    assert_untouched(before, layer, range(SLOTS))


# ---------------------------------------------------------------------------------------------
# Mamba-2 MTP: packed [tokens, H, P], cu_seqlens, state indices [B, 1 + T], num_accepted_tokens
# ---------------------------------------------------------------------------------------------

T = 3  # tokens per verify row: the bonus token and two drafts


def m2_oracle_verify(ref, slots, x, dt, B, C, prm):
    """Outputs of T chained tokens per live row from its state, and the T states after them."""
    outs, states = torch.zeros(len(slots), T, H, P, dtype=F64), {}
    for b, s in enumerate(slots):
        if s == 0:
            continue
        st = ref[s][None].clone()
        seq = []
        for j in range(T):
            o, st = mamba2_step(st, x[b, j][None], dt[b, j][None], prm.A, B[b, j][None],
                                C[b, j][None], D=prm.D, dt_bias=prm.dt_bias,
                                dt_softplus=True)  # fmt: skip
            outs[b, j] = o[0]
            seq.append(st[0].clone())
        states[s] = seq
    return outs, states


def run_mtp(rounds=6, seed=3):
    """vLLM's MTP loop; returns the worst relative error over the verify outputs."""
    gen = torch.Generator().manual_seed(seed)
    _, layer, ssm_state = m2_setup(T)
    prm = Mamba2Params(gen)
    A_d, D_d, dt_bias_d = prm.expanded()
    slots = [4, 0, 7, 1]
    bs = len(slots)
    # [max_bs, 1 + num_spec]: column 0 is the request's block; the rest are vLLM's spare blocks.
    state_indices_tensor_d = torch.tensor([[s, 0, 0] if s == 0 else [s, 8 - s % 2, 8] for s in
                                           slots], dtype=I32)  # fmt: skip
    query_start_loc_d = torch.arange(bs + 1, dtype=I32) * T
    num_accepted_tokens = torch.ones(bs, dtype=I32)  # the first step after reset: all 1
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    before = snapshot(layer)
    worst = 0.0
    out = torch.empty(bs * T, H * P)
    for round_ in range(rounds):
        x, dt, B, C = m2_tokens(gen, bs * T)
        dt_d = dt[:, :, None].expand(-1, -1, P)
        layer.selective_state_update(
            ssm_state, x, dt_d, A_d, B, C, D_d, z=None, dt_bias=dt_bias_d, dt_softplus=True,
            state_batch_indices=state_indices_tensor_d,
            dst_state_batch_indices=state_indices_tensor_d, out=out.view(bs * T, -1, P),
            num_accepted_tokens=num_accepted_tokens, cu_seqlens=query_start_loc_d,
        )  # fmt: skip
        per_row = [t.view(bs, T, *t.shape[1:]) for t in (x, dt, B, C)]
        expected, states = m2_oracle_verify(ref, slots, *per_row, prm)
        got = out.view(bs, T, H, P)
        worst = max(worst, rel(got, expected))
        assert torch.equal(got[1], torch.zeros(T, H, P))
        # The rejection sampler keeps 1..T tokens of the window (bonus included); pads get 1.
        kept = torch.randint(1, T + 1, (bs,), generator=gen, dtype=I32)
        kept[1] = 1
        num_accepted_tokens = kept
        for b, s in enumerate(slots):
            if s:
                ref[s] = states[s][int(kept[b]) - 1]
        if round_ == 2:  # vLLM recycles row 2's slot for a new request: reset, count 1
            reset_slots(layer.layout, layer.pool, [7])
            ref[7] = 0
            num_accepted_tokens[2] = 1
    assert_untouched(before, layer, [0, 2, 3, 5, 6, 8])
    return worst


def test_mamba2_mtp_as_vllm_calls_it():
    assert run_mtp() < TOL


def test_an_off_by_one_num_accepted_tokens_mapping_fails(monkeypatch):
    """The adapter subtracting the bonus token (a plausible bug) is caught by the outputs."""
    real = LayerRows.accepted_from_engine

    def minus_one(self, counts, cursors, slots):
        got = real(self, counts, cursors, slots)
        return None if got is None else got.sub_(1).clamp_(min=0)

    monkeypatch.setattr(LayerRows, "accepted_from_engine", minus_one)
    assert run_mtp() > 1e-3


def test_num_accepted_tokens_outside_vllms_convention_is_refused():
    gen = torch.Generator().manual_seed(4)
    _, layer, ssm_state = m2_setup(T)
    prm = Mamba2Params(gen)
    A_d, D_d, dt_bias_d = prm.expanded()
    x, dt, B, C = m2_tokens(gen, 2 * T)
    args = (ssm_state, x, dt[:, :, None].expand(-1, -1, P), A_d, B, C, D_d)
    idx = torch.tensor([[1, 5, 6], [2, 7, 8]], dtype=I32)
    kw = dict(dt_bias=dt_bias_d, dt_softplus=True, state_batch_indices=idx,
              out=torch.empty(2 * T, H, P), cu_seqlens=torch.arange(3, dtype=I32) * T)  # fmt: skip
    before = snapshot(layer)
    for bad in ([0, 1], [2, 1]):  # 0: below vLLM's minimum; 2: nothing is pending after reset
        with pytest.raises(ValueError, match="num_accepted_tokens: expected"):
            layer.selective_state_update(*args, num_accepted_tokens=torch.tensor(bad), **kw)
    assert_untouched(before, layer, range(SLOTS))
    layer.selective_state_update(*args, num_accepted_tokens=torch.ones(2, dtype=I64), **kw)


# ---------------------------------------------------------------------------------------------
# GDN: qwen_gdn_linear_attn -> fused_sigmoid_gating_delta_rule_update / packed decode
# ---------------------------------------------------------------------------------------------


def gdn_setup(T=1, kda=False, dtype=F32):
    make = kda_layout if kda else gdn_layout
    heads = HV if kda else KH
    layout = make(num_k_heads=heads, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                  drafts=T, act_dtype=dtype)  # fmt: skip
    ssm_state = torch.zeros(SLOTS, HV, V, K)
    backend = ReplaySSMBackend()
    options = {"lower_bound": -5.0} if kda else {}
    return backend, backend.register(ssm_state, layout, **options), ssm_state


def delta_tokens(gen, n, heads, kda=False, dtype=F32):
    q = torch.randn(1, n, heads, K, generator=gen)
    k = torch.randn(1, n, heads, K, generator=gen)
    v = torch.randn(1, n, HV, V, generator=gen)
    a = torch.randn(n, HV, *((K,) if kda else ()), generator=gen)
    b = torch.randn(n, HV, generator=gen)
    return tuple(t.to(dtype) for t in (q, k, v, a, b))


def delta_params(gen, kda=False):
    A_log = torch.rand(HV, generator=gen) - 1.0
    dt_bias = 0.5 * torch.randn(HV * K if kda else HV, generator=gen)
    return A_log, dt_bias


def delta_oracle(ref, slots, q, k, v, a, b, A_log, dt_bias, kda=False):
    """Each live row's tokens in order (rows of [n_rows, t, ...]) from its state; returns o."""
    o = torch.zeros(*v.shape, dtype=F64)
    for r, s in enumerate(slots):
        if s in (0, -1):
            continue
        st = ref[s][None].clone()
        for j in range(q.shape[1]):
            if kda:
                g, beta = kda_gates(A_log, a[r, j][None], dt_bias, b[r, j][None], -5.0)
                o_j, st = kda_step(st, q[r, j][None], k[r, j][None], v[r, j][None], g, beta)
            else:
                g, beta = gdn_gates(A_log, a[r, j][None], dt_bias, b[r, j][None])
                o_j, st = gdn_step(st, q[r, j][None], k[r, j][None], v[r, j][None], g, beta)
            o[r, j] = o_j[0]
        ref[s] = st[0]
    return o


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_delta_decode_as_vllm_calls_it(kda, dtype):
    """q, k, v and the raw gates a, b in the model dtype; A_log, dt_bias float32."""
    gen = torch.Generator().manual_seed(5)
    tol = TOL if dtype == F32 else 1e-2
    _, layer, ssm_state = gdn_setup(kda=kda, dtype=dtype)
    A_log, dt_bias = delta_params(gen, kda)
    slots = [6, 0, 2, 3]
    non_spec_state_indices_tensor = torch.tensor(slots, dtype=I32)
    non_spec_query_start_loc = torch.arange(len(slots) + 1, dtype=I32)
    ref = torch.zeros(SLOTS, HV, V, K, dtype=F64)
    before = snapshot(layer)
    for _ in range(2 * L + 1):
        q, k, v, a, b = delta_tokens(gen, len(slots), HV if kda else KH, kda, dtype)
        if kda:
            o, final = layer.fused_recurrent_kda(
                q, k, v, a[None], b[None], A_log, dt_bias, -5.0, ssm_state,
                non_spec_query_start_loc, non_spec_state_indices_tensor,
            )  # fmt: skip
        else:
            o, final = layer.fused_sigmoid_gating_delta_rule_update(
                A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v,
                initial_state=ssm_state, inplace_final_state=True,
                cu_seqlens=non_spec_query_start_loc,
                ssm_state_indices=non_spec_state_indices_tensor, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        assert final is ssm_state and o.shape == v.shape
        rows = [t[0][:, None] for t in (q, k, v)]  # one token per row
        expected = delta_oracle(ref, slots, *rows, a[:, None], b[:, None], A_log, dt_bias, kda)
        assert rel(o[0], expected[:, 0]) < tol
        assert torch.equal(o[0, 1], torch.zeros(HV, V, dtype=dtype))
    assert_untouched(before, layer, [0, 1, 4, 5, 7, 8])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_delta_mtp_as_vllm_calls_it(kda):
    gen = torch.Generator().manual_seed(6)
    _, layer, ssm_state = gdn_setup(T, kda=kda)
    A_log, dt_bias = delta_params(gen, kda)
    slots = [5, 1, 0]
    bs = len(slots)
    spec_state_indices_tensor = torch.tensor([[s, 7, 8] for s in slots], dtype=I32)
    spec_query_start_loc = torch.arange(bs + 1, dtype=I32) * T
    num_accepted_tokens = torch.ones(bs, dtype=I32)
    ref = torch.zeros(SLOTS, HV, V, K, dtype=F64)
    before = snapshot(layer)
    for _ in range(5):
        q, k, v, a, b = delta_tokens(gen, bs * T, HV if kda else KH, kda)
        if kda:
            o, _ = layer.fused_recurrent_kda(
                q, k, v, a[None], b[None], A_log, dt_bias, -5.0, ssm_state, spec_query_start_loc,
                spec_state_indices_tensor, num_accepted_tokens=num_accepted_tokens,
            )  # fmt: skip
        else:
            o, _ = layer.fused_sigmoid_gating_delta_rule_update(
                A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v,
                initial_state=ssm_state, inplace_final_state=True,
                cu_seqlens=spec_query_start_loc, ssm_state_indices=spec_state_indices_tensor,
                num_accepted_tokens=num_accepted_tokens, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        kept = torch.randint(1, T + 1, (bs,), generator=gen, dtype=I32)
        kept[2] = 1
        # The oracle runs each row's whole window, then keeps `kept` tokens of it.
        windows = {}
        o_ref = torch.zeros(bs, T, HV, V, dtype=F64)
        for r, s in enumerate(slots):
            if s == 0:
                continue
            seq_ref = ref.clone()
            for j in range(T):
                one = [t.view(bs, T, *t.shape[2:])[r, j][None, None] for t in (q, k, v)]
                ga = a.view(bs, T, *a.shape[1:])[r, j][None, None]
                gb = b.view(bs, T, HV)[r, j][None, None]
                o_ref[r, j] = delta_oracle(seq_ref, [s], *one, ga, gb, A_log, dt_bias, kda)[0, 0]
                windows[(s, j)] = seq_ref[s].clone()
        assert rel(o[0].view(bs, T, HV, V), o_ref) < TOL
        for r, s in enumerate(slots):
            if s:
                ref[s] = windows[(s, int(kept[r]) - 1)]
        num_accepted_tokens = kept
    assert_untouched(before, layer, [0, 2, 3, 4, 6, 7, 8])


def test_gdn_packed_decode_as_vllm_calls_it():
    gen = torch.Generator().manual_seed(7)
    _, layer, ssm_state = gdn_setup()
    A_log, dt_bias = delta_params(gen)
    slots = [2, 0, 8]
    bs = len(slots)
    ref = torch.zeros(SLOTS, HV, V, K, dtype=F64)
    before = snapshot(layer)
    for _ in range(L + 2):
        q, k, v, a, b = delta_tokens(gen, bs, KH)
        # conv1d's output: [N, q | k | v] channels, then the output-gate projection beside them
        mixed_qkv = torch.cat([q[0].flatten(1), k[0].flatten(1), v[0].flatten(1),
                               torch.randn(bs, 16, generator=gen)], dim=1)[:, : 2 * KH * K + HV * V]  # fmt: skip
        out = torch.empty(bs, 1, HV, V)
        got, final = layer.fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K**-0.5,
            initial_state=ssm_state, out=out, ssm_state_indices=torch.tensor(slots, dtype=I32),
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        assert got is out and final is ssm_state
        expected = delta_oracle(ref, slots, q[0][:, None], k[0][:, None], v[0][:, None],
                                a[:, None], b[:, None], A_log, dt_bias)  # fmt: skip
        assert rel(out[:, 0], expected[:, 0]) < TOL
    assert_untouched(before, layer, [0, 1, 3, 4, 5, 6, 7])


def test_the_backend_finds_each_layer_by_its_state():
    """One ReplaySSMBackend for a model's layers: each call reaches the layer whose state it
    names, positional or keyword, as vLLM's module-level functions would be called."""
    gen = torch.Generator().manual_seed(8)
    backend = ReplaySSMBackend()
    layers = []
    for kda in (False, True):
        heads = HV if kda else KH
        layout = (kda_layout if kda else gdn_layout)(
            num_k_heads=heads, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L, act_dtype=F32
        )
        state = torch.zeros(SLOTS, HV, V, K)
        layers.append(backend.register(state, layout, **({"lower_bound": -5.0} if kda else {})))
    gdn, kda = layers
    idx, cu = torch.tensor([1, 2], dtype=I32), torch.arange(3, dtype=I32)
    q, k, v, a, b = delta_tokens(gen, 2, KH)
    A_log, dt_bias = delta_params(gen)
    _, final = backend.fused_sigmoid_gating_delta_rule_update(
        A_log, a, b, dt_bias, q, k, v, 1.0, 20.0, None, gdn.state, True, cu, idx, None, True
    )
    assert final is gdn.state and gdn.pool["cursors"][1, 0] == 1
    q, k, v, a, b = delta_tokens(gen, 2, HV, kda=True)
    A_log, dt_bias = delta_params(gen, kda=True)
    backend.fused_recurrent_kda(q, k, v, a[None], b[None], A_log, dt_bias, -5.0,
                                initial_state=kda.state, cu_seqlens=cu, ssm_state_indices=idx)  # fmt: skip
    assert kda.pool["cursors"][2, 0] == 1 and gdn.pool["cursors"][2, 0] == 1
    with pytest.raises(ValueError, match="registered with ReplaySSMBackend.register"):
        backend.fused_recurrent_kda(q, k, v, a[None], b[None], A_log, dt_bias, -5.0,
                                    torch.zeros(SLOTS, HV, V, K), cu, idx)  # fmt: skip
    with pytest.raises(ValueError, match="lower_bound: expected -5.0"):
        kda.fused_recurrent_kda(q, k, v, a[None], b[None], A_log, dt_bias, None, kda.state, cu,
                                idx)  # fmt: skip


def test_layers_sharing_one_state_tensor_share_its_rings():
    """vLLM's hybrid allocator may give two layers one tensor (disjoint blocks): one pool."""
    backend, layer, ssm_state = m2_setup()
    layout = layer.layout
    assert backend.register(ssm_state, layout, dt_softplus=True) is layer
    with pytest.raises(ValueError, match="registered with"):
        backend.register(ssm_state, layout, dt_softplus=False)


def test_mamba2_mtp_varlen_rows_as_vllm_packs_them():
    """Rows of 1..T tokens packed back to back (cu_seqlens not uniform): each row's tokens are
    verified from its state, the rest of the packed out is the engine's rows only."""
    gen = torch.Generator().manual_seed(9)
    _, layer, ssm_state = m2_setup(T)
    prm = Mamba2Params(gen)
    A_d, D_d, dt_bias_d = prm.expanded()
    slots = [4, 0, 7, 1]
    bs = len(slots)
    idx = torch.tensor([[s, 8, 8] for s in slots], dtype=I32)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    num_accepted_tokens = torch.ones(bs, dtype=I32)
    before = snapshot(layer)
    for _ in range(6):
        lengths = torch.randint(1, T + 1, (bs,), generator=gen).tolist()
        lengths[1] = 1  # the pad row
        if sum(lengths) == bs * T:
            lengths[0] = 1
        tokens = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)
        x, dt, B, C = m2_tokens(gen, tokens)
        out = torch.full((tokens, H, P), float("nan"))
        layer.selective_state_update(
            ssm_state, x, dt[:, :, None].expand(-1, -1, P), A_d, B, C, D_d, z=None,
            dt_bias=dt_bias_d, dt_softplus=True, state_batch_indices=idx,
            dst_state_batch_indices=idx, out=out, num_accepted_tokens=num_accepted_tokens,
            cu_seqlens=cu,
        )  # fmt: skip
        kept = []
        for r, s in enumerate(slots):
            a, b = int(cu[r]), int(cu[r + 1])
            if s == 0:
                assert torch.equal(out[a:b], torch.zeros(b - a, H, P))
                kept.append(1)
                continue
            st, seq = ref[s][None].clone(), []
            for j in range(a, b):
                o, st = mamba2_step(st, x[j][None], dt[j][None], prm.A, B[j][None], C[j][None],
                                    D=prm.D, dt_bias=prm.dt_bias, dt_softplus=True)  # fmt: skip
                assert rel(out[j], o[0]) < TOL
                seq.append(st[0].clone())
            n = int(torch.randint(1, b - a + 1, (1,), generator=gen))
            ref[s] = seq[n - 1]
            kept.append(n)
        num_accepted_tokens = torch.tensor(kept, dtype=I32)
    assert_untouched(before, layer, [0, 2, 3, 5, 6, 8])
