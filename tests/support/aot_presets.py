"""AOT presets of the GPU test suites: what each GPU test file loads, prebuilt with
`python -m replayssm_jit aot --presets-from tests/support/aot_presets.py --preset NAME --out DIR`."""

from __future__ import annotations

from replayssm_jit.core.models import MODELS
from replayssm_jit.families import FAMILIES, get_family
from replayssm_jit.families.spec import KernelSpec, checkpoint_tilings, family_spec
from replayssm_jit.jit.presets import model_spec, model_specs


def _preset_verify_tests() -> list[KernelSpec]:
    """What tests/protocol/test_verify_gpu.py loads: every model shape and KDA's GVA shape (2 value heads
    per key head), L = 4 and 16, T = 2, 4 and 8, FP32 activations (outputs held to 1e-5) and
    checkpoints."""
    specs = [
        spec
        for family in FAMILIES
        for spec in model_specs(family, (4, 16), ("f32",), ("f32",), drafts=(2, 4, 8))
    ]
    specs += [
        family_spec("kda", head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=w,
                    drafts=t, act_dtype="f32", state_dtype="f32")
        for w in (4, 16)
        for t in (2, 4, 8)
    ]  # fmt: skip
    return specs


def _preset_sanitizer() -> list[KernelSpec]:
    """What scripts/sanitize_kernels.py loads (its --check-preset compares): one small shape per
    family that can split (GDN's K = 128 gives the capped-register state kernel its tile), with
    every input path's flags (Mamba-2 z too), conventional (L = 1) and L = 4 replay, BF16
    activations, FP32 / BF16 / BF16 with stochastic rounding / FP16 checkpoints; and the same
    at L = 4 with T = 2 and 4 drafts (the verify, commit and snapshot kernels); e4m3 checkpoints (with and without stochastic rounding, no drafts), FP32
    with an e4m3 read copy at L = 4 (Mamba-2 and GDN); nvfp4 ones, and FP32 with an nvfp4 read
    copy where the family has separate mode."""
    shapes = {
        "mamba2": dict(headdim=64, dstate=64, heads_per_group=2),
        "gdn": dict(head_k_dim=128, head_v_dim=64, value_heads_per_key_head=2),
        "kda": dict(head_k_dim=128, head_v_dim=64, value_heads_per_key_head=2),
    }
    flags = {
        "mamba2": ("d", "dt_bias", "dt_softplus", "z"),
        "gdn": ("gates_in_kernel", "qk_l2norm"),
        "kda": ("gates_in_kernel", "qk_l2norm"),
    }
    states = (("f32", ()), ("bf16", ()), ("bf16", ("sr", "device_seed")), ("f16", ()))
    # (window, drafts): conventional, the L = 4 replay step, and L = 4 with T = 2 and 4 drafts
    windows = ((1, 1), (4, 1), (4, 2), (4, 4))
    specs = []
    for family, dims in shapes.items():
        for window, drafts in windows:
            for state, sr in states:
                spec = family_spec(family, window=window, drafts=drafts, act_dtype="bf16",
                                   state_dtype=state, flags=(*flags[family], *sr),
                                   **dims)  # fmt: skip
                specs.append(spec)
        for sr in ((), ("sr", "device_seed")):
            for window in (1, 4):
                specs.append(family_spec(family, window=window, act_dtype="bf16", state_dtype="e4m3",
                                         flags=(*flags[family], *sr), **dims))  # fmt: skip
            for read in ("e4m3", "nvfp4"):
                if get_family(family).read_copy and (read == "e4m3" or get_family(family).nvfp4):
                    specs.append(family_spec(family, window=4, act_dtype="bf16", state_dtype="f32",
                                             read_dtype=read, flags=(*flags[family], *sr),
                                             **dims))  # fmt: skip
            if get_family(family).nvfp4:
                for window in (1, 4):
                    specs.append(family_spec(family, window=window, act_dtype="bf16",
                                             state_dtype="nvfp4", flags=(*flags[family], *sr),
                                             **dims))  # fmt: skip
    return specs


def _preset_kda_tests() -> list[KernelSpec]:
    """What tests/kda/test_kda_gpu.py loads: K = V = 128 with 1 (Kimi-Linear, the Kimi-K3 shard)
    and 2 (GVA) value heads per key head; FP32 at L = 1, 4, 16, 32 (L = 1 also serves the
    conventional step), precomputed gates at L = 16, and BF16 activations with FP32, BF16 and
    FP16 checkpoints (with and without stochastic rounding) at L = 16 and conventional."""
    dims = dict(head_k_dim=128, head_v_dim=128)
    specs = [
        family_spec("kda", value_heads_per_key_head=vph, window=w, act_dtype="f32",
                    state_dtype="f32", **dims)
        for vph in (1, 2)
        for w in (1, 4, 16, 32)
    ]  # fmt: skip
    specs += [
        family_spec("kda", value_heads_per_key_head=vph, window=16, act_dtype="f32",
                    state_dtype="f32", flags=("qk_l2norm",), **dims)
        for vph in (1, 2)
    ]  # fmt: skip
    gates = get_family("kda").default_flags
    for state, sr in (("f32", ()), ("bf16", ()), ("bf16", ("sr",)), ("f16", ()), ("f16", ("sr",))):
        specs.append(family_spec("kda", value_heads_per_key_head=1, window=16, act_dtype="bf16",
                                 state_dtype=state, flags=(*gates, *sr), **dims))  # fmt: skip
    specs.append(family_spec("kda", value_heads_per_key_head=1, window=1, act_dtype="bf16",
                             state_dtype="f32", **dims))  # fmt: skip
    return specs


def _preset_checkpoint_formats() -> list[KernelSpec]:
    """FP8 checkpoints at every model shape (L = 16 and conventional, BF16 activations, with and
    without stochastic rounding) and, for the Mamba-2 and GDN models whose heads one row tile
    serves for both copies (not nano4b's headdim 80), separate mode's FP32, FP16 + SR and BF16 +
    SR carried copies with an e4m3 read copy."""
    specs = []
    for model in MODELS.values():
        flags = get_family(model.family).default_flags
        for window in (1, 16):
            for sr in ((), ("sr",)):
                specs.append(model_spec(model, window=window, act_dtype="bf16",
                                        state_dtype="e4m3", flags=(*flags, *sr)))  # fmt: skip
        separate = get_family(model.family).read_copy
        if separate and checkpoint_tilings(model.d_v, model.d_k, ("f32", "e4m3")):
            for state, sr in (("f32", ()), ("f32", ("sr",)), ("f16", ("sr",)), ("bf16", ("sr",))):
                specs.append(model_spec(model, window=16, act_dtype="bf16", state_dtype=state,
                                        read_dtype="e4m3", flags=(*flags, *sr)))  # fmt: skip
    return specs


def _preset_paged_tests() -> list[KernelSpec]:
    """What tests/ops/test_paged_slots.py loads (its CASES: every slot tensor a view into one
    buffer of cache pages): Mamba-2 H = 6, P = 16, N = 32, G = 3 and GDN / KDA H = 2, HV = 4,
    K = V = 32, L = 4, BF16 activations; FP32 checkpoints with T = 2 drafts, and without drafts
    e4m3 (Mamba-2, KDA), nvfp4 (GDN) and FP32 with a BF16 read copy (GDN); the flags of a plan
    with no options."""
    import torch

    from replayssm_jit.families.layout import family_layout
    from replayssm_jit.ops.plan import plan_decode

    dims = {
        "mamba2": dict(num_heads=6, headdim=16, dstate=32, ngroups=3),
        "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32),
        "kda": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32),
    }
    cases = [("mamba2", "f32", None), ("mamba2", "e4m3", None), ("gdn", "f32", None),
             ("gdn", "nvfp4", None), ("gdn", "f32", "bf16"), ("kda", "f32", None),
             ("kda", "e4m3", None)]  # fmt: skip
    specs = []
    for family, state, read in cases:
        drafts = 2 if state == "f32" and read is None else 1
        layout = family_layout(family, window=4, drafts=drafts, state_dtype=state,
                               read_dtype=read, **dims[family])  # fmt: skip
        specs.append(plan_decode(layout, 4, device=torch.device("cpu")).spec)
    return specs


def _preset_flush_mask_tests() -> list[KernelSpec]:
    """What tests/protocol/test_flush_mask_gpu.py loads: its FAMILIES' layouts (Mamba-2 H = 16,
    P = 64, N = 128, G = 2; GDN H = 2, HV = 4 and KDA H = HV = 4, K = V = 128), L = 8, no
    drafts, FP32 activations, FP32 and BF16 checkpoints, planned with the flush mask."""
    import torch

    from replayssm_jit.families.layout import family_layout
    from replayssm_jit.ops.plan import plan_decode

    dims = {
        "mamba2": dict(num_heads=16, headdim=64, dstate=128, ngroups=2),
        "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128),
        "kda": dict(num_k_heads=4, num_v_heads=4, head_k_dim=128, head_v_dim=128),
    }
    specs = []
    for family, shape in dims.items():
        for state in (torch.float32, torch.bfloat16):
            layout = family_layout(family, window=8, drafts=1, state_dtype=state,
                                   act_dtype=torch.float32, **shape)  # fmt: skip
            plan = plan_decode(layout, 6, device=torch.device("cpu"), flush_mask=True)
            specs.append(plan.spec)
    return specs


def _preset_verify_formats_tests() -> list[KernelSpec]:
    """What tests/protocol/test_verify_formats_gpu.py and test_verify_nan.py load
    (support/verify_formats.py's shapes, FP32 activations, L = 4, T = 3, with and without
    stochastic rounding where something is rounded): Mamba-2 H = 2, G = 1, P = N = 32 and GDN H = 1, HV = 2, K = V = 32
    (l2norm, gates formed outside) on FP32, e4m3 and NVFP4 checkpoints and FP32 with e4m3, BF16
    and NVFP4 read copies; KDA as GDN on FP32, e4m3 and NVFP4."""
    import torch

    from replayssm_jit.families.layout import family_layout
    from replayssm_jit.ops.plan import plan_decode

    f8, f4, f32 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.float32
    delta = dict(num_k_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=32)
    families = {
        "mamba2": (dict(num_heads=2, headdim=32, dstate=32, ngroups=1),
                   dict(has_D=True, has_z=False, has_dt_bias=True, dt_softplus=True),
                   [(f32, None), (f8, None), (f4, None), (f32, f8), (f32, torch.bfloat16), (f32, f4)]),
        "gdn": (delta, dict(use_qk_l2norm=True, gates_in_kernel=False),
                [(f32, None), (f8, None), (f4, None), (f32, f8), (f32, torch.bfloat16), (f32, f4)]),
        "kda": (delta, dict(use_qk_l2norm=True, gates_in_kernel=False),
                [(f32, None), (f8, None), (f4, None)]),
    }  # fmt: skip
    specs = []
    for family, (dims, options, cases) in families.items():
        for state, read in cases:
            layout = family_layout(family, window=4, drafts=3, state_dtype=state, read_dtype=read,
                                   act_dtype=torch.float32, **dims)  # fmt: skip
            for sr in (False, True) if state != f32 or read is not None else (False,):
                plan = plan_decode(layout, 3, device=torch.device("cpu"), stochastic_rounding=sr,
                                   **options)  # fmt: skip
                specs.append(plan.spec)
    return specs


PRESETS = {
    "verify-formats-tests": _preset_verify_formats_tests,
    "flush-mask-tests": _preset_flush_mask_tests,
    "checkpoint-formats": _preset_checkpoint_formats,
    "kda-tests": _preset_kda_tests,
    "paged-tests": _preset_paged_tests,
    "sanitizer": _preset_sanitizer,
    "verify-tests": _preset_verify_tests,
}


def every_preset() -> dict:
    """The package's presets, these and the benchmarks' (for tests that render them all)."""
    from pathlib import Path

    from replayssm_jit.cli.aot import load_presets
    from replayssm_jit.jit.presets import PRESETS as PACKAGE_PRESETS

    benchmarks = load_presets(Path(__file__).parents[2] / "benchmarks" / "aot_presets.py")
    return {**PACKAGE_PRESETS, **PRESETS, **benchmarks}
