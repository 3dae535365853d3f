"""Teacher-forced GDN decode of a tiny random-weight HF transformers Qwen3-Next layer.

The layer (its input projections, head ordering and causal conv) turns random hidden states
into q, k, v, a, b; HF's own single-token decode function, `torch_recurrent_gated_delta_rule`
(the pure-torch path Qwen3NextGatedDeltaNet.forward calls on one cached token), then runs them
token by token from a random state. Tests feed the same q, k, v, g, beta (or a, b with A_log,
dt_bias) to our reference or kernels and compare every output and state.

transformers is optional (the `test` extra); callers skip when it is absent. Newer transformers
wrap that function to dispatch to fla or hub kernels when installed; we unwrap it, so the pure
torch path always runs (on the CPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from replayssm_jit.reference import gdn_gates


def qwen3_next_layer(*, H: int, HV: int, K: int, V: int, seed: int):
    """A Qwen3NextGatedDeltaNet with random weights and realistic gate parameters."""
    pytest.importorskip("transformers")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next

    config = Qwen3NextConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=H,
        linear_num_value_heads=HV,
        linear_key_head_dim=K,
        linear_value_head_dim=V,
        moe_intermediate_size=32,
        num_experts=2,
    )
    torch.manual_seed(seed)
    layer = modeling_qwen3_next.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # decays exp(g) mostly in ~[0.5, 1): the checkpoint stays visible
        layer.A_log.copy_(torch.log(0.5 + torch.rand(HV)))
        layer.dt_bias.copy_(torch.rand(HV) - 2.0)
    return layer, modeling_qwen3_next


@torch.no_grad()
def teacher_forced(*, H: int, HV: int, K: int, V: int, batch: int, tokens: int, seed: int = 0):
    """Inputs and HF's outputs/states for `tokens` decode steps of `batch` sequences (CPU, fp32).

    Returns a dict: q, k [batch, tokens, H, K]; v [batch, tokens, HV, V]; a, b, g, beta
    [batch, tokens, HV] (g, beta from a, b through gdn_gates, rounded to fp32); A_log, dt_bias
    [HV]; state0 [batch, HV, V, K] (our layout); out [batch, tokens, HV, V] and states
    [tokens, batch, HV, V, K] (HF's, transposed to our layout).
    """
    layer, modeling = qwen3_next_layer(H=H, HV=HV, K=K, V=V, seed=seed)
    # Newer transformers wrap it to dispatch to fla/hub kernels when installed: take the torch path.
    hf_step = inspect.unwrap(modeling.torch_recurrent_gated_delta_rule)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(batch, tokens, layer.hidden_size, generator=gen)
    q, k, v, _, b, a = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden)
    )
    # The layer's short causal depthwise conv + activation over the token axis, as in prefill.
    mixed = torch.cat([t.reshape(batch, tokens, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
    mixed = F.silu(layer.conv1d(mixed)[..., :tokens]).transpose(1, 2)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    q, k = q.reshape(batch, tokens, H, K), k.reshape(batch, tokens, H, K)
    v = v.reshape(batch, tokens, HV, V)
    a, b = a.contiguous(), b.contiguous()
    A_log, dt_bias = layer.A_log.detach().clone(), layer.dt_bias.detach().clone()
    g, beta = (t.float() for t in gdn_gates(A_log, a, dt_bias, b))

    state0 = 0.5 * torch.randn(batch, HV, V, K, generator=gen)
    hf_state = state0.transpose(-1, -2).contiguous()  # HF keeps [batch, HV, K, V]
    # Value head hv reads key head hv // (HV // H). Some transformers versions expand q, k in
    # the layer's forward rather than in this function: expand them here the same way.
    q_hv, k_hv = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    outs, states = [], []
    for t in range(tokens):
        o, hf_state = hf_step(
            q_hv[:, t : t + 1],
            k_hv[:, t : t + 1],
            v[:, t : t + 1],
            g=g[:, t : t + 1],
            beta=beta[:, t : t + 1],
            initial_state=hf_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(o[:, 0])
        states.append(hf_state.transpose(-1, -2).contiguous())
    return dict(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        a=a,
        b=b,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        state0=state0,
        out=torch.stack(outs, dim=1),
        states=torch.stack(states),
    )
