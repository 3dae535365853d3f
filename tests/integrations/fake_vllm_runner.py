"""vLLM's side of a Mamba layer's cache pages, for fake_vllm.py's layers, written from reading
vLLM's code (never copied; docs/integrations.md names the files):

* the model classes' get_mamba_state_shape_from_config / get_mamba_state_dtype_from_config
  (models/nemotron_h.py, qwen3_next.py, kimi_linear.py: the calculators' entries from the HF
  config), from which HybridAttentionMambaModelConfig (models/config.py) pads the Mamba page to
  the attention page: attention block size 16 * cdiv(mamba page, 16 * attention bytes per
  token), cache_config.mamba_page_size_padded = that attention page;
* MambaSpec's page_size_bytes (v1/kv_cache_interface.py): the entries' bytes summed, or the
  padded page, which must hold them;
* align mode's copy specs (model classes' get_mamba_state_copy_func, mamba_utils.py) and the
  runner's copies between a request's blocks (v1/worker/mamba_utils.py, `copy_block`);
* the runner's views (gpu_model_runner.py _reshape_kv_cache_tensors): one buffer of
  num_blocks pages, entry i viewed with as_strided at the sum of the earlier entries' bytes,
  slot stride = the page; or MambaBase.bind_kv_cache's slices of a [blocks, 1, 1, page] int8
  view (newer vLLM). The buffer is torch.zeros, as vLLM allocates it; `fill` stands for a page
  that held other data (vLLM does not zero a block it hands out again).
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field

import torch

MODELS = "vllm.model_executor.models"
MAMBA_UTILS = "vllm.model_executor.layers.mamba.mamba_utils"
MODEL_MODULES = {
    "mamba2": (f"{MODELS}.nemotron_h", "NemotronHForCausalLM"),
    "gdn": (f"{MODELS}.qwen3_next", "Qwen3NextForCausalLM"),
    "kda": (f"{MODELS}.kimi_linear", "KimiLinearForCausalLM"),
}
CONV_KERNEL = 4


@dataclass
class VllmConfig:
    """The fields the model classes and the page padding read."""

    hf_config: dict
    dtype: torch.dtype = torch.float32
    num_spec: int = 0
    model_config: object = field(init=False)
    speculative_config: object = field(init=False)

    def __post_init__(self):
        self.model_config = types.SimpleNamespace(dtype=self.dtype, hf_config=self.hf_config)
        self.speculative_config = (
            types.SimpleNamespace(num_speculative_tokens=self.num_spec) if self.num_spec else None
        )


def _entries(conv_dim, state, dtypes, vllm_config):
    spec = vllm_config.speculative_config
    num_spec = spec.num_speculative_tokens if spec else 0
    return ((CONV_KERNEL - 1 + num_spec, conv_dim), tuple(state)), dtypes


def _model_class(family: str) -> type:
    """A model class whose two classmethods give the calculators' entries from its HF config."""

    def entries(cls, vllm_config):
        c, dtype = vllm_config.hf_config, vllm_config.dtype
        if family == "mamba2":
            conv = c["heads"] * c["head_dim"] + 2 * c["groups"] * c["state"]
            state = (c["heads"], c["head_dim"], c["state"])
            return _entries(conv, state, (dtype, dtype), vllm_config)
        if family == "gdn":
            conv = 2 * c["key_heads"] * c["k"] + c["value_heads"] * c["v"]
            state = (c["value_heads"], c["v"], c["k"])
            return _entries(conv, state, (dtype, dtype), vllm_config)
        conv, state = 3 * c["heads"] * c["head_dim"], (c["heads"], c["head_dim"], c["head_dim"])
        return _entries(conv, state, (dtype, torch.float32), vllm_config)

    def shapes(cls, vllm_config):
        return entries(cls, vllm_config)[0]

    def dtypes(cls, vllm_config):
        return entries(cls, vllm_config)[1]

    def copy_funcs(cls):  # (MambaStateCopyFuncCalculator: conv, then temporal)
        utils = sys.modules[MAMBA_UTILS]
        return utils.get_conv_copy_spec, utils.get_temporal_copy_spec

    module, name = MODEL_MODULES[family]
    return type(name, (), {"__module__": module,
                           "get_mamba_state_shape_from_config": classmethod(shapes),
                           "get_mamba_state_dtype_from_config": classmethod(dtypes),
                           "get_mamba_state_copy_func": classmethod(copy_funcs)})  # fmt: skip


def install_models(monkeypatch) -> dict[str, type]:
    """The three model modules in sys.modules (before plugin.register()); their classes."""
    classes = {}
    monkeypatch.setitem(sys.modules, MODELS, types.ModuleType(MODELS))
    for family, (module_name, name) in MODEL_MODULES.items():
        module = types.ModuleType(module_name)
        classes[family] = _model_class(family)
        setattr(module, name, classes[family])
        monkeypatch.setitem(sys.modules, module_name, module)
    return classes


def entry_bytes(shapes, dtypes) -> int:
    return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))


def padded_page(model_cls: type, vllm_config, attn_bytes_per_token: int) -> int | None:
    """HybridAttentionMambaModelConfig: the attention page the Mamba page is padded to (None
    where they are equal)."""
    mamba = entry_bytes(model_cls.get_mamba_state_shape_from_config(vllm_config),
                        model_cls.get_mamba_state_dtype_from_config(vllm_config))  # fmt: skip
    block_size = 16 * -(-mamba // (16 * attn_bytes_per_token))
    attn = block_size * attn_bytes_per_token
    assert attn >= mamba
    return None if attn == mamba else attn


def page_size(layer, padded: int | None) -> int:
    """MambaSpec(shapes, dtypes, page_size_padded).page_size_bytes of `layer`."""
    real = entry_bytes(layer.get_state_shape(), layer.get_state_dtype())
    if padded is not None:
        assert padded >= real, "MambaSpec: page_size_padded >= the entries' bytes"
        return padded
    return real


@dataclass
class Pages:
    raw: torch.Tensor  # [num_blocks * page] int8, one buffer for the layers sharing it
    page: int
    views: tuple[torch.Tensor, ...]


def allocate(layers, num_blocks, padded, *, form="as_strided", fill=None, shift=0) -> Pages:
    """One buffer of `num_blocks` pages for `layers` (one cache group: the same entries), each
    layer's kv_cache bound to the runner's views of it. `fill` (a generator): random bytes in
    every page but the null block's; `shift`: the entries after vLLM's two carved `shift` bytes off (a broken runner,
    for the tests that must see it)."""
    shapes, dtypes = tuple(layers[0].get_state_shape()), tuple(layers[0].get_state_dtype())
    page = page_size(layers[0], padded)
    raw = torch.zeros(num_blocks * page, dtype=torch.int8)
    if fill is not None:  # (not the null block 0, which vLLM hands to no request)
        raw[page:].copy_(torch.randint(-128, 128, (raw.numel() - page,), dtype=torch.int8,
                                       generator=fill))  # fmt: skip
    views, offset = [], 0
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        at = offset - shift if i >= 2 else offset
        size, nbytes = dtype.itemsize, math.prod(shape) * dtype.itemsize
        if form == "as_strided":
            assert at % size == 0
            dense = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
            views.append(torch.as_strided(raw.view(dtype), (num_blocks, *shape),
                                          (page // size, *dense), at // size))  # fmt: skip
        else:  # MambaBase.bind_kv_cache
            blocks = raw[: num_blocks * page].view(num_blocks, 1, 1, page).squeeze(dim=(1, 2))
            views.append(blocks[:, at : at + nbytes].view(dtype).view(-1, *shape))
        offset += nbytes
    for layer in layers:
        layer.kv_cache = tuple(views)
    return Pages(raw, page, tuple(views))


def copy_block(pages: Pages, layers, copy_funcs, block_ids, src_idx, dest_idx, accept_bias=0):
    """Align mode's copy of a request's state between its blocks (v1/worker/mamba_utils.py
    collect_mamba_copy_meta, then the batched memcpy): for each layer, entry i from the address
    copy_funcs[i] names (zip: entries past the funcs are not copied) to the destination block."""
    if src_idx == dest_idx and accept_bias == 0:
        return
    raw, base = pages.raw.view(torch.uint8), pages.raw.data_ptr()
    moves = []
    for layer in layers:
        for state, func in zip(layer.kv_cache, copy_funcs):
            spec = func(state, block_ids, src_idx, accept_bias + 1)
            nbytes = spec.num_elements * state.element_size()
            moves.append((spec.start_addr - base, state[block_ids[dest_idx]].data_ptr() - base,
                          nbytes))  # fmt: skip
    for src, dst, nbytes in moves:
        raw[dst : dst + nbytes] = raw[src : src + nbytes].clone()
