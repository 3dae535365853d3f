"""Thin adapters from engines' decode call sites to the functional ops (docs/integrations.md).

replayssm_jit.integrations.vllm     selective_state_update / fused_recurrent_gated_delta_rule
                                    style entries (pad block 0), state specs, fla layout
replayssm_jit.integrations.sglang   the same with PAD_SLOT_ID = -1 and request-pool indices
replayssm_jit.integrations.hf       patch(model) / unpatch(model): a transformers NemotronH,
                                    Qwen3-Next or Qwen3.5 model decodes its SSM layers through
                                    our ops in generate()
"""

from replayssm_jit.integrations import hf, sglang, vllm

__all__ = ["hf", "sglang", "vllm"]
