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


def delta_case(kind):
    gen = torch.Generator().manual_seed(22)
    kda = kind == "kda"
    heads = HV if kda else KH
    make = kda_layout if kda else gdn_layout
    layout = make(num_k_heads=heads, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                  act_dtype=F32)  # fmt: skip
    options = {"lower_bound": -5.0} if kda else {}
    layer = VLLMLayer(layout, torch.zeros(SLOTS, HV, V, K), **options)
    q, k = torch.randn(1, BS, heads, K, generator=gen), torch.randn(1, BS, heads, K, generator=gen)
    v = torch.randn(1, BS, HV, V, generator=gen)
    a = torch.randn(BS, HV, *((K,) if kda else ()), generator=gen)
    b = torch.randn(BS, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV) - 1.0, torch.randn(HV * K if kda else HV)
    idx, cu = torch.tensor([2, 0, 5], dtype=I32), torch.arange(BS + 1, dtype=I32)

    def call(layer, out):
        if kind == "gdn":
            o, _ = layer.fused_sigmoid_gating_delta_rule_update(
                A_log, a, b, dt_bias, q, k, v, initial_state=layer.state, cu_seqlens=cu,
                ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            return o
        if kind == "kda":
            o, _ = layer.fused_recurrent_kda(q, k, v, a[None], b[None], A_log, dt_bias, -5.0,
                                             layer.state, cu, idx, out=out)  # fmt: skip
            return o
        mixed = torch.cat([q[0].flatten(1), k[0].flatten(1), v[0].flatten(1)], 1)
        o, _ = layer.fused_recurrent_gated_delta_rule_packed_decode(
            mixed, a, b, A_log, dt_bias, K**-0.5, layer.state, out, idx, True
        )  # fmt: skip
        return o

    return layer, lambda: torch.empty(1, BS, HV, V), call, BS


CASES = {
    "mamba2": lambda: mamba2_case(1), "mamba2_mtp": lambda: mamba2_case(T),
    "mamba2_mtp_varlen": lambda: mamba2_case(T, [3, 1, 2]),
    "gdn": lambda: delta_case("gdn"), "gdn_packed": lambda: delta_case("packed"),
    "kda": lambda: delta_case("kda"),
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
    # Only the GDN call, whose engine signature takes no out, allocates its returned o.
    assert made == (["empty"] if case == "gdn" else []), rec.ops
