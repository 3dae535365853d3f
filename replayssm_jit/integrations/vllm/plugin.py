"""The out-of-tree vLLM plugin: the `vllm.general_plugins` entry point (pyproject.toml) calls
register() in every vLLM process at startup. With REPLAYSSM_VLLM=1 it

* puts ReplaySSM's SSU backend in place of vLLM's default ("triton") Mamba SSU backend, so the
  Mamba-2 decode and MTP calls of mamba_mixer2 (through ssu_dispatch.selective_state_update)
  run on ReplaySSM;
* rebinds the decode / MTP kernel names vLLM's GDN and KDA layers call (hooks.py), and
* registers, through vLLM's register_oot, subclasses of the Mamba-2, GDN and KDA layer classes
  that drop the records of the slots a prefill wrote (hooks.py) and declare the layout's rings,
  scales and cursors beside vLLM's conv and SSM state in each layer's cache pages
  (page_hooks.py; REPLAYSSM_VLLM_PAGES=0 allocates them apart at the layer's first call),

all with no engine edit. Without vLLM, or without the setting, it does nothing and says why.
Calling it again changes nothing. See docs/integrations.md.
"""

from __future__ import annotations

import logging

import torch

from replayssm_jit.integrations.vllm import hooks, page_hooks
from replayssm_jit.integrations.vllm.backend import NULL_BLOCK_ID, ReplaySSMBackend
from replayssm_jit.jit import env

__all__ = ["BACKEND", "make_ssu_backend_class", "register"]

logger = logging.getLogger("replayssm_jit.vllm")

# The process-wide layers (one per Mamba-2 layer's state tensor).
BACKEND = ReplaySSMBackend()

SSU_DISPATCH = "vllm.model_executor.layers.mamba.ops.ssu_dispatch"


def register() -> bool:
    """vLLM's plugin hook; True where anything was registered (now or by an earlier call)."""
    if not env.vllm_plugin_enabled():
        logger.info("replayssm: vLLM plugin loaded but not enabled (set REPLAYSSM_VLLM=1)")
        return False
    ssu = _register_ssu()
    installed = hooks.install(BACKEND)
    for what in installed:
        logger.info("replayssm: %s routed to ReplaySSM", what)
    return ssu or bool(installed)


def _register_ssu() -> bool:
    """ReplaySSM's SSU backend in the slot of vLLM's "triton" one (once)."""
    try:
        import importlib

        ssu = importlib.import_module(SSU_DISPATCH)
        from vllm.config.mamba import MambaBackendEnum
    except ImportError as e:
        logger.warning("replayssm: REPLAYSSM_VLLM=1 but vLLM's SSU dispatcher is not importable "
                       "(%s); Mamba-2 decode not registered", e)  # fmt: skip
        return False
    current = ssu._BACKEND_REGISTRY.get(MambaBackendEnum.TRITON)
    if getattr(current, "__name__", None) != "ReplaySSMSSUBackend":
        ssu._BACKEND_REGISTRY[MambaBackendEnum.TRITON] = make_ssu_backend_class(ssu.MambaSSUBackend)
    logger.info("replayssm: Mamba-2 decode routed to ReplaySSM (vLLM's triton SSU backend slot)")
    return True


def make_ssu_backend_class(base: type) -> type:
    """A subclass of vLLM's MambaSSUBackend with its name and __call__ (ssu_dispatch's
    argument order), made at registration so that this module imports without vLLM."""

    class ReplaySSMSSUBackend(base):
        @property
        def name(self) -> str:
            return "replayssm"

        def __call__(
            self, state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
            state_batch_indices=None, dst_state_batch_indices=None,
            null_block_id=NULL_BLOCK_ID, out=None, num_accepted_tokens=None, cu_seqlens=None,
            is_blackwell=False,
        ) -> None:  # fmt: skip
            layer = BACKEND._layers.get(state.data_ptr())
            if layer is None:
                layer = _register_from_call(state, x, B, D, z, dt_bias, dt_softplus,
                                            state_batch_indices, null_block_id)  # fmt: skip
            layer.ssu(state, x, dt, A, B, C, D, dt_bias, z=z, dt_softplus=dt_softplus,
                      state_batch_indices=state_batch_indices,
                      dst_state_batch_indices=dst_state_batch_indices,
                      null_block_id=null_block_id, out=out,
                      num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens)  # fmt: skip

    return ReplaySSMSSUBackend


def _register_from_call(state, x, B, D, z, dt_bias, dt_softplus, indices, null_block_id):
    """A layer for `state` from its first call: heads, headdim and dstate from the state,
    groups from B, activations from x, drafts from the layer class (1 + num_spec, once it ran)
    or else from the [bs, 1 + T] indices' width; its rings and cursors in its pages where it
    declared them there."""
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        raise ValueError(f"state: expected vLLM's [slots, H, P, N] state, got {state!r:.60}")
    _, H, P, N = state.shape
    width = indices.shape[1] if isinstance(indices, torch.Tensor) and indices.dim() == 2 else 1
    drafts = hooks.drafts_hint(state) or width
    layout = page_hooks.layer_layout("mamba2", (H, P, N), B.shape[-2], act_dtype=x.dtype,
                                     state_dtype=state.dtype, drafts=drafts)  # fmt: skip
    return BACKEND.register(state, layout, page_hooks.page_pool(state, layout),
                            pad_slot_id=null_block_id, has_D=D is not None, has_z=z is not None,
                            has_dt_bias=dt_bias is not None,
                            dt_softplus=bool(dt_softplus))  # fmt: skip
