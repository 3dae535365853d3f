"""HuggingFace transformers drop-in: a model's SSM layers decode through the ReplaySSM ops.

    from replayssm_jit.integrations import hf

    hf.patch(model, mode="replay", window=16)   # NemotronH, Qwen3-Next, Qwen3.5 (dense / MoE)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=128)
    hf.unpatch(model)                           # the model's own forwards again

Checkpoint formats (docs/precision.md) are patch options: state_dtype (float32, bfloat16,
float16, float8_e4m3fn), read_dtype (separate mode's read copy: Mamba-2 and GDN), and
stochastic_rounding with its seed.

Each SSM mixer (NemotronHMamba2Mixer; Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,
Qwen3_5MoeGatedDeltaNet) gets an instance-level forward. Prefill and every call that is not a
one-token cached decode run the model's own forward unchanged. A one-token decode keeps the
mixer's projections, HF's causal conv update and its gated norm and output projection, and
replaces only the SSM state update and readout with mamba2_decode / gdn_decode on a slot pool
the patch owns (one slot per batch row). At the first decode step after a prefill the slots are
loaded with HF's prefill state (reset_slots(layout, pool, slots, initial_state=...)).

HF's cache keeps its conv states (HF updates them), but its SSM state goes stale while the
slots decode: it is written back (materialize_slots) before HF's own code reads it again
through a patched layer, when another cache takes the layer over, by write_back(model) and by
unpatch(model). Beam search (cache.reorder_cache) is not followed: use greedy or sampling.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from replayssm_jit.checks import check_bool, check_int
from replayssm_jit.families.layout import CacheLayout, gdn_layout, mamba2_layout
from replayssm_jit.ops import (
    gdn_decode,
    mamba2_decode,
    materialize_slots,
    plan_decode,
    reset_slots,
)
from replayssm_jit.ops.plan import MODES, DecodePlan

__all__ = ["SUPPORTED_MODEL_TYPES", "HFPatch", "patch", "patched_layers", "unpatch", "write_back"]

# config.model_type values whose SSM mixers this module knows (the text configs included).
SUPPORTED_MODEL_TYPES = (
    "nemotron_h",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
# Mixer class name -> family; matched by name so that transformers stays an optional import.
_MIXER_FAMILIES = {
    "NemotronHMamba2Mixer": "mamba2",
    "Qwen3NextGatedDeltaNet": "gdn",
    "Qwen3_5GatedDeltaNet": "gdn",
    "Qwen3_5MoeGatedDeltaNet": "gdn",
}
_NO_FORWARD = object()  # marks a mixer that had no instance-level forward before the patch

# Patched models and their patch; weak, so a patch never keeps a model alive.
_PATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------------------------
# One patched SSM layer
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class PatchedLayer:
    """One mixer's decode through our ops: its layout, slot pool, plans and the HF cache whose
    state the slots currently hold (None when they hold none)."""

    mixer: torch.nn.Module
    family: str
    layout: CacheLayout
    mode: str
    stagger_flushes: bool
    launch_config: object
    original_forward: Callable
    saved_instance_forward: object
    stochastic_rounding: bool = False
    seed: int = 0
    pool: dict[str, torch.Tensor] = field(default_factory=dict)
    plans: dict[int, DecodePlan] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    held_cache: weakref.ref | None = None
    decode_steps: int = 0

    # -- the patched forward ------------------------------------------------------------------

    def forward(self, hidden_states=None, cache=None, attention_mask=None, **kwargs):
        """The mixer's forward: our SSM step on a one-token cached decode, HF's own otherwise."""
        cache = kwargs.pop("cache_params", cache)  # (the name older callers use)
        if not self._is_cached_decode(hidden_states, cache, kwargs):
            if cache is not None:
                self._write_back_if_held(cache)
            return self.original_forward(
                hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
            )
        if self._held() is not cache:
            self._load_prefill_state(cache, batch=hidden_states.shape[0])
        self.decode_steps += 1
        decode = _mamba2_decode if self.family == "mamba2" else _gdn_decode
        return decode(self, hidden_states, cache, attention_mask)

    def _is_cached_decode(self, hidden_states, cache, kwargs) -> bool:
        """Whether HF would take its one-token recurrent path (the only one we replace)."""
        if cache is None or not isinstance(hidden_states, torch.Tensor) or self.mixer.training:
            return False
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            return False
        if kwargs.get("cu_seq_lens_q") is not None:  # packed sequences: HF's varlen path
            return False
        index = self.mixer.layer_idx
        return (
            not cache.is_recording_past(index)
            and cache.get_conv_state(index) is not None
            and cache.get_recurrent_state(index) is not None
        )

    # -- slots --------------------------------------------------------------------------------

    def _held(self):
        return None if self.held_cache is None else self.held_cache()

    def plan(self, batch: int) -> DecodePlan:
        if batch not in self.plans:
            # The slot ids are ours (0..batch-1 or pads): no host read of them per step.
            self.plans[batch] = plan_decode(
                self.layout, batch, device=self.device, mode=self.mode, check_slot_values=False,
                config=self.launch_config, seed=self.seed, **self.plan_options(),
            )  # fmt: skip
        return self.plans[batch]

    def plan_options(self) -> dict:
        """The family's plan() options: HF's gates and norms, and the rounding."""
        options = (
            dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True)
            if self.family == "mamba2"
            else dict(use_qk_l2norm=True, gates_in_kernel=False)  # g, beta computed as HF does
        )
        return options | {"stochastic_rounding": self.stochastic_rounding}

    def step_seed(self) -> int | None:
        """The seed of the current decode step: None (the plan's) except for conventional SR,
        whose noise has no flush epoch to key it: each step then gets a seed of its own."""
        if not (self.stochastic_rounding and self.mode == "conventional"):
            return None
        return ((self.seed << 32) + self.decode_steps) & (2**63 - 1)

    @property
    def device(self) -> torch.device:
        return self.mixer.A_log.device

    def _load_prefill_state(self, cache, batch: int) -> None:
        """Slots 0..batch-1 start from HF's prefill state (the SSM state its prefill left)."""
        held = self._held()
        if held is not None:
            self._write_back(held)  # another cache takes the layer over: the old one gets its state
        if not self.pool or self.pool["state"].shape[0] != batch:
            self.pool = self.layout.allocate(batch, self.device)
        hf_state = cache.get_recurrent_state(self.mixer.layer_idx)
        # GDN: HF keeps [HV, K, V] per row, we keep [HV, V, K] (a transposed read, no copy).
        ours = hf_state if self.family == "mamba2" else hf_state.transpose(-1, -2)
        reset_slots(self.layout, self.pool, list(range(batch)), initial_state=ours)
        self.params = _layer_params(self.mixer, self.family)
        self.held_cache = weakref.ref(cache)
        if self.stagger_flushes and self.mode == "replay":
            _stagger(self, batch)

    def _write_back_if_held(self, cache) -> None:
        if self._held() is cache:
            self._write_back(cache)

    def _write_back(self, cache) -> None:
        """HF's cache gets the slots' exact current states (checkpoint with held records folded
        in FP32); the slots are then released."""
        batch = self.pool["state"].shape[0]
        fold_params = {"A": self.params["A"]} if self.family == "mamba2" else {}
        states = materialize_slots(self.plan(batch), self.pool, list(range(batch)), **fold_params)
        hf_state = cache.get_recurrent_state(self.mixer.layer_idx)
        if hf_state is not None:
            hf_state.copy_(states if self.family == "mamba2" else states.transpose(-1, -2))
        self.held_cache = None


def _layer_params(mixer, family: str) -> dict[str, torch.Tensor]:
    """The per-head float32 parameters our ops take, read at each load (weights may change)."""
    with torch.no_grad():
        if family == "mamba2":
            return {
                "A": (-torch.exp(mixer.A_log.float())).contiguous(),
                "D": mixer.D.float().contiguous(),
                "dt_bias": mixer.dt_bias.float().contiguous(),
            }
        return {}


def _stagger(layer: PatchedLayer, batch: int) -> None:
    """Row r starts holding (r * L) // batch neutral records, so that rows flush at different
    steps and a launch mixes flush and non-flush rows. A neutral record has zero step (dt = 0,
    Mamba-2; g = 0 and u = 0, GDN): decay exp(0) = 1 and a zero contribution, so it changes no
    state or output."""
    window = layer.layout.window
    offsets = [(row * window) // batch for row in range(batch)]
    plan = layer.plan(batch)
    shape, dtype, device = layer.layout.shape, layer.layout.act_dtype, layer.device
    for step in range(max(offsets)):
        slots = torch.tensor([r if offsets[r] > step else plan.pad_slot_id for r in range(batch)],
                             dtype=torch.int32, device=device)  # fmt: skip
        if layer.family == "mamba2":
            H, G, P, N = shape.value_heads, shape.key_heads, shape.value_dim, shape.key_dim
            zeros_x = torch.zeros(batch, H, P, dtype=dtype, device=device)
            zeros_b = torch.zeros(batch, G, N, dtype=dtype, device=device)
            # softplus(-inf) = 0 exactly: the record's dt is zero.
            dt = torch.full((batch, H), float("-inf"), device=device)
            mamba2_decode(plan, **layer.pool, x=zeros_x, dt=dt, B=zeros_b, C=zeros_b,
                          slot_indices=slots, **layer.params)  # fmt: skip
        else:
            H, HV, K, V = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
            zeros_qk = torch.zeros(batch, H, K, dtype=dtype, device=device)
            zeros_gate = torch.zeros(batch, HV, device=device)
            gdn_decode(plan, **layer.pool, q=zeros_qk, k=zeros_qk,
                       v=torch.zeros(batch, HV, V, dtype=dtype, device=device), g=zeros_gate,
                       beta=zeros_gate, slot_indices=slots)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The decode paths: HF's projections, conv and norm around our SSM step
# ---------------------------------------------------------------------------------------------


def _modeling(mixer):
    """The transformers modeling module the mixer's class comes from (its conv functions)."""
    return sys.modules[type(mixer).__module__]


def _conv_update(mixer, mixed: torch.Tensor, cache) -> torch.Tensor:
    """HF's own causal conv update of [batch, 1, channels] (it updates the cache's conv state);
    returns [batch, channels]."""
    conv_state = cache.get_conv_state(mixer.layer_idx)
    out = _modeling(mixer).causal_conv1d_update(
        mixed.transpose(1, 2),
        conv_state,
        mixer.conv1d.weight.squeeze(1),
        mixer.conv1d.bias,
        activation=mixer.activation,
    )
    return out[:, :, 0]


def _slot_ids(layer: PatchedLayer, batch: int) -> torch.Tensor:
    return torch.arange(batch, dtype=torch.int32, device=layer.device)


def _mamba2_decode(layer: PatchedLayer, hidden_states, cache, attention_mask):
    mixer = layer.mixer
    modeling = _modeling(mixer)
    batch, dtype = hidden_states.shape[0], hidden_states.dtype
    shape = layer.layout.shape
    H, G, P, N = shape.value_heads, shape.key_heads, shape.value_dim, shape.key_dim
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    projected = mixer.in_proj(hidden_states)
    gate, x_b_c, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)
    x_b_c = _conv_update(mixer, x_b_c, cache)
    if attention_mask is not None:
        x_b_c = modeling.apply_mask_to_padding_states(x_b_c[:, None], attention_mask)[:, 0]
    x, B, C = torch.split(x_b_c, [H * P, G * N, G * N], dim=-1)
    # The ops want each row 16-byte aligned: split views of one projection may not be.
    y = mamba2_decode(
        layer.plan(batch), **layer.pool,
        x=x.reshape(batch, H, P).contiguous(), B=B.reshape(batch, G, N).contiguous(),
        C=C.reshape(batch, G, N).contiguous(), dt=dt[:, 0].float().contiguous(),
        slot_indices=_slot_ids(layer, batch), seed=layer.step_seed(), **layer.params,
    )  # fmt: skip
    scan_output = mixer.norm(y.reshape(batch, 1, H * P), gate)
    return mixer.out_proj(scan_output.to(dtype))


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


def _gdn_decode(layer: PatchedLayer, hidden_states, cache, attention_mask):
    mixer = layer.mixer
    hidden_states = _modeling(mixer).apply_mask_to_padding_states(hidden_states, attention_mask)
    batch = hidden_states.shape[0]
    shape = layer.layout.shape
    H, HV, K, V = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
    mixed, z, b, a = _gdn_inputs(mixer, hidden_states)
    mixed = _conv_update(mixer, mixed, cache)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    # The gates as HF forms them: beta in the activation dtype, g in FP32.
    beta = b[:, 0].sigmoid().float()
    g = -mixer.A_log.float().exp() * F.softplus(a[:, 0].float() + mixer.dt_bias)
    o = gdn_decode(
        layer.plan(batch), **layer.pool,
        q=q.reshape(batch, H, K).contiguous(), k=k.reshape(batch, H, K).contiguous(),
        v=v.reshape(batch, HV, V).contiguous(), g=g.contiguous(), beta=beta.contiguous(),
        slot_indices=_slot_ids(layer, batch), seed=layer.step_seed(),
    )  # fmt: skip
    normed = mixer.norm(o.reshape(-1, V), z.reshape(-1, V))
    return mixer.out_proj(normed.reshape(batch, 1, HV * V))


# ---------------------------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class HFPatch:
    """What patch() changed on a model: its patched SSM layers, in model order."""

    model_type: str
    layers: list[PatchedLayer]


def _layout_of(mixer, family: str, window: int, state_dtype, read_dtype=None) -> CacheLayout:
    """The mixer's layout (the spec checks the formats: e.g. a KDA read_dtype raises)."""
    act_dtype = mixer.out_proj.weight.dtype
    common = dict(window=window, state_dtype=state_dtype, act_dtype=act_dtype,
                  read_dtype=read_dtype)  # fmt: skip
    if family == "mamba2":
        return mamba2_layout(
            num_heads=mixer.num_heads, headdim=mixer.head_dim, dstate=mixer.ssm_state_size,
            ngroups=mixer.n_groups, **common,
        )  # fmt: skip
    return gdn_layout(
        num_k_heads=mixer.num_k_heads, num_v_heads=mixer.num_v_heads,
        head_k_dim=mixer.head_k_dim, head_v_dim=mixer.head_v_dim, **common,
    )  # fmt: skip


def _patched_layer(mixer, family, mode, window, formats, stagger_flushes, launch_config):
    """formats: state_dtype, read_dtype, stochastic_rounding and seed. The layer is planned
    once on the CPU (nothing compiled) so that a combination its plans would refuse (a
    conventional read copy, SR of an FP32 checkpoint, a launch config) raises here."""
    layer = PatchedLayer(
        mixer=mixer, family=family,
        layout=_layout_of(mixer, family, window, formats["state_dtype"], formats["read_dtype"]),
        mode=mode, stagger_flushes=bool(stagger_flushes), launch_config=launch_config,
        original_forward=mixer.forward,
        saved_instance_forward=vars(mixer).get("forward", _NO_FORWARD),
        stochastic_rounding=formats["stochastic_rounding"], seed=formats["seed"],
    )  # fmt: skip
    plan_decode(layer.layout, 1, device="cpu", mode=mode, check_slot_values=False,
                config=launch_config, seed=layer.seed, **layer.plan_options())  # fmt: skip
    return layer


def _check_cache_api() -> None:
    """The decode path reads HF's conv and SSM states through the Cache accessors transformers
    5 has (older versions kept them in per-model cache classes)."""
    from transformers.cache_utils import Cache

    needed = ("get_conv_state", "get_recurrent_state", "is_recording_past")
    missing = [name for name in needed if not hasattr(Cache, name)]
    if missing:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__}: expected a Cache with {list(needed)} "
            f"(transformers 5), missing {missing}"
        )


def _model_type(model) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", type(model).__name__))


def patch(
    model: torch.nn.Module,
    mode: str = "replay",
    window: int = 16,
    *,
    state_dtype: torch.dtype | str = torch.float32,
    read_dtype: torch.dtype | str | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    stagger_flushes: bool = False,
    launch_config=None,
) -> HFPatch:
    """Make `model`'s SSM layers decode through our ops; returns what was patched.

    mode: "replay" (ReplaySSM: checkpoint + ring of `window` records) or "conventional" (our
        state-update step).
    state_dtype: the checkpoint dtype (HF itself keeps FP32 states): torch.float32 / bfloat16
        / float16 / float8_e4m3fn or their names ("f32", "bf16", "f16", "e4m3"). e4m3 keeps a
        FP32 scale per state row and needs heads that a kernel row tile fits (a key dim that
        is a multiple of 16; not 16 x 16). The activation dtype is the model's.
    read_dtype: separate mode's narrower read copy, which non-flush steps read ("e4m3",
        "bf16", "f16"; None: one copy). Mamba-2 (NemotronH) and GDN (Qwen3-Next), mode="replay"
        only, with heads that one row tile fits for both copies (e.g. headdim 32, dstate 64).
    stochastic_rounding: round the stored checkpoint (and the read copy) stochastically; needs
        a 16-bit or e4m3 state_dtype, or a read copy.
    seed: its seed (an int; every layer gets the same one, as from an engine). Replay keys the
        noise by the slot's flush epoch (a reload after HF read the state starts the epochs
        again); conventional steps have no epoch and get the seed (seed << 32) + step, a new
        one every decode step.
    stagger_flushes: spread the rows' flushes over the window (row r of a batch of b starts
        with (r * window) // b neutral records), so a launch mixes flush and non-flush rows as
        an engine's batch does.
    launch_config: a LaunchConfig for the plans (None: the launch policy's).

    Raises ValueError for a model type without supported SSM mixers, a model already patched,
    or a combination the layouts or plans refuse (a GDN read copy, a read copy with
    mode="conventional", SR of an FP32 checkpoint, heads no e4m3 tile fits); TypeError for an
    argument of the wrong type. A patch that raises changes nothing.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: model type {model_type!r} is not supported; expected one of "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    _check_cache_api()
    if model in _PATCHES:
        raise ValueError("model: already patched (call unpatch(model) first)")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    formats = dict(state_dtype=state_dtype, read_dtype=read_dtype,
                   stochastic_rounding=check_bool("stochastic_rounding", stochastic_rounding),
                   seed=check_int("seed", seed))  # fmt: skip
    mixers = [
        (m, _MIXER_FAMILIES[type(m).__name__])
        for m in model.modules()
        if type(m).__name__ in _MIXER_FAMILIES
    ]
    if not mixers:
        raise ValueError(
            f"model: model type {model_type!r} has no SSM mixer this patch knows "
            f"({sorted(_MIXER_FAMILIES)})"
        )
    # Every layout is checked before any forward is replaced, so a failed patch changes nothing.
    layers = [
        _patched_layer(mixer, family, mode, window, formats, stagger_flushes, launch_config)
        for mixer, family in mixers
    ]
    for layer in layers:
        layer.mixer.forward = layer.forward
    handle = HFPatch(model_type, layers)
    _PATCHES[model] = handle
    return handle


def patched_layers(model: torch.nn.Module) -> list[PatchedLayer]:
    """The patched SSM layers of `model` ([] when it is not patched)."""
    handle = _PATCHES.get(model)
    return [] if handle is None else list(handle.layers)


def write_back(model: torch.nn.Module) -> None:
    """Write each patched layer's current state into the HF cache it is decoding, so that the
    cache (e.g. generate()'s returned past_key_values) holds exact states; decoding on reloads
    them (a sync and a state copy per layer: not for every step)."""
    for layer in patched_layers(model):
        held = layer._held()
        if held is not None:
            layer._write_back(held)


def unpatch(model: torch.nn.Module) -> None:
    """Restore `model` exactly as it was before patch() (live HF caches get their states back
    first). Raises ValueError when the model is not patched."""
    handle = _PATCHES.get(model)
    if handle is None:
        raise ValueError("model: not patched (patch(model) first)")
    write_back(model)
    for layer in handle.layers:
        del layer.mixer.forward
        if layer.saved_instance_forward is not _NO_FORWARD:
            layer.mixer.forward = layer.saved_instance_forward
    del _PATCHES[model]
