"""What the drop-in knows of each transformers SSM mixer class: its family, its layout, the
parameters our ops take from it, and its one-token decode around our SSM step.

Every decode path keeps the mixer's projections, HF's own causal conv (which also does the
cache's bookkeeping, e.g. the token count of transformers >= 5.25), and its gated norm and
output projection; only the SSM state update and readout go through our ops.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replayssm_jit.families.layout import CacheLayout, gdn_layout, kda_layout, mamba2_layout
from replayssm_jit.ops import gdn_decode, kda_decode, mamba2_decode

__all__ = ["MIXERS", "MixerAdapter", "adapter_of", "layout_of"]


@dataclass(frozen=True)
class MixerAdapter:
    """One HF mixer class.

    family: the registry name of its SSM family.
    layout: (mixer, common layout kwargs) -> its CacheLayout.
    plan_options: the family's plan() options that reproduce HF's gates and norms.
    params: mixer -> per-head float32 tensors the step takes (and those of them the family's
        materialize_slots fold needs: ops/registry.py, fold_params).
    step: (layer, hidden_states [b, 1, hidden], cache, attention_mask) -> the mixer's output.
    neutral_step: (layer, batch, slots) -> one record that changes no state or output.
    hf_state_transposed: HF keeps [..., K, V] where we keep [..., V, K] (the delta rules).
    """

    family: str
    layout: Callable[[torch.nn.Module, dict], CacheLayout]
    plan_options: dict
    step: Callable
    neutral_step: Callable
    params: Callable[[torch.nn.Module], dict] = lambda mixer: {}
    hf_state_transposed: bool = False


def _modeling(mixer):
    """The transformers modeling module the mixer's class comes from (its conv functions)."""
    return sys.modules[type(mixer).__module__]


def conv_step(mixer, mixed: torch.Tensor, cache) -> torch.Tensor:
    """HF's own causal conv of one token, [batch, 1, channels] -> [batch, channels]: it updates
    the cache's conv state and, from transformers 5.25 on (causal_conv1d_forward), the cache's
    token count, exactly as the mixer's own decode does."""
    modeling = _modeling(mixer)
    channels_first = mixed.transpose(1, 2)
    conv_forward = getattr(modeling, "causal_conv1d_forward", None)
    if conv_forward is not None:
        out = conv_forward(mixer.conv1d, channels_first, cache, mixer.layer_idx,
                           activation=mixer.activation)  # fmt: skip
    else:  # 5.21-5.24: the mixer calls the update itself and keeps no count
        out = modeling.causal_conv1d_update(
            channels_first, cache.get_conv_state(mixer.layer_idx),
            mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation=mixer.activation,
        )  # fmt: skip
    return out[:, :, 0]


def _heads(layer, *names):
    shape = layer.layout.shape
    return [getattr(shape, name) for name in names]


# ---------------------------------------------------------------------------------------------
# Mamba-2: NemotronH
# ---------------------------------------------------------------------------------------------


def _mamba2_layout(mixer, common) -> CacheLayout:
    return mamba2_layout(num_heads=mixer.num_heads, headdim=mixer.head_dim,
                         dstate=mixer.ssm_state_size, ngroups=mixer.n_groups, **common)  # fmt: skip


def _mamba2_params(mixer) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {
            "A": (-torch.exp(mixer.A_log.float())).contiguous(),
            "D": mixer.D.float().contiguous(),
            "dt_bias": mixer.dt_bias.float().contiguous(),
        }


def _mamba2_step(layer, hidden_states, cache, attention_mask):
    mixer = layer.mixer
    modeling = _modeling(mixer)
    batch, dtype = hidden_states.shape[0], hidden_states.dtype
    H, G, P, N = _heads(layer, "value_heads", "key_heads", "value_dim", "key_dim")
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    projected = mixer.in_proj(hidden_states)
    gate, x_b_c, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)
    x_b_c = conv_step(mixer, x_b_c, cache)
    if attention_mask is not None:
        x_b_c = modeling.apply_mask_to_padding_states(x_b_c[:, None], attention_mask)[:, 0]
    x, B, C = torch.split(x_b_c, [H * P, G * N, G * N], dim=-1)
    # The ops want each row 16-byte aligned: split views of one projection may not be.
    y = mamba2_decode(
        layer.plan(batch), **layer.pool,
        x=x.reshape(batch, H, P).contiguous(), B=B.reshape(batch, G, N).contiguous(),
        C=C.reshape(batch, G, N).contiguous(), dt=dt[:, 0].float().contiguous(),
        slot_indices=layer.slot_ids(batch), seed=layer.step_seed(), **layer.params,
    )  # fmt: skip
    scan_output = mixer.norm(y.reshape(batch, 1, H * P), gate)
    return mixer.out_proj(scan_output.to(dtype))


def _mamba2_neutral(layer, batch, slots) -> None:
    H, G, P, N = _heads(layer, "value_heads", "key_heads", "value_dim", "key_dim")
    dtype, device = layer.layout.act_dtype, layer.device
    zeros_b = torch.zeros(batch, G, N, dtype=dtype, device=device)
    # softplus(-inf) = 0 exactly: the record's dt is zero (decay 1, no contribution).
    dt = torch.full((batch, H), float("-inf"), device=device)
    mamba2_decode(layer.plan(batch), **layer.pool,
                  x=torch.zeros(batch, H, P, dtype=dtype, device=device), dt=dt, B=zeros_b,
                  C=zeros_b, slot_indices=slots, **layer.params)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet: Qwen3-Next, Qwen3.5 (dense and MoE)
# ---------------------------------------------------------------------------------------------


def _gdn_layout(mixer, common) -> CacheLayout:
    return gdn_layout(num_k_heads=mixer.num_k_heads, num_v_heads=mixer.num_v_heads,
                      head_k_dim=mixer.head_k_dim, head_v_dim=mixer.head_v_dim,
                      **common)  # fmt: skip


def _gdn_inputs(mixer, hidden_states):
    """(mixed q|k|v [batch, 1, conv_dim], z [batch, 1, HV, V], b, a [batch, 1, HV]) from the
    mixer's own projections: Qwen3-Next's fused qkvz / ba, or Qwen3.5's separate ones."""
    batch = hidden_states.shape[0]
    if hasattr(mixer, "in_proj_qkvz"):
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(hidden_states), mixer.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([t.reshape(batch, 1, -1) for t in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = mixer.in_proj_z(hidden_states).reshape(batch, 1, -1, mixer.head_v_dim)
    return (
        mixer.in_proj_qkv(hidden_states),
        z,
        mixer.in_proj_b(hidden_states),
        mixer.in_proj_a(hidden_states),
    )


def _qkv(layer, mixed, batch):
    """q, k [batch, H, K] and v [batch, HV, V], contiguous, from the conv's output."""
    H, HV, K, V = _heads(layer, "key_heads", "value_heads", "key_dim", "value_dim")
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    return (q.reshape(batch, H, K).contiguous(), k.reshape(batch, H, K).contiguous(),
            v.reshape(batch, HV, V).contiguous())  # fmt: skip


def _gdn_step(layer, hidden_states, cache, attention_mask):
    mixer = layer.mixer
    hidden_states = _modeling(mixer).apply_mask_to_padding_states(hidden_states, attention_mask)
    batch = hidden_states.shape[0]
    mixed, z, b, a = _gdn_inputs(mixer, hidden_states)
    q, k, v = _qkv(layer, conv_step(mixer, mixed, cache), batch)
    # The gates as HF forms them: beta in the activation dtype, g in FP32.
    beta = b[:, 0].sigmoid().float()
    g = -mixer.A_log.float().exp() * F.softplus(a[:, 0].float() + mixer.dt_bias)
    o = gdn_decode(layer.plan(batch), **layer.pool, q=q, k=k, v=v, g=g.contiguous(),
                   beta=beta.contiguous(), slot_indices=layer.slot_ids(batch),
                   seed=layer.step_seed())  # fmt: skip
    V = layer.layout.shape.value_dim
    normed = mixer.norm(o.reshape(-1, V), z.reshape(-1, V))
    return mixer.out_proj(normed.reshape(batch, 1, -1))


def _delta_neutral(decode):
    """g = 0 (decay 1) and beta = 0 (a zero correction u): the record changes nothing."""

    def neutral(layer, batch, slots) -> None:
        H, HV, K, V = _heads(layer, "key_heads", "value_heads", "key_dim", "value_dim")
        dtype, device = layer.layout.act_dtype, layer.device
        zeros_qk = torch.zeros(batch, H, K, dtype=dtype, device=device)
        # A decay per key channel (the family's decay_per_channel) takes K gates per value head.
        per_channel = layer.layout.family.decay_per_channel
        gate_shape = (batch, HV, K) if per_channel else (batch, HV)
        decode(layer.plan(batch), **layer.pool, q=zeros_qk, k=zeros_qk,
               v=torch.zeros(batch, HV, V, dtype=dtype, device=device),
               g=torch.zeros(gate_shape, device=device),
               beta=torch.zeros(batch, HV, device=device), slot_indices=slots)  # fmt: skip

    return neutral


# ---------------------------------------------------------------------------------------------
# Kimi Delta Attention: Kimi-Linear
# ---------------------------------------------------------------------------------------------


def _kda_layout(mixer, common) -> CacheLayout:
    return kda_layout(num_k_heads=mixer.num_heads, num_v_heads=mixer.num_heads,
                      head_k_dim=mixer.head_dim, head_v_dim=mixer.head_dim, **common)  # fmt: skip


def _kda_step(layer, hidden_states, cache, attention_mask):
    mixer = layer.mixer
    hidden_states = _modeling(mixer).apply_mask_to_padding_states(hidden_states, attention_mask)
    batch = hidden_states.shape[0]
    mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states),
                       mixer.v_proj(hidden_states)], dim=-1)  # fmt: skip
    q, k, v = _qkv(layer, conv_step(mixer, mixed, cache), batch)
    # HF's gates: the per-channel log decay in FP32, beta in the activation dtype.
    g = mixer.forget_gate(hidden_states)[:, 0].float()
    beta = torch.sigmoid(mixer.b_proj(hidden_states))[:, 0].float()
    o = kda_decode(layer.plan(batch), **layer.pool, q=q, k=k, v=v, g=g.contiguous(),
                   beta=beta.contiguous(), slot_indices=layer.slot_ids(batch),
                   seed=layer.step_seed())  # fmt: skip
    gate = mixer.g_b_proj(mixer.g_a_proj(hidden_states)).reshape(batch, 1, -1, mixer.head_dim)
    normed = mixer.o_norm(o.reshape(batch, 1, -1, mixer.head_dim), gate)
    return mixer.o_proj(normed.reshape(batch, 1, -1))


_DELTA_PLAN = {"use_qk_l2norm": True, "gates_in_kernel": False}  # g, beta formed as HF does
_MAMBA2 = MixerAdapter(
    family="mamba2", layout=_mamba2_layout, step=_mamba2_step, neutral_step=_mamba2_neutral,
    plan_options={"has_D": True, "has_z": False, "has_dt_bias": True, "dt_softplus": True},
    params=_mamba2_params,
)  # fmt: skip
_GDN = MixerAdapter(
    family="gdn", layout=_gdn_layout, step=_gdn_step, plan_options=_DELTA_PLAN,
    neutral_step=_delta_neutral(gdn_decode), hf_state_transposed=True,
)  # fmt: skip
_KDA = MixerAdapter(
    family="kda", layout=_kda_layout, step=_kda_step, plan_options=_DELTA_PLAN,
    neutral_step=_delta_neutral(kda_decode), hf_state_transposed=True,
)  # fmt: skip

# Mixer class name -> adapter; matched by name so that transformers stays an optional import.
MIXERS: dict[str, MixerAdapter] = {
    "NemotronHMamba2Mixer": _MAMBA2,
    "Qwen3NextGatedDeltaNet": _GDN,
    "Qwen3_5GatedDeltaNet": _GDN,
    "Qwen3_5MoeGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _KDA,
}


def adapter_of(module) -> MixerAdapter | None:
    return MIXERS.get(type(module).__name__)


def layout_of(mixer, adapter: MixerAdapter, formats: dict) -> CacheLayout:
    """The mixer's layout at the model's current dtype (the spec checks the formats)."""
    common = dict(window=formats["window"], state_dtype=formats["state_dtype"],
                  read_dtype=formats["read_dtype"], act_dtype=mixer.conv1d.weight.dtype)  # fmt: skip
    return adapter.layout(mixer, common)
