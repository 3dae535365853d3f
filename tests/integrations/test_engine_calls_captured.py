"""The adapters' captured path stays clean: under torch.compile(fullgraph=True) each engine call
traces with no graph break (the registered torch.library ops are opaque), gives the eager bits,
and an eager call makes no allocation beyond the output the engine's own kernel returns, and
no clone (of the cursor table or anything else)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replayssm_jit import gdn_layout, kda_layout, mamba2_layout
from replayssm_jit.integrations.vllm import VLLMLayer

F32, I32 = torch.float32, torch.int32
H, G, P, N = 4, 2, 8, 16
KH, HV, K, V = 2, 4, 16, 8
SLOTS, L, T, BS = 6, 4, 3, 3

pytestmark = pytest.mark.usefixtures("no_launch_env")

ALLOCATING = {"empty", "empty_like", "zeros", "zeros_like", "full", "new_empty", "new_zeros",
              "clone", "empty_strided", "ones", "arange"}  # fmt: skip


class Recorder(TorchDispatchMode):
    """The aten/custom ops an adapter calls itself (those inside an op are not seen)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def mamba2_case(drafts, lengths=None):
    gen = torch.Generator().manual_seed(21)
    layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, drafts=drafts,
                           act_dtype=F32)  # fmt: skip
    layer = VLLMLayer(layout, torch.zeros(SLOTS, H, P, N), dt_softplus=True)
    tokens = BS * drafts if lengths is None else sum(lengths)
    A = -(0.5 + torch.rand(H, generator=gen))
    args = dict(
        x=torch.randn(tokens, H, P, generator=gen),
        dt=torch.rand(tokens, H, generator=gen)[:, :, None].expand(-1, -1, P),
        A=A[:, None, None].expand(-1, P, N), B=torch.randn(tokens, G, N, generator=gen),
        C=torch.randn(tokens, G, N, generator=gen), D=torch.randn(H)[:, None].expand(-1, P),
        dt_bias=torch.rand(H)[:, None].expand(-1, P),
    )  # fmt: skip
    idx = torch.tensor([[1, 4, 5], [0, 0, 0], [3, 4, 5]], dtype=I32)
    idx = idx if drafts > 1 else idx[:, 0].contiguous()  # [bs, 1 + T] for MTP, else [bs]
    extra = {}
    if drafts > 1:
        cu = torch.arange(BS + 1, dtype=I32) * drafts
        if lengths is not None:  # varlen rows: fewer tokens than T in some
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)
        extra = dict(num_accepted_tokens=torch.ones(BS, dtype=I32), cu_seqlens=cu)

    def call(layer, out):
        layer.ssu(layer.state, args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"],
                  args["dt_bias"], z=None, dt_softplus=True,
                  state_batch_indices=idx, out=out, **extra)  # fmt: skip
        return out

    return layer, lambda: torch.empty(tokens, H, P), call, BS


def delta_case(kind, lengths=None):
    """GDN / KDA one-token calls, or MTP varlen rows of `lengths` tokens."""
    gen = torch.Generator().manual_seed(22)
    kda = kind == "kda"
    heads = HV if kda else KH
    make = kda_layout if kda else gdn_layout
    drafts = 1 if lengths is None else T
    layout = make(num_k_heads=heads, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                  drafts=drafts, act_dtype=F32)  # fmt: skip
    options = {"lower_bound": -5.0} if kda else {}
    layer = VLLMLayer(layout, torch.zeros(SLOTS, HV, V, K), **options)
    n = BS if lengths is None else sum(lengths)
    q, k = torch.randn(1, n, heads, K, generator=gen), torch.randn(1, n, heads, K, generator=gen)
    v = torch.randn(1, n, HV, V, generator=gen)
    a = torch.randn(n, HV, *((K,) if kda else ()), generator=gen)
    b = torch.randn(n, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV) - 1.0, torch.randn(HV * K if kda else HV)
    idx, cu = torch.tensor([2, 0, 5], dtype=I32), torch.arange(BS + 1, dtype=I32)
    extra = {}
    if lengths is not None:
        idx = torch.tensor([[2, 1, 1], [0, 0, 0], [5, 1, 1]], dtype=I32)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)
        extra = {"num_accepted_tokens": torch.ones(BS, dtype=I32)}

    def call(layer, out):
        if kind == "gdn":
            o, _ = layer.fused_sigmoid_gating_delta_rule_update(
                A_log, a, b, dt_bias, q, k, v, initial_state=layer.state, cu_seqlens=cu,
                ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, **extra,
            )  # fmt: skip
            return o
        if kind == "kda":
            o, _ = layer.fused_recurrent_kda(q, k, v, a[None], b[None], A_log, dt_bias, -5.0,
                                             layer.state, cu, idx, out=out, **extra)  # fmt: skip
            return o
        mixed = torch.cat([q[0].flatten(1), k[0].flatten(1), v[0].flatten(1)], 1)
        o, _ = layer.fused_recurrent_gated_delta_rule_packed_decode(
            mixed, a, b, A_log, dt_bias, K**-0.5, layer.state, out, idx, True
        )  # fmt: skip
        return o

    return layer, lambda: torch.empty(1, n, HV, V), call, BS


def sglang_tree_case(family):
    """SGLang's tree verify (Mamba-2 selective_state_update, GDN target_verify) and its commit."""
    from replayssm_jit.integrations.sglang import SGLangLayer

    gen = torch.Generator().manual_seed(23)
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1], [-1, -1, 1]])
    last = torch.tensor([2, 1, -1])
    slots = torch.tensor([1, 3, -1], dtype=I32)
    if family == "mamba2":
        layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, drafts=T,
                               act_dtype=F32)  # fmt: skip
        layer = SGLangLayer(layout, torch.zeros(SLOTS, H, P, N), max_batch=BS, dt_softplus=True)
        x = torch.randn(BS, T, H, P, generator=gen)
        dt = torch.rand(BS * T, H, generator=gen)[:, :, None].expand(-1, -1, P).view(BS, T, H, P)
        BC = torch.randn(2, BS, T, G, N, generator=gen)
        A = (-0.5 - torch.rand(H, 1, 1, generator=gen)).expand(H, P, N)
        D, dt_bias = torch.ones(H, 1).expand(H, P), torch.zeros(H, 1).expand(H, P)

        def call(layer, out):
            layer.selective_state_update(
                layer.state, x, dt, A, BC[0], BC[1], D, z=None, dt_bias=dt_bias, dt_softplus=True,
                state_batch_indices=slots, out=out, disable_state_update=True,
                intermediate_states_buffer=None, cache_steps=T, retrieve_parent_token=parents,
            )  # fmt: skip
            layer.update_mamba_state_after_mtp_verify(last, None, None, None)
            return out

        return layer, lambda: torch.empty(BS, T, H, P), call, BS
    layout = gdn_layout(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                        drafts=T, act_dtype=F32)  # fmt: skip
    layer = SGLangLayer(layout, torch.zeros(SLOTS, HV, V, K), max_batch=BS)
    qk = torch.randn(2, 1, BS * T, KH, K, generator=gen)
    v = torch.randn(1, BS * T, HV, V, generator=gen)
    ab = torch.randn(2, BS * T, HV, generator=gen)
    cu = torch.arange(0, BS * T + 1, T, dtype=I32)
    A_log, dt_bias = torch.rand(HV, generator=gen) - 1.0, torch.zeros(HV)

    def call(layer, out):
        o = layer.target_verify(A_log, dt_bias, qk[0], qk[1], v, ab[0],
                                ab[1], ssm_states=layer.state, cache_indices=slots,
                                query_start_loc=cu, cache_steps=T,
                                retrieve_parent_token=parents)  # fmt: skip
        layer.update_mamba_state_after_mtp_verify(last, None, None, None)
        return o

    return layer, lambda: torch.empty(1, BS * T, HV, V), call, BS


def sglang_track_case(family):
    """SGLang's decode with prefix tracking: mamba_track_mask on a track_prefix layer."""
    from replayssm_jit.integrations.sglang import SGLangLayer

    gen = torch.Generator().manual_seed(24)
    slots = torch.tensor([1, 3, -1], dtype=I32)
    mask = torch.tensor([True, False, False])
    if family == "mamba2":
        layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L,
                               act_dtype=F32)  # fmt: skip
        layer = SGLangLayer(layout, torch.zeros(SLOTS, H, P, N), max_batch=BS, track_prefix=True,
                            dt_softplus=True)  # fmt: skip
        x = torch.randn(BS, H, P, generator=gen)
        dt = torch.rand(BS, H, generator=gen)[:, :, None].expand(-1, -1, P)
        BC = torch.randn(2, BS, G, N, generator=gen)
        A = (-0.5 - torch.rand(H, 1, 1, generator=gen)).expand(H, P, N)
        D, dt_bias = torch.ones(H, 1).expand(H, P), torch.zeros(H, 1).expand(H, P)

        def call(layer, out):
            layer.selective_state_update(
                layer.state, x, dt, A, BC[0], BC[1], D, z=None, dt_bias=dt_bias, dt_softplus=True,
                state_batch_indices=slots.unsqueeze(-1), out=out, mamba_track_mask=mask,
            )  # fmt: skip
            return out

        return layer, lambda: torch.empty(BS, H, P), call, BS
    layout = gdn_layout(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                        act_dtype=F32)  # fmt: skip
    layer = SGLangLayer(layout, torch.zeros(SLOTS, HV, V, K), max_batch=BS, track_prefix=True)
    qk = torch.randn(2, 1, BS, KH, K, generator=gen)
    v = torch.randn(1, BS, HV, V, generator=gen)
    ab = torch.randn(2, BS, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV, generator=gen) - 1.0, torch.zeros(HV)
    cu = torch.arange(BS + 1, dtype=I32)

    def call(layer, out):
        return layer.decode(qk[0], qk[1], v, ab[0], ab[1], A_log=A_log, dt_bias=dt_bias,
                            ssm_states=layer.state, cache_indices=slots,
                            query_start_loc=cu, mamba_track_mask=mask)  # fmt: skip

    return layer, lambda: torch.empty(1, BS, HV, V), call, BS


CASES = {
    "mamba2": lambda: mamba2_case(1), "mamba2_mtp": lambda: mamba2_case(T),
    "mamba2_mtp_varlen": lambda: mamba2_case(T, [3, 1, 2]),
    "gdn": lambda: delta_case("gdn"), "gdn_packed": lambda: delta_case("packed"),
    "kda": lambda: delta_case("kda"),
    "gdn_mtp_varlen": lambda: delta_case("gdn", [3, 1, 2]),
    "kda_mtp_varlen": lambda: delta_case("kda", [2, 1, 3]),
    "sglang_mamba2_tree": lambda: sglang_tree_case("mamba2"),
    "sglang_gdn_tree": lambda: sglang_tree_case("gdn"),
    "sglang_mamba2_track": lambda: sglang_track_case("mamba2"),
    "sglang_gdn_track": lambda: sglang_track_case("gdn"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_graph_break_and_the_eager_bits(case):
    eager_layer, new_out, call, bs = CASES[case]()
    compiled_layer, *_ = CASES[case]()
    explained_layer, *_ = CASES[case]()  # (explain runs the call: a layer of its own)
    for layer in (eager_layer, compiled_layer, explained_layer):
        layer.prepare(bs)  # plans are made before capture, as for a CUDA graph
    explained = torch._dynamo.explain(call)(explained_layer, new_out())
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="eager")
    for _ in range(L + 1):
        want = call(eager_layer, new_out())
        got = compiled(compiled_layer, new_out())
        assert torch.equal(want, got)
    for name, t in eager_layer.pool.items():
        assert torch.equal(t, compiled_layer.pool[name]), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_allocation_and_no_clone_per_call(case):
    layer, new_out, call, bs = CASES[case]()
    layer.prepare(bs)
    out = new_out()
    call(layer, out)  # (a first call may plan; the steady state is what a graph replays)
    with Recorder() as rec:
        call(layer, out)
    made = [op for op in rec.ops if op in ALLOCATING]
    # Only the GDN calls whose engine signature takes no out allocate the returned o.
    allocates = case in ("gdn", "gdn_mtp_varlen", "sglang_gdn_tree", "sglang_gdn_track")
    assert made == (["empty"] if allocates else []), rec.ops
