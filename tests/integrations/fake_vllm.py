"""A stand-in for the parts of vLLM the plugin touches, written from reading vLLM's code (never
copied; docs/integrations.md lists the files and commits): the module names, the names each
module binds, the layer classes' registration (PluggableLayer.register / register_oot and its
__new__, keyed by class name), the forward context's per-layer metadata, and the GDN (Qwen)
and KDA (Kimi-Linear) layers' and Mamba-2 mixer's core methods reduced to their state
traffic, with ssu_dispatch dispatching Mamba-2's decode to its backend registry. Each layer
declares its per-block state entries as vLLM's MambaStateShapeCalculator / DtypeCalculator give
them (get_state_shape, get_state_dtype: conv state (d_conv - 1 + num_spec, conv_dim), then the
SSM state; tensor parallelism 1), which fake_vllm_runner.py allocates as vLLM's runner does. The
causal conv is left out (the plugin never sees it): q, k, v arrive post-conv. The prefill kernels are float64
references that return a final state, which the layer writes into ssm_state[idx] as vLLM does;
the decode kernels are vLLM's only until the plugin rebinds them, and here raise if reached.
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass

import torch

from replayssm_jit.reference import gdn_gates, kda_gates
from replayssm_jit.reference.gdn import gdn_step
from replayssm_jit.reference.kda import kda_step
from replayssm_jit.reference.mamba2 import mamba2_step

M2 = "vllm.model_executor.layers.mamba.mamba2.mamba_mixer2"
GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
KDA = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
SSU = "vllm.model_executor.layers.mamba.ops.ssu_dispatch"
MAMBA_UTILS = "vllm.model_executor.layers.mamba.mamba_utils"
PACKAGES = ("vllm", "vllm.config", "vllm.config.mamba", "vllm.model_executor",
            "vllm.model_executor.layers", "vllm.model_executor.layers.mamba",
            "vllm.model_executor.layers.mamba.ops", "vllm.model_executor.layers.mamba.gdn",
            "vllm.model_executor.layers.mamba.mamba2", "vllm.model_executor.custom_op",
            "vllm.forward_context", SSU, M2, GDN, KDA, MAMBA_UTILS)  # fmt: skip


class EngineKernelReached(AssertionError):
    """vLLM's own decode kernel was called (it is a Triton kernel; here a tripwire)."""


def _tripwire(name):
    def kernel(*args, **kwargs):
        raise EngineKernelReached(name)

    kernel.__name__ = name
    return kernel


# -- the configs a layer reads, and its state entries (mamba_utils.py's calculators) ---------

CONV_KERNEL = 4


@dataclass
class ModelConfig:
    dtype: torch.dtype = torch.float32


@dataclass
class CacheConfig:
    mamba_ssm_cache_dtype: str = "auto"
    mamba_page_size_padded: int | None = None


def state_dtypes(model_config, cache_config, kda=False):
    """(conv, SSM state) dtypes: the model's, the SSM state's "auto" too (KDA's float32)."""
    ssm = model_config.dtype if cache_config.mamba_ssm_cache_dtype == "auto" else torch.float32
    return model_config.dtype, torch.float32 if kda else ssm


def state_shapes(conv_dim, state, num_spec):
    """(conv state (state_len, dim): vLLM's default "SD" layout, SSM state)."""
    return (CONV_KERNEL - 1 + num_spec, conv_dim), tuple(state)


class StateEntries:
    """What MambaBase declares: entries per block, and the configs they come from."""

    def _configs(self, model_config, cache_config):
        self.model_config = model_config or ModelConfig()
        self.cache_config = cache_config or CacheConfig()
        self.tp_size = 1
        self.kv_cache = (torch.empty(0), torch.empty(0))


# -- vllm.model_executor.custom_op ------------------------------------------------------------


def custom_op_module():
    mod = types.ModuleType("vllm.model_executor.custom_op")
    mod.op_registry, mod.op_registry_oot = {}, {}

    class PluggableLayer(torch.nn.Module):
        def __new__(cls, *args, **kwargs):
            target = mod.op_registry_oot.get(cls.__name__, cls)
            return super().__new__(target)

        @classmethod
        def register(cls, name):
            def decorator(layer_cls):
                assert name not in mod.op_registry, name
                layer_cls.name = name
                mod.op_registry[name] = layer_cls
                return layer_cls

            return decorator

        @classmethod
        def register_oot(cls, _decorated=None, name=None):
            def decorator(layer_cls):
                key = name if name is not None else cls.__name__
                assert key not in mod.op_registry_oot, f"Duplicate layer name: {key}"
                layer_cls.name = key
                mod.op_registry_oot[key] = layer_cls
                return layer_cls

            return decorator if _decorated is None else decorator(_decorated)

    mod.PluggableLayer = PluggableLayer
    return mod


# -- vllm.forward_context ---------------------------------------------------------------------


@dataclass
class ForwardContext:
    attn_metadata: object = None


def forward_context_module():
    mod = types.ModuleType("vllm.forward_context")
    mod.ForwardContext = ForwardContext
    mod._current = ForwardContext()
    mod.get_forward_context = lambda: mod._current
    return mod


@dataclass
class GDNAttentionMetadata:
    """The fields the GDN / KDA cores read (v1/attention/backends/gdn_attn.py), non-spec only:
    decodes first, then prefills."""

    num_prefills: int
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None
    non_spec_query_start_loc: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor
    prefill_state_indices: torch.Tensor | None = None
    prefill_has_initial_state: torch.Tensor | None = None
    prefill_query_start_loc: torch.Tensor | None = None
    spec_sequence_masks: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None
    num_spec_decodes: int = 0
    spec_state_indices_tensor: torch.Tensor | None = None
    spec_query_start_loc: torch.Tensor | None = None


# -- float64 prefill kernels (the chunk kernels' results, not their algorithm) ----------------


def _prefill(q, k, v, gates, initial_state, cu_seqlens, kda):
    """Per sequence of cu_seqlens: the delta rule token by token from initial_state[i];
    returns (o [1, T, HV, V] in v's dtype, final states float32)."""
    o = torch.zeros(v.shape, dtype=torch.float64)
    finals = []
    step = kda_step if kda else gdn_step
    for i, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        st = initial_state[i][None].to(torch.float64)
        for t in range(s, e):
            g, beta = gates(t)
            o_t, st = step(st, q[0, t][None], k[0, t][None], v[0, t][None], g, beta)
            o[0, t] = o_t[0]
        finals.append(st[0])
    return o.to(v.dtype), torch.stack(finals).to(torch.float32)


# -- gdn/qwen_gdn_linear_attn.py --------------------------------------------------------------


def gdn_module(custom_op, forward_context):
    mod = types.ModuleType(GDN)
    mod.fused_sigmoid_gating_delta_rule_update = _tripwire("fused_sigmoid_gating_delta_rule_update")
    mod.fused_recurrent_gated_delta_rule_packed_decode = _tripwire(
        "fused_recurrent_gated_delta_rule_packed_decode"
    )
    mod.prefill_calls = []

    def fla_chunk_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state,
                                   cu_seqlens=None, chunk_indices=None, chunk_offsets=None,
                                   use_qk_l2norm_in_kernel=True, core_attn_out=None):  # fmt: skip
        mod.prefill_calls.append(cu_seqlens.clone())
        return _prefill(q, k, v, lambda t: (g[0, t][None], beta[0, t][None]), initial_state,
                        cu_seqlens, kda=False)  # fmt: skip

    mod.fla_chunk_gated_delta_rule = fla_chunk_gated_delta_rule

    @custom_op.PluggableLayer.register("qwen_gated_delta_net_attention")
    class QwenGatedDeltaNetAttention(custom_op.PluggableLayer, StateEntries):
        def __init__(self, prefix, num_k_heads, num_v_heads, head_k_dim, head_v_dim, A_log,
                     dt_bias, num_spec=0, packed_decode=False, model_config=None,
                     cache_config=None):  # fmt: skip
            super().__init__()
            self.prefix, self.num_spec = prefix, num_spec
            self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
            self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
            self.A_log, self.dt_bias = A_log, dt_bias
            self.enable_packed_recurrent_decode = packed_decode
            self._configs(model_config, cache_config)

        def get_state_shape(self):
            conv_dim = 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
            state = (self.num_v_heads, self.head_v_dim, self.head_k_dim)
            return state_shapes(conv_dim // self.tp_size, state, self.num_spec)

        def get_state_dtype(self):
            return state_dtypes(self.model_config, self.cache_config)

        def rearrange_mixed_qkv(self, mixed_qkv):
            n, kd = mixed_qkv.shape[0], self.num_k_heads * self.head_k_dim
            q, k, v = mixed_qkv.split([kd, kd, self.num_v_heads * self.head_v_dim], dim=-1)
            return (q.reshape(1, n, -1, self.head_k_dim), k.reshape(1, n, -1, self.head_k_dim),
                    v.reshape(1, n, -1, self.head_v_dim))  # fmt: skip

        def _forward_core(self, mixed_qkv, b, a, core_attn_out):
            md = forward_context.get_forward_context().attn_metadata[self.prefix]
            ssm_state, n = self.kv_cache[1], md.num_actual_tokens
            indices = md.non_spec_state_indices_tensor
            if md.spec_sequence_masks is not None:  # MTP: every row a spec row here
                q, k, v = self.rearrange_mixed_qkv(mixed_qkv[:n])
                o, _ = mod.fused_sigmoid_gating_delta_rule_update(
                    A_log=self.A_log, a=a[:n], b=b[:n], dt_bias=self.dt_bias, q=q, k=k, v=v,
                    initial_state=ssm_state, inplace_final_state=True,
                    cu_seqlens=md.spec_query_start_loc[: md.num_spec_decodes + 1],
                    ssm_state_indices=md.spec_state_indices_tensor,
                    num_accepted_tokens=md.num_accepted_tokens, use_qk_l2norm_in_kernel=True,
                )  # fmt: skip
                core_attn_out[:n] = o[0]
                return
            if self.enable_packed_recurrent_decode and md.num_prefills == 0 and md.num_decodes:
                mod.fused_recurrent_gated_delta_rule_packed_decode(
                    mixed_qkv=mixed_qkv[:n], a=a[:n], b=b[:n], A_log=self.A_log,
                    dt_bias=self.dt_bias, scale=self.head_k_dim**-0.5, initial_state=ssm_state,
                    out=core_attn_out[:n].unsqueeze(1), ssm_state_indices=indices[:n],
                    use_qk_l2norm_in_kernel=True,
                )  # fmt: skip
                return
            nd = md.num_decode_tokens
            if md.num_decodes:  # decodes peeled off a mixed batch, or a decode-only batch
                q, k, v = self.rearrange_mixed_qkv(mixed_qkv[:nd])
                o, _ = mod.fused_sigmoid_gating_delta_rule_update(
                    A_log=self.A_log, a=a[:nd], b=b[:nd], dt_bias=self.dt_bias, q=q, k=k, v=v,
                    initial_state=ssm_state, inplace_final_state=True,
                    cu_seqlens=md.non_spec_query_start_loc[: md.num_decodes + 1],
                    ssm_state_indices=indices, use_qk_l2norm_in_kernel=True,
                )  # fmt: skip
                core_attn_out[:nd] = o[0]
            if md.num_prefills:
                q, k, v = self.rearrange_mixed_qkv(mixed_qkv[nd:n])
                g, beta = gdn_gates(self.A_log, a[nd:n], self.dt_bias, b[nd:n])
                q, k = (torch.nn.functional.normalize(t.double(), dim=-1).to(t.dtype)
                        for t in (q, k))  # fused_post_conv_prep's l2norm  # fmt: skip
                initial_state = ssm_state[md.prefill_state_indices]
                initial_state[~md.prefill_has_initial_state, ...] = 0
                o, last = mod.fla_chunk_gated_delta_rule(
                    q=q, k=k, v=v, g=g[None], beta=beta[None], initial_state=initial_state,
                    output_final_state=True, cu_seqlens=md.prefill_query_start_loc,
                    use_qk_l2norm_in_kernel=False,
                )  # fmt: skip
                ssm_state[md.prefill_state_indices] = last.to(ssm_state.dtype)
                core_attn_out[nd:n] = o[0]

    mod.QwenGatedDeltaNetAttention = QwenGatedDeltaNetAttention
    return mod


# -- gdn/kimi_gdn_linear_attn.py --------------------------------------------------------------


def kda_module(custom_op, forward_context, lower_bound):
    mod = types.ModuleType(KDA)
    mod.fused_recurrent_kda = _tripwire("fused_recurrent_kda")
    mod.prefill_calls = []

    def fused_kda_gate(g1, A_log, head_dim, g_bias=None, lower_bound=None):
        g, _ = kda_gates(A_log.reshape(-1), g1.unflatten(-1, (-1, head_dim)), g_bias,
                         torch.zeros(g1.shape[0], A_log.numel()), lower_bound)  # fmt: skip
        return g.to(torch.float32)

    def chunk_kda_with_fused_gate(q, k, v, raw_g, beta, A_log, g_bias, scale=None,
                                  initial_state=None, output_final_state=False, lower_bound=None,
                                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):  # fmt: skip
        mod.prefill_calls.append(cu_seqlens.clone())
        g = fused_kda_gate(raw_g[0].flatten(-2), A_log, q.shape[-1], g_bias, lower_bound)
        return _prefill(q, k, v, lambda t: (g[t][None], beta[0, t][None]), initial_state,
                        cu_seqlens, kda=True)  # fmt: skip

    mod.fused_kda_gate, mod.chunk_kda_with_fused_gate = fused_kda_gate, chunk_kda_with_fused_gate

    @custom_op.PluggableLayer.register("kimi_gated_delta_net_attention")
    class KimiGatedDeltaNetAttention(custom_op.PluggableLayer, StateEntries):
        def __init__(self, prefix, num_heads, head_dim, A_log, dt_bias, num_spec=0,
                     model_config=None, cache_config=None):  # fmt: skip
            super().__init__()
            self.prefix, self.num_spec = prefix, num_spec
            self.num_heads, self.local_num_heads, self.head_dim = num_heads, num_heads, head_dim
            self.A_log, self.dt_bias = A_log, dt_bias
            self.gate_lower_bound = lower_bound
            self._configs(model_config, cache_config)

        def get_state_shape(self):
            conv_dim = 3 * self.num_heads * self.head_dim  # q, k, v projections
            state = (self.num_heads // self.tp_size, self.head_dim, self.head_dim)
            return state_shapes(conv_dim // self.tp_size, state, self.num_spec)

        def get_state_dtype(self):
            return state_dtypes(self.model_config, self.cache_config, kda=True)

        def _forward(self, q_proj_states, k_proj_states, v_proj_states, g1, beta, core_attn_out):
            md = forward_context.get_forward_context().attn_metadata[self.prefix]
            (_conv_state, recurrent_state), n = self.kv_cache, md.num_actual_tokens
            indices = md.non_spec_state_indices_tensor
            q, k, v = (t[:n].unflatten(-1, (-1, self.head_dim))[None]
                       for t in (q_proj_states, k_proj_states, v_proj_states))  # fmt: skip
            g1, beta = g1[:, :n], beta[:, :n]
            if md.num_prefills:  # every non-spec row through the chunk kernel
                zero_idx = indices[~md.has_initial_state]
                recurrent_state[zero_idx] = 0
                initial_state = recurrent_state[indices].contiguous()
                o, last = mod.chunk_kda_with_fused_gate(
                    q=q, k=k, v=v, raw_g=g1, beta=beta, A_log=self.A_log, g_bias=self.dt_bias,
                    initial_state=initial_state, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=md.non_spec_query_start_loc,
                    lower_bound=self.gate_lower_bound,
                )  # fmt: skip
                recurrent_state[indices] = last
            else:
                g = mod.fused_kda_gate(g1[0].flatten(-2), self.A_log, self.head_dim,
                                       g_bias=self.dt_bias,
                                       lower_bound=self.gate_lower_bound).unsqueeze(0)  # fmt: skip
                o, _ = mod.fused_recurrent_kda(
                    q=q, k=k, v=v, g=g, beta=beta, initial_state=recurrent_state,
                    use_qk_l2norm_in_kernel=True,
                    cu_seqlens=md.non_spec_query_start_loc[: md.num_decodes + 1],
                    ssm_state_indices=indices,
                )  # fmt: skip
            core_attn_out[0, :n] = o[0, :n]

    mod.KimiGatedDeltaNetAttention = KimiGatedDeltaNetAttention
    return mod


# -- ops/ssu_dispatch.py and mamba2/mamba_mixer2.py ------------------------------------------


def ssu_module(MambaBackendEnum):
    mod = types.ModuleType(SSU)

    class MambaSSUBackend:
        def __init__(self, mamba_config):
            self._mamba_config = mamba_config

    mod.MambaSSUBackend = MambaSSUBackend
    mod._BACKEND_REGISTRY = {MambaBackendEnum.TRITON: _tripwire("triton SSU backend"),
                             MambaBackendEnum.FLASHINFER: object}  # fmt: skip

    def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                               state_batch_indices=None, dst_state_batch_indices=None,
                               null_block_id=0, out=None, num_accepted_tokens=None,
                               cu_seqlens=None, is_blackwell=False):  # fmt: skip
        backend = mod._BACKEND_REGISTRY[MambaBackendEnum.TRITON](mamba_config=None)
        backend(state, x, dt, A, B, C, D, dt_bias, z=z, dt_softplus=dt_softplus,
                state_batch_indices=state_batch_indices,
                dst_state_batch_indices=dst_state_batch_indices, null_block_id=null_block_id,
                out=out, num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
                is_blackwell=is_blackwell)  # fmt: skip

    mod.selective_state_update = selective_state_update
    return mod


@dataclass
class Mamba2AttentionMetadata:
    """The fields mamba_mixer2's conv_ssm_forward reads (v1/attention/backends/mamba2_attn.py),
    mamba_cache_mode "none": decodes first, then prefills."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    has_initial_states_p: torch.Tensor | None
    query_start_loc_p: torch.Tensor | None
    state_indices_tensor_p: torch.Tensor | None
    state_indices_tensor_d: torch.Tensor | None
    query_start_loc_d: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None


def mamba2_module(custom_op, forward_context, ssu):
    mod = types.ModuleType(M2)
    mod.selective_state_update = ssu.selective_state_update
    mod.prefill_calls = []

    def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, out, D=None,
                                         z=None, dt_bias=None, initial_states=None,
                                         dt_softplus=False, state_dtype=None, **kwargs):  # fmt: skip
        mod.prefill_calls.append(cu_seqlens.clone())
        finals = []
        for i, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            st = (torch.zeros(1, *out.shape[1:], B.shape[-1], dtype=torch.float64)
                  if initial_states is None else initial_states[i][None].double())  # fmt: skip
            for t in range(s, e):
                o, st = mamba2_step(st, x[t][None], dt[t][None], A, B[t][None], C[t][None], D=D,
                                    dt_bias=dt_bias, dt_softplus=dt_softplus)  # fmt: skip
                out[t] = o[0].to(out.dtype)
            finals.append(st[0])
        return torch.stack(finals).to(state_dtype)

    mod.mamba_chunk_scan_combined_varlen = mamba_chunk_scan_combined_varlen

    @custom_op.PluggableLayer.register("mamba_mixer2")
    class MambaMixer2(custom_op.PluggableLayer, StateEntries):
        def __init__(self, prefix, num_heads, head_dim, n_groups, ssm_state_size, A, D, dt_bias,
                     num_spec=0, model_config=None, cache_config=None):  # fmt: skip
            super().__init__()
            self.prefix, self.num_spec = prefix, num_spec
            self.num_heads, self.head_dim = num_heads, head_dim
            self.n_groups, self.ssm_state_size = n_groups, ssm_state_size
            self.A, self.D, self.dt_bias = A, D, dt_bias
            self._configs(model_config, cache_config)

        def get_state_shape(self):
            H, P, N = self.num_heads, self.head_dim, self.ssm_state_size
            conv_dim = H * P + 2 * self.n_groups * N
            return state_shapes(conv_dim // self.tp_size, (H // self.tp_size, P, N), self.num_spec)

        def get_state_dtype(self):
            return state_dtypes(self.model_config, self.cache_config)

        def conv_ssm_forward(self, projected_states, output):
            """projected_states: post-conv [tokens, H*P + 2*G*N + H] (x, B, C, dt)."""
            md = forward_context.get_forward_context().attn_metadata[self.prefix]
            ssm_state = self.kv_cache[1]
            H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
            x, B, C, dt = projected_states.split([H * P, G * N, G * N, H], dim=-1)
            nd, n_p = md.num_decode_tokens, md.num_prefill_tokens
            x_d, x_p = x[: nd + n_p].split([nd, n_p])
            B_d, B_p = B[: nd + n_p].split([nd, n_p])
            C_d, C_p = C[: nd + n_p].split([nd, n_p])
            dt_d, dt_p = dt[: nd + n_p].split([nd, n_p])
            out_d, out_p = output[: nd + n_p].split([nd, n_p])
            if md.num_prefills:
                initial_states = torch.where(md.has_initial_states_p[:, None, None, None],
                                             ssm_state[md.state_indices_tensor_p], 0)  # fmt: skip
                varlen_states = mod.mamba_chunk_scan_combined_varlen(
                    x_p.view(n_p, H, P), dt_p, self.A, B_p.view(n_p, G, -1),
                    C_p.view(n_p, G, -1), chunk_size=256, D=self.D, z=None,
                    dt_bias=self.dt_bias, cu_seqlens=md.query_start_loc_p,
                    initial_states=initial_states, dt_softplus=True,
                    out=out_p.view(n_p, -1, P), state_dtype=ssm_state.dtype,
                )  # fmt: skip
                ssm_state[md.state_indices_tensor_p] = varlen_states
            if md.num_decodes:
                A_d = self.A[:, None, None].expand(-1, P, N).to(torch.float32)
                mod.selective_state_update(
                    ssm_state, x_d.view(-1, H, P), dt_d[:, :, None].expand(-1, -1, P), A_d,
                    B_d.view(-1, G, N), C_d.view(-1, G, N), self.D[:, None].expand(-1, P),
                    self.dt_bias[:, None].expand(-1, P), dt_softplus=True,
                    state_batch_indices=md.state_indices_tensor_d,
                    dst_state_batch_indices=md.state_indices_tensor_d,
                    out=out_d.view(nd, -1, P), num_accepted_tokens=md.num_accepted_tokens,
                    cu_seqlens=md.query_start_loc_d, is_blackwell=False,
                )  # fmt: skip

    mod.MambaMixer2 = MambaMixer2
    return mod


# -- mamba/mamba_utils.py: align mode's copy specs ------------------------------------------


@dataclass
class MambaCopySpec:
    start_addr: int
    num_elements: int


def conv_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
    """The conv state's rows from the accepted token's on, of the current block."""
    src = state[block_ids[cur_block_idx], num_accepted_tokens - 1 :]
    return MambaCopySpec(src.data_ptr(), src.numel())


def temporal_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
    """The SSM state of the block holding the accepted token's state (drafts' blocks follow)."""
    src = state[block_ids[cur_block_idx + num_accepted_tokens - 1]]
    return MambaCopySpec(src.data_ptr(), src.numel())


def mamba_utils_module():
    mod = types.ModuleType(MAMBA_UTILS)
    mod.MambaCopySpec = MambaCopySpec
    mod.get_conv_copy_spec, mod.get_temporal_copy_spec = conv_copy_spec, temporal_copy_spec
    return mod


# -- the package ------------------------------------------------------------------------------


def install(monkeypatch, lower_bound=None) -> dict[str, types.ModuleType]:
    """The fake vLLM in sys.modules (undone by monkeypatch); returns the modules by name."""
    mods = {name: types.ModuleType(name) for name in PACKAGES}

    class MambaBackendEnum(enum.Enum):
        TRITON = "triton"
        FLASHINFER = "flashinfer"

    mods["vllm.config.mamba"].MambaBackendEnum = MambaBackendEnum
    # The config the layers are built under; a test sets mamba_cache_mode ("none" unless it
    # enables prefix caching).
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode="none"))
    mods["vllm.config"].get_current_vllm_config = lambda: config
    custom_op, ctx = custom_op_module(), forward_context_module()
    mods[custom_op.__name__], mods[ctx.__name__] = custom_op, ctx
    mods[SSU] = ssu_module(MambaBackendEnum)
    mods[M2] = mamba2_module(custom_op, ctx, mods[SSU])
    mods[GDN] = gdn_module(custom_op, ctx)
    mods[KDA] = kda_module(custom_op, ctx, lower_bound)
    mods[MAMBA_UTILS] = mamba_utils_module()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    # The older path of mamba_mixer2 is absent, as in vLLM after the move into mamba2/.
    monkeypatch.delitem(sys.modules, "vllm.model_executor.layers.mamba.mamba_mixer2", False)
    return mods
