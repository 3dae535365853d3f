"""The plugin's rings, scales and cursors inside vLLM's cache pages (issue 36, "vLLM cache
pages"; REPLAYSSM_VLLM_PAGES, on by default).

vLLM sizes a Mamba layer's page from the (shape, dtype) entries the layer declares and gives the
layer one strided view per entry (pages.py). With the setting on, hooks.py's lifecycle subclasses
declare vLLM's own entries (conv state, SSM state: unchanged, at their indices) and then the
layout's (`declare`, through get_state_shape / get_state_dtype), so vLLM's memory profiler
counts them and its runner carves them out of each block's page. At the layer's first decode
the plugin takes those views (`page_pool`) in place of allocating its own.

* `layer_layout` is the one rule for a layer's CacheLayout (window from REPLAYSSM_VLLM_WINDOW),
  applied at the first decode to the call's shapes and here to vLLM's entries.
* `bind` names a layer's views (by its SSM state's address) at every call of its core method,
  so that the prefill's cursor reset reaches the page before the layer's first decode.
* `narrow` shows vLLM's own code the entries it declared itself, e.g. Kimi-Linear's
  `conv_state, recurrent_state = self.kv_cache`.
* `install_models` makes the model classes' get_mamba_state_shape_from_config /
  get_mamba_state_dtype_from_config report the same entries: vLLM pads a hybrid model's Mamba
  page to the attention page, which it sizes at config time from those, before any layer exists;
  and their get_mamba_state_copy_func add a whole-block copy spec per entry of ours, so vLLM's
  prefix caching in align mode moves a slot's records and cursor words with its checkpoint.

A layer whose page cannot hold the layout's tensors (vLLM padded it from a model class this
module does not hook) declares vLLM's entries alone and allocates its own at the first decode,
as with the setting off (logged).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from replayssm_jit.families import get_family
from replayssm_jit.families.layout import CacheLayout, family_layout
from replayssm_jit.integrations.vllm.pages import PageEntries, page_entries, page_tensors
from replayssm_jit.integrations.vllm.rows import NULL_BLOCK_ID
from replayssm_jit.jit import env

__all__ = [
    "MODEL_MODULES", "LayerPages", "PageSlots", "bind", "declare", "install_models",
    "layer_layout", "narrow", "page_pool", "pages_for", "state_methods",
]  # fmt: skip

logger = logging.getLogger("replayssm_jit.vllm")
_WARNED: set[tuple] = set()


def _warn_once(key: tuple, message: str, *args) -> None:
    """One warning per kind of layer, not one per layer."""
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message, *args)


SSM_INDEX = 1  # vLLM's entries: (conv state, SSM state)
MODEL_SHAPE, MODEL_DTYPE = "get_mamba_state_shape_from_config", "get_mamba_state_dtype_from_config"
MODEL_COPY = "get_mamba_state_copy_func"  # align mode's copy specs, one per entry
VLLM_CONFIG = "vllm.config"
MAMBA_UTILS = "vllm.model_executor.layers.mamba.mamba_utils"
# The model classes vLLM sizes the hooked layers' pages from, by module: their family.
MODEL_MODULES = {
    "vllm.model_executor.models.nemotron_h": "mamba2",
    "vllm.model_executor.models.qwen3_next": "gdn",
    "vllm.model_executor.models.qwen3_5": "gdn",
    "vllm.model_executor.models.kimi_linear": "kda",
}


def current_vllm_config() -> object | None:
    """The config vLLM builds the model under (None in a vLLM without get_current_vllm_config)."""
    try:
        module = importlib.import_module(VLLM_CONFIG)
    except ImportError:
        return None
    current = getattr(module, "get_current_vllm_config", None)
    return current() if current is not None else None


def cache_mode() -> str:
    """cache_config.mamba_cache_mode ("none" where vLLM has none)."""
    cache_config = getattr(current_vllm_config(), "cache_config", None)
    return getattr(cache_config, "mamba_cache_mode", None) or "none"


def layer_layout(
    family: str,
    state_shape: Sequence[int],
    key_heads: int,
    *,
    act_dtype: torch.dtype,
    state_dtype: torch.dtype,
    drafts: int,
) -> CacheLayout:
    """The layout of a plugin layer: `state_shape` is vLLM's SSM state per slot (Mamba-2
    [H, P, N], GDN / KDA [HV, V, K]), `key_heads` Mamba-2's groups or GDN / KDA's key heads,
    all per tensor-parallel rank; drafts = 1 + num_spec; window REPLAYSSM_VLLM_WINDOW."""
    value_heads, value_dim, key_dim = (int(d) for d in state_shape)
    # The state is [value heads, value dim, key dim] in every family; the registry names them.
    roles = (key_heads, value_heads, key_dim, value_dim)  # Family.shape_args' role order
    shape_args = dict(zip(get_family(family).shape_args, roles))
    return family_layout(family, window=env.vllm_window(), drafts=drafts, act_dtype=act_dtype,
                         state_dtype=state_dtype, **shape_args)  # fmt: skip


def key_heads_from_conv(conv_shape: Sequence[int], state_shape: Sequence[int]) -> int | None:
    """Mamba-2's groups or GDN / KDA's key heads per rank from vLLM's entries: the conv state's
    channels (its larger dim, (state_len, dim) or (dim, state_len)) are x's (v's) H * P
    (HV * V), then B and C's (k and q's) 2 * G * N (2 * H * K). None where they are not."""
    if len(conv_shape) != 2 or len(state_shape) != 3:
        return None
    a, b, c = state_shape
    rest = max(conv_shape) - a * b
    return rest // (2 * c) if rest > 0 and rest % (2 * c) == 0 else None


@dataclass(frozen=True)
class LayerPages:
    """What a layer declares: its layout and the entries (vLLM's `own` first)."""

    layout: CacheLayout
    entries: PageEntries
    own: int = 2


def pages_for(family: str, shapes, dtypes, *, act_dtype, drafts: int) -> LayerPages | None:
    """vLLM's (conv, SSM state) entries with the layout's appended; None where vLLM's entries
    are not that pair or give a layout the kernels do not take (logged)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    dtypes = tuple(dtypes)
    heads = key_heads_from_conv(*shapes) if len(shapes) == len(dtypes) == 2 else None
    if heads is None:
        _warn_once(("entries", family, str(shapes)), "replayssm: vLLM's %s entries %s are not "
                   "(conv state, SSM state); the rings stay apart from its pages", family,
                   shapes)  # fmt: skip
        return None
    try:
        layout = layer_layout(family, shapes[SSM_INDEX], heads, act_dtype=act_dtype,
                              state_dtype=dtypes[SSM_INDEX], drafts=drafts)  # fmt: skip
    except (TypeError, ValueError) as e:
        _warn_once(("layout", family, str(shapes)), "replayssm: no %s layout for vLLM's "
                   "entries %s (%s)", family, shapes, e)  # fmt: skip
        return None
    return LayerPages(layout, page_entries(layout, shapes, dtypes, state_index=SSM_INDEX))


def _act_dtype(model_config: object, fallback: torch.dtype) -> torch.dtype:
    """The model's dtype (the activations'), else vLLM's conv state dtype."""
    dtype = getattr(model_config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else fallback


# ---------------------------------------------------------------------------------------------
# The layer classes: what they declare, and the runner's views
# ---------------------------------------------------------------------------------------------

_UNSET = object()
_DECLARED: dict[str, int] = {}  # family: entries its layers declare (the copy specs' count)


def declare(module: object, family: str, base: type) -> LayerPages | None:
    """The entries `module` (an instance of a lifecycle subclass of `base`) declares, decided at
    the first call and kept: None with the setting off, or where vLLM's padded page
    (cache_config.mamba_page_size_padded) cannot hold them."""
    pages = module.__dict__.get("_replayssm_pages", _UNSET)
    if pages is not _UNSET:
        return pages
    pages = None
    if env.vllm_pages():
        shapes, dtypes = tuple(base.get_state_shape(module)), tuple(base.get_state_dtype(module))
        drafts = 1 + int(getattr(module, "num_spec", 0) or 0)
        act = _act_dtype(getattr(module, "model_config", None), dtypes[0])
        pages = pages_for(family, shapes, dtypes, act_dtype=act, drafts=drafts)
        cache_config = getattr(module, "cache_config", None)
        padded = getattr(cache_config, "mamba_page_size_padded", None)
        if pages is not None and padded is not None and pages.entries.page_bytes > padded:
            _warn_once(("padded", base.__name__, padded), "replayssm: %s's page was padded to "
                       "%d bytes from the model class's entries, short of %d with the rings; "
                       "they stay apart from vLLM's pages", base.__name__, padded,
                       pages.entries.page_bytes)  # fmt: skip
            pages = None
        if pages is None and cache_mode() == "align":
            raise ValueError(
                f"mamba_cache_mode: 'align' needs the rings and cursors in {base.__name__}'s "
                f"cache pages (vLLM's block copies reach nothing else), but its page cannot "
                f"hold them (logged above); start vLLM with --no-enable-prefix-caching"
            )
    module.__dict__["_replayssm_pages"] = pages
    if pages is not None:
        _DECLARED[family] = len(pages.entries.names)
    return pages


def state_methods(family: str, base: type) -> dict[str, object]:
    """get_state_shape / get_state_dtype for a lifecycle subclass of `base` (none where `base`
    lacks them)."""
    if not all(callable(getattr(base, n, None)) for n in ("get_state_shape", "get_state_dtype")):
        return {}

    def get_state_shape(self):
        pages = declare(self, family, base)
        return base.get_state_shape(self) if pages is None else pages.entries.shapes

    def get_state_dtype(self):
        pages = declare(self, family, base)
        return base.get_state_dtype(self) if pages is None else pages.entries.dtypes

    for fn in (get_state_shape, get_state_dtype):
        fn.__qualname__ = f"ReplaySSM{base.__name__}.{fn.__name__}"
        fn.__doc__ = f"vLLM's {base.__name__}.{fn.__name__}, then the layout's rings and cursors."
    return {"get_state_shape": get_state_shape, "get_state_dtype": get_state_dtype}


@dataclass(frozen=True, eq=False)
class PageSlots:
    """A layer's tensors in its pages by name (its own state at vLLM's index), usable as the
    cursors' owner by hooks.reset_held before the layer's first decode."""

    layout: CacheLayout
    pool: dict
    state: torch.Tensor
    pad_slot_id: int = NULL_BLOCK_ID


_BOUND: dict[int, PageSlots] = {}


def _entries(module: object) -> tuple | list | None:
    """The layer's views, one per declared entry (older vLLM: one list per virtual engine)."""
    kv = getattr(module, "kv_cache", None)
    if isinstance(kv, (list, tuple)) and kv and isinstance(kv[0], (list, tuple)):
        kv = kv[0]
    return kv if isinstance(kv, (list, tuple)) else None


def bind(module: object) -> PageSlots | None:
    """The layer's tensors in its pages, from the runner's views (None before vLLM binds them,
    or where the layer declared none). Layers sharing one state tensor (vLLM's hybrid allocator)
    share them."""
    pages = module.__dict__.get("_replayssm_pages")
    kv = _entries(module)
    if not isinstance(pages, LayerPages) or kv is None or len(kv) != len(pages.entries.names):
        return None
    state = kv[SSM_INDEX]
    found = _BOUND.get(state.data_ptr())
    if found is None:
        pool = page_tensors(pages.entries, kv)
        # The null block, which vLLM hands to no request, is where pad rows' resets land: its
        # cursor words are made valid once (vLLM allocates the pages zeroed; this holds anyway).
        if 0 <= NULL_BLOCK_ID < state.shape[0]:
            pool["cursors"][NULL_BLOCK_ID].zero_()
        found = _BOUND[state.data_ptr()] = PageSlots(pages.layout, pool, state)
    elif (found.layout, found.state.shape) != (pages.layout, state.shape) or (
        found.state.stride() != state.stride()
    ):
        raise ValueError(
            f"kv_cache: expected the pages of the layer that shares this state tensor "
            f"({found.layout.family.name}, window {found.layout.window}, drafts "
            f"{found.layout.drafts}, state {list(found.state.shape)}), got "
            f"{pages.layout.family.name}, state {list(state.shape)}"
        )
    return found


def page_pool(state: torch.Tensor, layout: CacheLayout) -> dict | None:
    """At a layer's first decode: its tensors in its pages (None where it declared none, and
    allocates its own). The call's layout must be the one its pages were declared with."""
    found = _BOUND.get(state.data_ptr())
    if found is None:
        return None
    if found.layout != layout:
        raise ValueError(
            f"state: expected the layout the layer's pages declare ({_describe(found.layout)}), "
            f"got the decode call's ({_describe(layout)})"
        )
    return found.pool


def _describe(layout: CacheLayout) -> str:
    s = layout.shape
    return (f"{layout.family.name}, heads {s.key_heads}/{s.value_heads}, dims {s.key_dim}/"
            f"{s.value_dim}, act {layout.act_dtype}, state {layout.state_dtype}, window "
            f"{layout.window}, drafts {layout.drafts}")  # fmt: skip


def narrow(module: object) -> object:
    """Bind `module.kv_cache` to vLLM's own entries while vLLM's code runs; returns the full
    binding to put back (None where there is nothing to narrow)."""
    pages = module.__dict__.get("_replayssm_pages")
    full = getattr(module, "kv_cache", None)
    kv = _entries(module)
    if not isinstance(pages, LayerPages) or kv is None or len(kv) != len(pages.entries.names):
        return None
    own = pages.own
    if kv is full:
        module.kv_cache = full[:own]
    else:
        module.kv_cache = type(full)(e[:own] for e in full)
    return full


# ---------------------------------------------------------------------------------------------
# The model classes: the entries vLLM sizes a hybrid model's padded page from
# ---------------------------------------------------------------------------------------------


def _unwrapped(cls: type, name: str):
    fn = getattr(cls, name).__func__
    return getattr(fn, "_replayssm_original", fn)


def config_pages(cls: type, family: str, vllm_config: object) -> LayerPages | None:
    """What every layer of `cls` will declare, from vLLM's entries for `vllm_config`."""
    if not env.vllm_pages():
        return None
    shapes = _unwrapped(cls, MODEL_SHAPE)(cls, vllm_config)
    dtypes = tuple(_unwrapped(cls, MODEL_DTYPE)(cls, vllm_config))
    spec = getattr(vllm_config, "speculative_config", None)
    drafts = 1 + int(getattr(spec, "num_speculative_tokens", 0) or 0)
    act = _act_dtype(getattr(vllm_config, "model_config", None), dtypes[0])
    return pages_for(family, shapes, dtypes, act_dtype=act, drafts=drafts)


def _model_method(name: str, family: str, original):
    def method(cls, vllm_config):
        pages = config_pages(cls, family, vllm_config)
        if pages is None:
            return original(cls, vllm_config)
        return pages.entries.shapes if name == MODEL_SHAPE else pages.entries.dtypes

    method.__name__ = name
    method.__doc__ = f"vLLM's {name}, then the layout's rings and cursors (page_hooks.py)."
    method._replayssm_original = original
    return classmethod(method)


def copy_whole_block(state: torch.Tensor, block_ids, cur_block_idx: int, num_accepted_tokens: int):
    """vLLM's copy spec (align mode) of one of our entries: the whole block, so a slot's rings,
    scales and cursor words move with its checkpoint (align mode runs without drafts: the block
    is the current one, whatever num_accepted_tokens says)."""
    block = state[block_ids[cur_block_idx]]
    spec = importlib.import_module(MAMBA_UTILS).MambaCopySpec
    return spec(start_addr=block.data_ptr(), num_elements=block.numel())


def _entry_count(cls: type, family: str) -> int | None:
    """How many entries `cls`'s layers declare: as a layer declared them, else from the config
    vLLM builds the model under; None where neither is known."""
    if family in _DECLARED:
        return _DECLARED[family]
    try:
        pages = config_pages(cls, family, current_vllm_config())
    except (AttributeError, TypeError, ValueError):  # a config without the model's fields
        return None
    return None if pages is None else len(pages.entries.names)


def _copy_method(family: str, original):
    def method(cls):
        funcs = tuple(original(cls))
        count = _entry_count(cls, family) if env.vllm_pages() else None
        return funcs if count is None else funcs + (copy_whole_block,) * (count - len(funcs))

    method.__name__ = MODEL_COPY
    method.__doc__ = f"vLLM's {MODEL_COPY}, then a whole-block copy per entry of ours."
    method._replayssm_original = original
    return classmethod(method)


def install_models(families: Collection[str]) -> list[str]:
    """Wrap the three classmethods of every class in MODEL_MODULES of one of `families` (whose
    layer class is hooked) that defines them (a subclass inherits the wrapped ones, which read
    its own originals). Idempotent."""
    done = []
    for module_name, family in MODEL_MODULES.items():
        if family not in families:
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # a model module may fail on import for reasons of its own
            logger.debug("replayssm: %s not importable (%s); its pages not sized", module_name, e)
            continue
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != module_name:
                continue
            for name in (MODEL_SHAPE, MODEL_DTYPE, MODEL_COPY):
                own = cls.__dict__.get(name)
                fn = own.__func__ if isinstance(own, classmethod) else None
                if fn is not None and not hasattr(fn, "_replayssm_original"):
                    wrap = _copy_method(family, fn) if name == MODEL_COPY else (
                        _model_method(name, family, fn))  # fmt: skip
                    setattr(cls, name, wrap)
                    done.append(f"{module_name}.{cls.__name__}.{name}")
    return done
