"""Thin adapters from engines' decode call sites to the functional ops (docs/integrations.md).

replayssm_jit.integrations.vllm     selective_state_update / fused_recurrent_gated_delta_rule
                                    style entries (pad block 0), state specs, fla layout
replayssm_jit.integrations.sglang   the same with PAD_SLOT_ID = -1 and request-pool indices
"""

from replayssm_jit.integrations import sglang, vllm

__all__ = ["sglang", "vllm"]
