"""patch / unpatch / write_back: a transformers model's SSM layers decode through our ops."""

from __future__ import annotations

import inspect
import warnings
import weakref
from dataclasses import dataclass

import torch

from replayssm_jit.core.checks import check_bool, check_int
from replayssm_jit.integrations.hf.layer import NO_FORWARD, PatchedLayer
from replayssm_jit.integrations.hf.mixers import MIXERS, adapter_of, layout_of
from replayssm_jit.ops.plan import MODES

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TESTED_TRANSFORMERS",
    "HFPatch",
    "patch",
    "patched_layers",
    "unpatch",
    "write_back",
]

# config.model_type values whose SSM mixers the drop-in knows (the text configs included).
SUPPORTED_MODEL_TYPES = (
    "kimi_linear",
    "nemotron_h",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
# The transformers releases the drop-in's tests ran against: the oldest with the Cache state
# accessors it reads, and the newest (the test extra's upper bound admits no later one).
TESTED_TRANSFORMERS = ("5.21.0", "5.25.0")

# Patched models and their patch; weak, so a patch never keeps a model alive.
_PATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WARNED_VERSIONS: set[str] = set()


@dataclass(eq=False)
class HFPatch:
    """What patch() changed on a model: its patched SSM layers, in model order."""

    model_type: str
    layers: list[PatchedLayer]


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; pre-release and local tails are dropped."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers + [0] * (3 - len(numbers)))


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than the tested range (its Cache lacks the state accessors
    the decode reads); warn once for a newer one (its cache bookkeeping may have moved, as the
    token count did in 5.25: the drop-in follows HF's own conv function, but is untested there).
    """
    if version is None:
        import transformers

        version = transformers.__version__
    oldest, newest = TESTED_TRANSFORMERS
    tested = f">={oldest}, <={newest}"
    if _release(version) < _release(oldest):
        raise RuntimeError(
            f"transformers {version}: the HF drop-in needs transformers {tested} (the Cache "
            "state accessors of 5.21 on); upgrade transformers"
        )
    if _release(version)[:2] > _release(newest)[:2] and version not in _WARNED_VERSIONS:
        _WARNED_VERSIONS.add(version)
        warnings.warn(
            f"transformers {version} is newer than the HF drop-in was tested with ({tested}): "
            "decoding follows HF's own conv and cache calls, but check the logits against "
            "unpatched decoding",
            RuntimeWarning,
            stacklevel=3,
        )


def _model_type(model) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", type(model).__name__))


def _cache_kwarg(forward) -> str:
    """The name of the mixer forward's cache parameter: "cache" (transformers >= 5.22) or
    "cache_params" (5.21)."""
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters or "cache_params" not in parameters else "cache_params"


def _patched_layer(mixer, adapter, mode, formats, stagger_flushes, launch_config):
    """The layer is planned once on the CPU (nothing compiled) so that a combination its plans
    would refuse (a conventional read copy, SR of an FP32 checkpoint, a launch config) raises
    here."""
    layer = PatchedLayer(
        mixer=mixer, adapter=adapter, layout=layout_of(mixer, adapter, formats), mode=mode,
        formats=formats, stagger_flushes=bool(stagger_flushes), launch_config=launch_config,
        original_forward=mixer.forward,
        saved_instance_forward=vars(mixer).get("forward", NO_FORWARD),
        cache_kwarg=_cache_kwarg(mixer.forward),
    )  # fmt: skip
    layer.make_plan(1, "cpu")
    return layer


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

    Parameters
    ----------
    model : a transformers model whose config.model_type is in SUPPORTED_MODEL_TYPES
        (NemotronH: Mamba-2; Qwen3-Next, Qwen3.5 dense and MoE: GDN; Kimi-Linear: KDA).
    mode : "replay" (ReplaySSM: checkpoint + ring of `window` records) or "conventional" (our
        state-update step).
    window : records per flush, >= 1 (replay). window=1 flushes every step: each step folds
        its own record, the state traffic of a conventional step.
    state_dtype : the checkpoint (HF itself keeps FP32 states): torch.float32 / bfloat16 /
        float16 / float8_e4m3fn or the names "f32", "bf16", "f16", "e4m3", "nvfp4". e4m3 keeps
        an FP32 scale per state row, nvfp4 a head scale and a scale per 16 values; both need
        heads that a kernel row tile fits (e.g. not 16 x 16).
    read_dtype : separate mode's narrower read copy, which non-flush steps read ("e4m3",
        "nvfp4", "bf16", "f16"; None: one copy). Mamba-2 and GDN with mode="replay" and
        window >= 2, with heads that one row tile fits for both copies (NemotronH headdim 32
        / dstate 64 fits e4m3; the Nemotron-3-Nano-4B head, headdim 80 / dstate 128, fits
        none). KDA refuses it.
    stochastic_rounding : round the stored checkpoint (and the read copy) stochastically;
        needs a 16-bit, e4m3 or nvfp4 state_dtype, or a read copy.
    seed : its seed (every layer gets the same one). Replay keys the noise by the slot's
        flush epoch; conventional steps get the seed (seed << 32) + step, one per step.
    stagger_flushes : row r of a batch of b starts with (r * window) // b neutral records, so
        that a launch mixes flush and non-flush rows as an engine's batch does.
    launch_config : a LaunchConfig for the plans (None: the launch policy's).

    Returns
    -------
    HFPatch : the patched layers, in model order.

    The activation dtype is the model's, and follows it: a model cast after patch() decodes
    at its new dtype (the held states are written back and reloaded), or raises ValueError at
    the first decode where the formats refuse that dtype. Beam search is refused at its first
    cache reorder (RuntimeError): the slots cannot follow HF's gather of its stale state.

    Raises ValueError for a model type without supported SSM mixers, a model already patched,
    or a combination the layouts or plans refuse; TypeError for an argument of the wrong type;
    RuntimeError for a transformers older than TESTED_TRANSFORMERS (a newer one warns once).
    A patch that raises changes nothing.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: model type {model_type!r} is not supported; expected one of "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    check_transformers()
    if model in _PATCHES:
        raise ValueError("model: already patched (call unpatch(model) first)")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    formats = dict(window=window, state_dtype=state_dtype, read_dtype=read_dtype,
                   stochastic_rounding=check_bool("stochastic_rounding", stochastic_rounding),
                   seed=check_int("seed", seed))  # fmt: skip
    mixers = [(m, adapter_of(m)) for m in model.modules() if adapter_of(m) is not None]
    if not mixers:
        raise ValueError(
            f"model: model type {model_type!r} has no SSM mixer this patch knows ({sorted(MIXERS)})"
        )
    # Every layout is checked before any forward is replaced, so a failed patch changes nothing.
    layers = [
        _patched_layer(mixer, adapter, mode, formats, stagger_flushes, launch_config)
        for mixer, adapter in mixers
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
        if layer.saved_instance_forward is not NO_FORWARD:
            layer.mixer.forward = layer.saved_instance_forward
    del _PATCHES[model]
