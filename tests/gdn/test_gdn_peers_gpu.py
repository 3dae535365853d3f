"""Cross-check our GDN kernels against peers (run on the H200; skipped without CUDA):

* fla-core's `fused_recurrent_gated_delta_rule` (Triton, conventional), with the state pool
  gathered into its per-sequence initial_state and its final_state scattered back;
* HF transformers' Qwen3-Next decode path (`torch_recurrent_gated_delta_rule`), teacher-forced
  (tests/support/hf_gdn.py; the float64 reference meets the same check on the CPU in test_gdn_cpu.py).
"""

import inspect

import pytest
import torch
from support import delta_gpu, hf_gdn
from support.checks import rel_err

from replayssm_jit import GDNDecodeCache, GDNDecodeWrapper
from replayssm_jit.reference import gdn_gates, gdn_step_pool

pytestmark = pytest.mark.gpu


def fla_step(fn, q, k, v, h0, *, gates, scale):
    """One fla decode step for every row: q, k [B, H, K], v [B, HV, V], h0 [B, HV, V, K] fp32.

    gates: ("raw", a, b, A_log, dt_bias) or ("g", g, beta). Returns (o [B, HV, V], h [B, HV, V, K]).
    fla keeps [B, HV, K, V] unless the installed version offers state_v_first (ours: [V, K]).
    """
    v_first = "state_v_first" in inspect.signature(fn).parameters
    if gates[0] == "raw":
        _, a, b, A_log, dt_bias = gates
        kw = dict(
            g=a[:, None],
            beta=b[:, None],
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True,
        )
    else:
        _, g, beta = gates
        kw = dict(g=g[:, None], beta=beta[:, None])
    if v_first:
        kw["state_v_first"] = True
    o, h = fn(
        q[:, None],
        k[:, None],
        v[:, None],
        scale=scale,
        initial_state=h0 if v_first else h0.transpose(-1, -2).contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **kw,
    )
    return o[:, 0], (h if v_first else h.transpose(-1, -2))


@pytest.mark.parametrize(
    "act, mode, gates_in_kernel",
    [
        (torch.bfloat16, "conventional", True),  # what engines run
        (torch.float32, "replay", False),  # L = 16, 16 steps: the last one flushes
    ],
    ids=["bf16-conventional-gates_in_kernel", "f32-replay-precomputed_gates"],
)
def test_matches_fla_fused_recurrent(act, mode, gates_in_kernel):
    fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule")
    fn = fla_gdr.fused_recurrent_gated_delta_rule
    H, HV, K, V, batch, num_slots, window = 16, 32, 128, 128, 16, 40, 16
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = GDNDecodeCache(
        num_slots,
        num_k_heads=H,
        num_v_heads=HV,
        head_k_dim=K,
        head_v_dim=V,
        window=window,
        act_dtype=act,
        device="cuda",
    )
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen, device="cuda"))
    fla_pool = cache.state.clone()
    ref_pool = cache.state.double()
    idx = torch.randperm(num_slots, generator=gen, device="cuda")[:batch].to(torch.int32)
    A_log = torch.log(0.5 + torch.rand(HV, generator=gen, device="cuda"))
    dt_bias = 0.5 * torch.rand(HV, generator=gen, device="cuda") - 0.25
    ours = GDNDecodeWrapper(cache, mode=mode)
    ours.plan(batch, gates_in_kernel=gates_in_kernel)
    peer_tol, slack = (1e-2, 1e-3) if act == torch.bfloat16 else (1e-4, 1e-6)
    for step in range(window):
        q = torch.randn(batch, H, K, generator=gen, device="cuda").to(act)
        k = torch.randn(batch, H, K, generator=gen, device="cuda").to(act)
        v = torch.randn(batch, HV, V, generator=gen, device="cuda").to(act)
        a = -4.0 + 3.0 * torch.rand(batch, HV, generator=gen, device="cuda")
        b = torch.randn(batch, HV, generator=gen, device="cuda")
        g, beta = gdn_gates(A_log, a, dt_bias, b)
        if gates_in_kernel:
            gates, peer_gates = (
                dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias),
                ("raw", a, b, A_log, dt_bias),
            )
        else:
            g, beta = g.float(), beta.float()
            gates, peer_gates = dict(g=g, beta=beta), ("g", g, beta)
        y_ours = torch.full((batch, HV, V), float("nan"), dtype=act, device="cuda")
        ours.run(q, k, v, idx, out=y_ours, **gates)
        y_fla, h = fla_step(fn, q, k, v, fla_pool[idx.long()], gates=peer_gates, scale=K**-0.5)
        fla_pool[idx.long()] = h.to(fla_pool.dtype)
        y_ref = gdn_step_pool(ref_pool, idx, q, k, v, g, beta)
        delta_gpu.check_against_peer(step, y_ours, y_fla, y_ref, peer_tol, slack)
    torch.cuda.synchronize()
    assert cache.cursors[idx.long(), 0].eq(0).all(), "the 16th step flushed"
    print(
        f"\nstate vs fla {rel_err(cache.state, fla_pool):.2e}, vs reference {rel_err(cache.state, ref_pool):.2e}"
    )
    assert rel_err(cache.state, fla_pool) < 1e-5
    assert rel_err(cache.state, ref_pool) < 1e-5


@pytest.mark.parametrize(
    "mode, gates_in_kernel", [("conventional", True), ("replay", True), ("replay", False)]
)
def test_matches_hf_qwen3_next_decode(mode, gates_in_kernel):
    """Teacher-forced: HF's decode outputs and states, token by token, from the same inputs."""
    H, HV, K, V, batch, window = 4, 8, 64, 64, 3, 16
    tokens = 2 * window
    case = hf_gdn.teacher_forced(H=H, HV=HV, K=K, V=V, batch=batch, tokens=tokens, seed=5)
    case = {name: t.cuda() for name, t in case.items()}
    cache = GDNDecodeCache(
        batch + 2,
        num_k_heads=H,
        num_v_heads=HV,
        head_k_dim=K,
        head_v_dim=V,
        window=window,
        act_dtype=torch.float32,
        device="cuda",
    )
    slots = cache.allocate(batch)
    cache.reset(slots, case["state0"])
    w = GDNDecodeWrapper(cache, mode=mode)
    w.plan(batch, gates_in_kernel=gates_in_kernel)
    for t in range(tokens):
        q, k, v = (case[name][:, t].contiguous() for name in ("q", "k", "v"))
        if gates_in_kernel:
            gates = dict(
                a=case["a"][:, t].contiguous(),
                b=case["b"][:, t].contiguous(),
                A_log=case["A_log"],
                dt_bias=case["dt_bias"],
            )
        else:
            gates = dict(g=case["g"][:, t].contiguous(), beta=case["beta"][:, t].contiguous())
        out = w.run(q, k, v, slots, **gates)
        assert rel_err(out, case["out"][:, t]) < 1e-5, t
        if mode == "conventional" or (t + 1) % window == 0:
            assert rel_err(cache.state[slots.long()], case["states"][t]) < 1e-5, t
