"""The AOT presets the package ships: named lists of specializations to prebuild.

`python -m replayssm_jit aot --preset NAME` builds one (`--list` prints its URIs); test and
benchmark suites keep their own presets beside them (tests/support/aot_presets.py,
benchmarks/aot_presets.py) and pass them with `--presets-from FILE`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from replayssm_jit.core.models import MODELS, ModelShape
from replayssm_jit.families import FAMILIES, HeadShape, get_family
from replayssm_jit.families.spec import KernelSpec, family_spec, make_spec

__all__ = ["PRESETS", "model_spec", "model_specs", "preset_specs"]


def model_spec(model: ModelShape, **kwargs) -> KernelSpec:
    """The spec of `model`'s SSM layer shape (window, dtypes and flags from kwargs)."""
    shape = HeadShape(model.key_heads, model.value_heads, model.d_k, model.d_v)
    return make_spec(model.family, shape, **kwargs)


def model_specs(family, windows, act_dtypes, state_dtypes, extra_flags=(), flags=None,
                 drafts=(1,)):  # fmt: skip
    """Every model of `family` x window x act dtype x state dtype x drafts, with `flags`
    (default: the family's default flags) plus `extra_flags`."""
    flags = (*(get_family(family).default_flags if flags is None else flags), *extra_flags)
    return [
        model_spec(model, window=window, drafts=t, act_dtype=act, state_dtype=state, flags=flags)
        for model in MODELS.values()
        if model.family == family
        for window in windows
        for t in drafts
        for act in act_dtypes
        for state in state_dtypes
    ]


def preset_ci() -> list[KernelSpec]:
    return [family_spec("mamba2", headdim=64, dstate=128, heads_per_group=16, window=16)]


def preset_models() -> list[KernelSpec]:
    return [
        spec
        for family in FAMILIES
        for spec in model_specs(family, (1, 16), ("bf16",), ("f32", "bf16"))
    ]


def preset_h200() -> list[KernelSpec]:
    """What the H200 GPU tests and benchmarks load."""
    specs = []
    for family in FAMILIES:
        specs += model_specs(family, (1, 4, 16, 32), ("f32",), ("f32",))
        specs += model_specs(family, (1, 4, 8, 16, 32), ("bf16",), ("f32", "bf16"))
        specs += model_specs(family, (16,), ("bf16",), ("bf16", "f16"), ("sr",))
    specs += model_specs("mamba2", (16,), ("bf16",), ("f16",))
    # The seed read from a device tensor (tests/protocol/test_seed_tensor_gpu.py's shapes).
    specs += [
        family_spec("mamba2", headdim=64, dstate=128, heads_per_group=16, state_dtype="bf16",
                    flags=(*get_family("mamba2").default_flags, "sr", "device_seed")),
        family_spec("gdn", head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2,
                    state_dtype="bf16", flags=(*get_family("gdn").default_flags, "sr", "device_seed")),
    ]  # fmt: skip
    specs += model_specs("gdn", (1, 16), ("bf16",), ("f16",))
    specs += model_specs("mamba2", (16,), ("bf16",), ("f32",), ("z",))
    odd = dict(headdim=24, dstate=64, heads_per_group=2, act_dtype="f32", state_dtype="f32")
    specs += [
        family_spec("mamba2", window=w, flags=("d", "z", "dt_bias", "dt_softplus"), **odd)
        for w in (1, 4, 16, 32)
    ]
    # GDN's small test shape, and precomputed g / beta (the caller forms the gates).
    k64 = dict(head_k_dim=64, head_v_dim=64, value_heads_per_key_head=2, act_dtype="f32")
    specs += [family_spec("gdn", window=w, state_dtype="f32", **k64) for w in (1, 4, 16, 32)]
    specs += model_specs("gdn", (16,), ("f32",), ("f32",), flags=("qk_l2norm",))
    specs += [family_spec("gdn", window=16, state_dtype="f32", flags=("qk_l2norm",), **k64)]
    return specs


PRESETS: dict[str, Callable[[], list[KernelSpec]]] = {
    "ci": preset_ci,
    "models": preset_models,
    "h200": preset_h200,
}


def preset_specs(
    names: list[str], presets: Mapping[str, Callable[[], list[KernelSpec]]] | None = None
) -> list[KernelSpec]:
    """The specs of the named presets (of `presets`, default PRESETS), each URI once."""
    presets = PRESETS if presets is None else presets
    specs: dict[str, KernelSpec] = {}
    for name in names:
        if name not in presets:
            raise ValueError(f"preset: expected one of {sorted(presets)}, got {name!r}")
        for spec in presets[name]():
            specs[spec.uri] = spec
    return list(specs.values())
