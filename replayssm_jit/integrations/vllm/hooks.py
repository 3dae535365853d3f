"""What register() installs, beside the SSU backend, so that vLLM's GDN and KDA layers decode on
ReplaySSM and every SSM layer's slot lifecycle holds, with no engine edit (plugin.py calls
install(); docs/integrations.md lists the vLLM files read).

Decode and MTP. vLLM's GDN layer (Qwen3-Next / Qwen3.5, gdn/qwen_gdn_linear_attn.py) and KDA
layer (Kimi-Linear, gdn/kimi_gdn_linear_attn.py) call module-level kernel functions through the
names their module binds at import (DECODE_NAMES). vLLM has no registry for these kernels (the
SSU backend registry is Mamba-2's only), and CustomOp / PluggableLayer.register_oot replace a
whole class, whose decode branches would then have to be copied; so these names are rebound in
those modules to ReplaySSM entries. Only decode and MTP calls use these names: the prefill's
chunk kernels (chunk_gated_delta_rule, chunk_kda_with_fused_gate, Mamba-2's chunked scan) are
left as they are.

Slot lifecycle. A prefill writes its final state into ssm_state[idx], our checkpoint; the records
the slot's cursor still holds (a recycled slot's) would then be replayed on top of it. Each
layer class is replaced, through vLLM's own PluggableLayer / CustomOp.register_oot, by a
subclass whose core method (the one that runs the prefill and writes the state) calls vLLM's
and then drops the cursors of the slots the prefill wrote (HeldReset: index ops on the device,
no host sync, no Python loop per slot, pads untouched). Where vLLM runs a batch's decode rows
through the chunk kernel too (Kimi-Linear's KDA layer; GDN before vLLM peeled decodes off), it
reads their ssm_state[idx] as the start state, so their held records are first folded into the
checkpoint (HeldReset.flush, through materialize_states).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from replayssm_jit.integrations.vllm import page_hooks
from replayssm_jit.integrations.vllm.backend import NULL_BLOCK_ID, ReplaySSMBackend, VLLMLayer
from replayssm_jit.jit import env
from replayssm_jit.ops.prefix import materialize_states

__all__ = [
    "DECODE_NAMES", "HOOKS", "HeldReset", "check_cache_mode", "drafts_hint", "flush_held",
    "install", "reset_held",
]  # fmt: skip

logger = logging.getLogger("replayssm_jit.vllm")

GDN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
KDA_MODULE = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
# mamba_mixer2 moved into mamba2/ in newer vLLM; either may be the one a model imports.
MAMBA2_MODULES = (
    "vllm.model_executor.layers.mamba.mamba_mixer2",
    "vllm.model_executor.layers.mamba.mamba2.mamba_mixer2",
)
CUSTOM_OP = "vllm.model_executor.custom_op"
FORWARD_CONTEXT = "vllm.forward_context"

DECODE_NAMES = {
    GDN_MODULE: ("fused_sigmoid_gating_delta_rule_update",
                 "fused_recurrent_gated_delta_rule_packed_decode"),
    KDA_MODULE: ("fused_recurrent_kda",),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Slot lifecycle: the slots a prefill wrote, read from the layer's attention metadata
# ---------------------------------------------------------------------------------------------


def _gdn_prefill_slots(md) -> torch.Tensor | None:
    """Newer vLLM names the chunk kernel's slots (decodes peeled off); older vLLM ran every
    non-spec row through the chunk kernel and wrote them all."""
    slots = getattr(md, "prefill_state_indices", None)
    return md.non_spec_state_indices_tensor if slots is None else slots


def _kda_prefill_slots(md) -> torch.Tensor | None:
    return md.non_spec_state_indices_tensor


def _mamba2_prefill_slots(md) -> torch.Tensor | None:
    slots = getattr(md, "state_indices_tensor_p", None)
    if slots is None:  # older vLLM: one table, decodes first
        slots = md.state_indices_tensor[md.num_decodes :]
    return slots


def _continuing(slots: torch.Tensor | None, has_initial_state) -> torch.Tensor | None:
    """The slots of rows that continue a sequence (decode rows, a prefill's later chunks); a
    first chunk's rows become pads: their state starts from zero, and their cursor words are
    not reset yet (a page vLLM hands out again holds whatever it held)."""
    if slots is None or not isinstance(has_initial_state, torch.Tensor):
        return slots
    if has_initial_state.shape != slots.shape:
        return slots
    return torch.where(has_initial_state.to(slots.device), slots, NULL_BLOCK_ID)


def _mamba2_fold_params(module) -> dict:
    """The mixer's A ([H] float32 per rank), which the records' decays need."""
    return {"A": module.A.detach().to(torch.float32)}


def _with_initial_state(slots: torch.Tensor | None, flags) -> torch.Tensor | None:
    """The prefill rows flagged as starting from a state, the others pads; None (no row) where
    the flags are missing: a first chunk's page may hold any cursor words."""
    if slots is None or not isinstance(flags, torch.Tensor) or flags.shape != slots.shape:
        return None
    return _continuing(slots, flags)


def _kda_flush_slots(md) -> torch.Tensor | None:
    """Kimi-Linear runs every non-spec row of a batch with a prefill (decodes too) through the
    chunk kernel, from ssm_state[idx]."""
    return _continuing(md.non_spec_state_indices_tensor, getattr(md, "has_initial_state", None))


def _gdn_flush_slots(md) -> torch.Tensor | None:
    """Older vLLM ran a mixed batch's decode rows through the chunk kernel too; newer vLLM
    peels them off (prefill_state_indices), and a prefill's own slots hold no records (but see
    _gdn_cached_slots)."""
    if getattr(md, "prefill_state_indices", None) is None:
        return _continuing(md.non_spec_state_indices_tensor,
                           getattr(md, "has_initial_state", None))  # fmt: skip
    return None


def _gdn_cached_slots(md) -> torch.Tensor | None:
    """Newer vLLM's prefill rows that start from a state (prefill_has_initial_state)."""
    slots = getattr(md, "prefill_state_indices", None)
    return _with_initial_state(slots, getattr(md, "prefill_has_initial_state", None))


def _mamba2_cached_slots(md) -> torch.Tensor | None:
    """The prefill rows that start from a state (has_initial_states_p)."""
    return _with_initial_state(_mamba2_prefill_slots(md), getattr(md, "has_initial_states_p", None))


@dataclass(frozen=True)
class Hook:
    """A layer class (of `family`) whose method (the first of `methods` it has) runs the
    prefill and writes the state: `prefill_slots` names the slots written, `flush_slots` those
    whose current state the chunk kernel reads from ssm_state[idx] (decode rows in a batch with
    a prefill)."""

    family: str
    module: str
    cls: str
    methods: tuple[str, ...]
    prefill_slots: Callable[[object], torch.Tensor | None]
    flush_slots: Callable[[object], torch.Tensor | None] = lambda md: None
    # In align mode, the prefill rows that start from a state: a block from the prefix cache is
    # copied with its records (a later chunk's slot holds none: the reset after each chunk).
    cached_slots: Callable[[object], torch.Tensor | None] = lambda md: None
    fold_params: Callable[[object], dict] = lambda module: {}  # the fold's (materialize_states)


HOOKS = (
    Hook("gdn", GDN_MODULE, "QwenGatedDeltaNetAttention", ("_forward_core",),
         _gdn_prefill_slots, _gdn_flush_slots, _gdn_cached_slots),
    Hook("kda", KDA_MODULE, "KimiGatedDeltaNetAttention", ("_forward",), _kda_prefill_slots,
         _kda_flush_slots),
    *(Hook("mamba2", m, "MambaMixer2", ("conv_ssm_forward", "forward_cuda"),
           _mamba2_prefill_slots, cached_slots=_mamba2_cached_slots,
           fold_params=_mamba2_fold_params)
      for m in MAMBA2_MODULES),
)  # fmt: skip


class HeldReset:
    """Zero the cursor rows (records held, epoch, arrivals, pending: as reset_slots leaves
    them) of the slots an index tensor names, on the device. Rows naming the pad id, a
    negative id or an id past the pool are pads: their target is the pad row, written back
    with its own bits. Buffers are made once (grown only for a larger index, eagerly), so a
    call allocates nothing and reads nothing on the host."""

    def __init__(self, cursors: torch.Tensor, pad_slot_id: int) -> None:
        self.cursors, self.pad = cursors, pad_slot_id
        slots = cursors.shape[0]
        # A pad row's write must land on a row no live id names: vLLM's null block.
        self.pad_row = pad_slot_id if 0 <= pad_slot_id < slots else 0
        self.states: torch.Tensor | None = None  # flush's FP32 states, made at its first use
        self._grow(slots)

    def _grow(self, n: int) -> None:
        dev = self.cursors.device
        self.target = torch.empty(n, dtype=torch.int64, device=dev)
        self.is_pad = torch.empty(n, dtype=torch.bool, device=dev)
        self.scratch = torch.empty(n, dtype=torch.bool, device=dev)
        self.rows = torch.empty(n, self.cursors.shape[1], dtype=self.cursors.dtype, device=dev)

    def _targets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(target rows, pad mask) of `slots` in the buffers; None for no rows."""
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"slots: expected a torch.Tensor, got {type(slots).__name__}")
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise TypeError(f"slots: expected an integer tensor, got dtype {slots.dtype}")
        ids = slots.reshape(-1)
        n = ids.numel()
        if n == 0:
            return None
        if n > self.target.numel():
            self._grow(n)
        target, is_pad, scratch = self.target[:n], self.is_pad[:n], self.scratch[:n]
        target.copy_(ids)
        torch.eq(target, self.pad, out=is_pad)
        torch.lt(target, 0, out=scratch)
        is_pad.logical_or_(scratch)
        torch.ge(target, self.cursors.shape[0], out=scratch)
        is_pad.logical_or_(scratch)
        target.masked_fill_(is_pad, self.pad_row)
        return target, is_pad

    def __call__(self, slots: torch.Tensor) -> None:
        found = self._targets(slots)
        if found is None:
            return
        target, is_pad = found
        rows = self.rows[: target.shape[0]]
        torch.index_select(self.cursors, 0, target, out=rows)
        rows.mul_(is_pad.unsqueeze(1))  # live rows zero, pad rows their own bits
        self.cursors.index_copy_(0, target, rows)

    def flush(self, layer: VLLMLayer, slots: torch.Tensor, params: dict | None = None) -> None:
        """Fold the records `slots` hold into their checkpoints, then drop them: the
        checkpoint becomes the current state, which vLLM's chunk kernel reads. A pad's target
        (the null block, which holds no records) is rewritten with its own bits: a plain
        checkpoint decodes exactly to FP32 and back."""
        found = self._targets(slots)
        plan = next(iter(layer._rows.values())).plan if layer._rows else None
        if found is None or plan is None:  # a layer that never decoded holds nothing
            return
        target, _ = found
        n, state = target.shape[0], layer.pool["state"]
        if self.states is None or self.states.shape[1] < n:
            self.states = torch.empty(1, max(n, self.target.numel()), *state.shape[1:],
                                      dtype=torch.float32, device=state.device)  # fmt: skip
            self.table = torch.empty(1, self.states.shape[1], dtype=torch.int32,
                                     device=state.device)  # fmt: skip
        table, out = self.table[:, :n], self.states[:, :n]
        table[0].copy_(target)
        materialize_states(plan, [layer.pool], table, out, params=[params or {}])
        state.index_copy_(0, target, out[0].to(state.dtype))
        self(slots)


_RESETS: dict[int, HeldReset] = {}
_PLAIN = (torch.float32, torch.bfloat16, torch.float16)


def _reset_of(layer: VLLMLayer | page_hooks.PageSlots) -> HeldReset:
    cursors = layer.pool["cursors"]
    reset = _RESETS.get(cursors.data_ptr())
    if reset is None or reset.cursors is not cursors:
        reset = _RESETS[cursors.data_ptr()] = HeldReset(cursors, layer.pad_slot_id)
    return reset


def reset_held(layer: VLLMLayer | page_hooks.PageSlots, slots: torch.Tensor) -> None:
    """Drop the records `slots` hold in `layer` (after vLLM wrote their checkpoints): a
    registered layer, or before its first decode its tensors in vLLM's pages, whose cursor
    words are whatever the page held (vLLM does not zero a block it hands out)."""
    _reset_of(layer)(slots)


def flush_held(layer: VLLMLayer, slots: torch.Tensor, params: dict | None = None) -> None:
    """Fold the records `slots` hold into their checkpoints (before vLLM's chunk kernel reads
    them as decode rows' initial states). Plain checkpoints only: an e4m3 / nvfp4 one is
    refused (ValueError), since vLLM's own state tensor never has those dtypes."""
    if layer.layout.checkpoint_names != ("state",) or layer.state.dtype not in _PLAIN:
        raise ValueError(
            f"state: expected a float32, bfloat16 or float16 checkpoint to flush into, got "
            f"{layer.state.dtype} with {layer.layout.checkpoint_names}"
        )
    _reset_of(layer).flush(layer, slots, params)


# The process-wide layers and the drafts each state's layer class declares (1 + num_spec).
_STATE: dict[str, object] = {"backend": None, "forward_context": None}
_DRAFTS: dict[int, int] = {}


def _backend() -> ReplaySSMBackend:
    return _STATE["backend"]


def _ssm_state(module: object) -> torch.Tensor | None:
    """vLLM binds (conv_state, ssm_state) to layer.kv_cache (older vLLM: one pair per virtual
    engine)."""
    kv = getattr(module, "kv_cache", None)
    if isinstance(kv, (list, tuple)) and kv and isinstance(kv[0], (list, tuple)):
        kv = kv[0]
    if isinstance(kv, (list, tuple)) and len(kv) > 1 and isinstance(kv[1], torch.Tensor):
        return kv[1]
    return None


def _metadata(module: object) -> list:
    """The layer's attention metadata of this step (a list under micro-batching; empty in the
    profile run, where vLLM passes none)."""
    md = _STATE["forward_context"]().attn_metadata
    mds = md if isinstance(md, list) else [md]
    prefix = getattr(module, "prefix", None)
    return [m[prefix] for m in mds if isinstance(m, dict) and prefix in m]


def _lifecycle_class(base: type, method: str, hook: Hook) -> type:
    """A subclass of vLLM's layer class whose `method` flushes the decode rows the chunk kernel
    will read, runs vLLM's method (which sees vLLM's own kv_cache entries), and resets the slots
    the prefill wrote; with REPLAYSSM_VLLM_PAGES, its state shapes and dtypes declare the
    layout's tensors in the layer's pages (page_hooks.py)."""
    original = getattr(base, method)

    def core(self, *args, **kwargs):
        mds = _metadata(self)
        state = _ssm_state(self) if mds else None
        if state is not None and state.numel():
            _DRAFTS[state.data_ptr()] = 1 + int(getattr(self, "num_spec", 0) or 0)
        layer = _backend()._layers.get(state.data_ptr()) if state is not None else None
        # Before the layer's first decode its cursors are its pages' (none without pages).
        owner = layer if layer is not None or state is None else page_hooks.bind(self)
        prefills = [md for md in mds if getattr(md, "num_prefills", 0)] if owner else []
        for md in prefills if layer is not None else ():
            slots = hook.flush_slots(md)
            if slots is not None:
                flush_held(layer, slots, hook.fold_params(self))
            slots = hook.cached_slots(md) if self.__dict__.get(ALIGNED) else None
            if slots is not None:
                flush_held(layer, slots, hook.fold_params(self))
        full = page_hooks.narrow(self)
        try:
            result = original(self, *args, **kwargs)
        finally:
            if full is not None:
                self.kv_cache = full
        for md in prefills:
            slots = hook.prefill_slots(md)
            if slots is not None:
                reset_held(owner, slots)
        return result

    def __init__(self, *args, **kwargs):
        aligned = check_cache_mode() == "align"
        base.__init__(self, *args, **kwargs)
        self.__dict__[ALIGNED] = aligned

    core.__name__, core.__qualname__ = method, f"ReplaySSM{base.__name__}.{method}"
    core.__doc__ = f"vLLM's {base.__name__}.{method}, then the prefill's slots reset."
    __init__.__qualname__ = f"ReplaySSM{base.__name__}.__init__"
    members = {"__init__": __init__, method: core, "__module__": __name__, "_replayssm_base": base}
    members.update(page_hooks.state_methods(hook.family, base))
    return type(f"ReplaySSM{base.__name__}", (base,), members)


ALIGNED = "_replayssm_align_mode"  # a layer built under vLLM's align mode


def check_cache_mode() -> str:
    """At layer construction, vLLM's prefix caching for Mamba layers (cache_config.
    mamba_cache_mode): "align" is taken with the rings and cursors in vLLM's pages (vLLM's block
    copies then move them with the checkpoint, through the copy specs page_hooks declares) and
    without speculative decoding (vLLM would copy the accepted draft's block, while a verify
    keeps its drafts pending in one); "all" (a decode reading one block and writing another) is
    refused, as is "align" otherwise: a block taken from the prefix cache would replay records
    of another sequence, wrong outputs with no error. Returns the mode taken."""
    config = page_hooks.current_vllm_config()
    mode = getattr(getattr(config, "cache_config", None), "mamba_cache_mode", "none")
    if mode in (None, "none"):
        return "none"
    spec = getattr(config, "speculative_config", None)
    num_spec = int(getattr(spec, "num_speculative_tokens", 0) or 0)
    if mode == "align" and env.vllm_pages() and num_spec == 0:
        return mode
    why = (
        "'align' needs the rings and cursors in vLLM's pages (REPLAYSSM_VLLM_PAGES=1)"
        if mode == "align" and not env.vllm_pages()
        else f"'align' takes no speculative decoding (num_speculative_tokens {num_spec})"
        if mode == "align"
        else "'all' (a decode reading one block and writing another) is not supported"
    )
    raise ValueError(
        f"mamba_cache_mode: expected 'none', or 'align' with REPLAYSSM_VLLM_PAGES=1 and no "
        f"speculative decoding, got {mode!r} ({why}); start vLLM with "
        f"--no-enable-prefix-caching, or without REPLAYSSM_VLLM"
    )


# ---------------------------------------------------------------------------------------------
# Decode and MTP: the names vLLM's GDN / KDA modules call, rebound to ReplaySSM entries
# ---------------------------------------------------------------------------------------------


def _named(args: tuple, kwargs: dict, position: int, name: str, default=None) -> object:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _kda_raw(args: tuple, kwargs: dict) -> bool:
    """fused_recurrent_kda's two forms: the raw-gate wrapper takes A_log sixth; fla's (the one
    Kimi-Linear's layer imports) takes scale there, or nothing."""
    return "A_log" in kwargs or (len(args) > 5 and isinstance(args[5], torch.Tensor))


# name -> (our method, position of initial_state)
_METHODS = {
    "fused_sigmoid_gating_delta_rule_update": ("fused_sigmoid_gating_delta_rule_update", 10),
    "fused_recurrent_gated_delta_rule_packed_decode": (
        "fused_recurrent_gated_delta_rule_packed_decode", 6),
    "fused_recurrent_kda": ("fused_recurrent_kda", 8),
    "fused_recurrent_kda_fla": ("fused_recurrent_kda_fla", 6),
}  # fmt: skip


def _decode_entry(name: str, original: Callable) -> Callable:
    def entry(*args, **kwargs):
        key = name
        if name == "fused_recurrent_kda" and not _kda_raw(args, kwargs):
            key = "fused_recurrent_kda_fla"
        method, position = _METHODS[key]
        state = _named(args, kwargs, position, "initial_state")
        if not isinstance(state, torch.Tensor):
            raise TypeError(
                f"initial_state: expected vLLM's [slots, HV, V, K] state tensor, got "
                f"{type(state).__name__}"
            )
        layer = _backend()._layers.get(state.data_ptr())
        if layer is None:
            layer = _register_delta(key, state, args, kwargs)
        return getattr(layer, method)(*args, **kwargs)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = f"vLLM's {name}, decoded by ReplaySSM (the original is __wrapped__)."
    entry.__wrapped__ = original
    entry._replayssm_entry = True
    return entry


def _register_delta(key: str, state: torch.Tensor, args: tuple, kwargs: dict) -> VLLMLayer:
    """A GDN or KDA layer for `state` from its first call: HV, V, K from the state, key heads
    from q (or mixed_qkv's width), drafts from the layer class (1 + num_spec) or the indices;
    its rings and cursors in its pages where it declared them there."""
    if state.dim() != 4:
        raise ValueError(f"initial_state: expected [slots, HV, V, K], got {list(state.shape)}")
    _, HV, V, K = state.shape
    options: dict[str, object] = {}
    if key == "fused_recurrent_gated_delta_rule_packed_decode":
        mixed = _named(args, kwargs, 0, "mixed_qkv")
        H, act = (mixed.shape[-1] - HV * V) // (2 * K), mixed.dtype
        idx, scale = _named(args, kwargs, 8, "ssm_state_indices"), _named(args, kwargs, 5, "scale")
        l2 = _named(args, kwargs, 9, "use_qk_l2norm_in_kernel", False)
    else:
        spots = {"fused_sigmoid_gating_delta_rule_update": (4, 13, 9, 15, False),
                 "fused_recurrent_kda": (0, 10, None, None, True),
                 "fused_recurrent_kda_fla": (0, 10, 5, 8, True)}[key]  # fmt: skip
        q = _named(args, kwargs, spots[0], "q")
        H, act = q.shape[-2], q.dtype
        idx = _named(args, kwargs, spots[1], "ssm_state_indices")
        scale = None if spots[2] is None else _named(args, kwargs, spots[2], "scale")
        l2 = (
            spots[4]
            if spots[3] is None
            else _named(args, kwargs, spots[3], "use_qk_l2norm_in_kernel", spots[4])
        )
    if key == "fused_recurrent_kda":
        options["lower_bound"] = _named(args, kwargs, 7, "lower_bound")
    if key == "fused_recurrent_kda_fla":
        options["gates_in_kernel"] = False
    if scale is not None:
        options["scale"] = float(scale)
    width = idx.shape[1] if isinstance(idx, torch.Tensor) and idx.dim() == 2 else 1
    drafts = _DRAFTS.get(state.data_ptr(), width)
    family = "kda" if key.startswith("fused_recurrent_kda") else "gdn"
    layout = page_hooks.layer_layout(family, (HV, V, K), H, act_dtype=act,
                                     state_dtype=state.dtype, drafts=drafts)  # fmt: skip
    return _backend().register(state, layout, page_hooks.page_pool(state, layout),
                               pad_slot_id=NULL_BLOCK_ID, use_qk_l2norm=bool(l2),
                               **options)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# install()
# ---------------------------------------------------------------------------------------------


def _import(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except Exception as e:  # a model module may fail on import for reasons of its own
        logger.debug("replayssm: %s not importable (%s); not hooked", name, e)
        return None


def drafts_hint(state: torch.Tensor) -> int | None:
    """1 + num_spec of the layer class that last ran on `state` (None before its first step)."""
    return _DRAFTS.get(state.data_ptr())


def install(backend: ReplaySSMBackend) -> list[str]:
    """Register the lifecycle subclasses, then rebind the decode names of the GDN / KDA modules
    whose layer class is hooked (a decode on ReplaySSM without the reset would replay stale
    records after a prefill), and with REPLAYSSM_VLLM_PAGES size the model classes' pages
    (page_hooks.install_models); returns what is installed. Idempotent; a class another plugin
    already replaced is left alone, and so are its module's decode names (logged)."""
    custom_op, forward_context = _import(CUSTOM_OP), _import(FORWARD_CONTEXT)
    if custom_op is None or forward_context is None:
        return []
    _STATE["backend"], _STATE["forward_context"] = backend, forward_context.get_forward_context
    done: list[str] = []
    hooked: set[str] = set()
    families: set[str] = set()
    registry = custom_op.op_registry_oot
    for hook in HOOKS:
        module = _import(hook.module)
        cls = getattr(module, hook.cls, None) if module is not None else None
        method = next((m for m in hook.methods if hasattr(cls, m)), None)
        if cls is None or method is None or not hasattr(cls, "register_oot"):
            continue
        current = registry.get(cls.__name__)
        if current is None:
            cls.register_oot(_lifecycle_class(cls, method, hook))
        elif getattr(current, "_replayssm_base", None) is not cls:
            logger.warning("replayssm: %s is already replaced by %s (another plugin); its "
                           "slots cannot be reset after a prefill, so its decode stays vLLM's",
                           cls.__name__, current)  # fmt: skip
            continue
        hooked.add(hook.module)
        families.add(hook.family)
        done.append(f"{hook.module}.{cls.__name__}.{method}")
    if env.vllm_pages():  # the classes vLLM sizes a hybrid model's padded page from
        done += page_hooks.install_models(families)
    for module_name, names in DECODE_NAMES.items():
        module = _import(module_name) if module_name in hooked else None
        for name in names if module is not None else ():
            fn = getattr(module, name, None)
            if fn is None:
                continue
            if not getattr(fn, "_replayssm_entry", False):
                setattr(module, name, _decode_entry(name, fn))
            done.append(f"{module_name}.{name}")
    if not any(h.module in hooked for h in HOOKS if h.cls == "MambaMixer2"):
        logger.warning("replayssm: vLLM's MambaMixer2 is not hooked; a Mamba-2 slot refilled by "
                       "a prefill needs reset_slots before its first decode")  # fmt: skip
    return done
