"""Ahead-of-time builds: `python -m replayssm_jit aot --out DIR [--preset NAME ...] [--spec SPEC ...]`.

DIR gets one folder per specialization (<uri>/<uri>.so and manifest.json). Point
REPLAYSSM_AOT_DIR at DIR and the loader uses these builds before any JIT.

`python -m replayssm_jit aot wheel --out DIST [--preset NAME ...] [--spec SPEC ...]` (or
`python -m replayssm_jit.aot wheel ...`) builds the same modules, for sm_90a by default, into an
installable `replayssm-jit-cache` wheel (jit/wheel.py) whose package `replayssm_jit_cache` the
loader searches after REPLAYSSM_AOT_DIR.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from replayssm_jit.families import FAMILIES, HeadShape, get_family
from replayssm_jit.jit import env
from replayssm_jit.jit.build import build
from replayssm_jit.models import MODELS, ModelShape
from replayssm_jit.spec import KernelSpec, checkpoint_tilings, family_spec, make_spec


def model_spec(model: ModelShape, **kwargs) -> KernelSpec:
    """The spec of `model`'s SSM layer shape (window, dtypes and flags from kwargs)."""
    shape = HeadShape(model.key_heads, model.value_heads, model.d_k, model.d_v)
    return make_spec(model.family, shape, **kwargs)


def _model_specs(family, windows, act_dtypes, state_dtypes, extra_flags=(), flags=None,
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


def _preset_ci() -> list[KernelSpec]:
    return [family_spec("mamba2", headdim=64, dstate=128, heads_per_group=16, window=16)]


def _preset_models() -> list[KernelSpec]:
    return [
        spec
        for family in FAMILIES
        for spec in _model_specs(family, (1, 16), ("bf16",), ("f32", "bf16"))
    ]


def _preset_h200() -> list[KernelSpec]:
    """What the H200 GPU tests and benchmarks load."""
    specs = []
    for family in FAMILIES:
        specs += _model_specs(family, (1, 4, 16, 32), ("f32",), ("f32",))
        specs += _model_specs(family, (1, 4, 8, 16, 32), ("bf16",), ("f32", "bf16"))
        specs += _model_specs(family, (16,), ("bf16",), ("bf16", "f16"), ("sr",))
    specs += _model_specs("mamba2", (16,), ("bf16",), ("f16",))
    # The seed read from a device tensor (tests/test_seed_tensor_gpu.py's shapes).
    specs += [
        family_spec("mamba2", headdim=64, dstate=128, heads_per_group=16, state_dtype="bf16",
                    flags=(*get_family("mamba2").default_flags, "sr", "device_seed")),
        family_spec("gdn", head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2,
                    state_dtype="bf16", flags=(*get_family("gdn").default_flags, "sr", "device_seed")),
    ]  # fmt: skip
    specs += _model_specs("gdn", (1, 16), ("bf16",), ("f16",))
    specs += _model_specs("mamba2", (16,), ("bf16",), ("f32",), ("z",))
    odd = dict(headdim=24, dstate=64, heads_per_group=2, act_dtype="f32", state_dtype="f32")
    specs += [
        family_spec("mamba2", window=w, flags=("d", "z", "dt_bias", "dt_softplus"), **odd)
        for w in (1, 4, 16, 32)
    ]
    # GDN's small test shape, and precomputed g / beta (the caller forms the gates).
    k64 = dict(head_k_dim=64, head_v_dim=64, value_heads_per_key_head=2, act_dtype="f32")
    specs += [family_spec("gdn", window=w, state_dtype="f32", **k64) for w in (1, 4, 16, 32)]
    specs += _model_specs("gdn", (16,), ("f32",), ("f32",), flags=("qk_l2norm",))
    specs += [family_spec("gdn", window=16, state_dtype="f32", flags=("qk_l2norm",), **k64)]
    return specs


def _preset_verify_tests() -> list[KernelSpec]:
    """What tests/test_verify_gpu.py loads: every model shape and KDA's GVA shape (2 value heads
    per key head), L = 4 and 16, T = 2, 4 and 8, FP32 activations (outputs held to 1e-5) and
    checkpoints."""
    specs = [
        spec
        for family in FAMILIES
        for spec in _model_specs(family, (4, 16), ("f32",), ("f32",), drafts=(2, 4, 8))
    ]
    specs += [
        family_spec("kda", head_k_dim=128, head_v_dim=128, value_heads_per_key_head=2, window=w,
                    drafts=t, act_dtype="f32", state_dtype="f32")
        for w in (4, 16)
        for t in (2, 4, 8)
    ]  # fmt: skip
    return specs


def _preset_verify_bench() -> list[KernelSpec]:
    """What benchmarks/bench_verify.py loads: every model shape at L = 16, T = 1 (the standard
    step it compares with), 2, 4 and 8, BF16 activations, FP32 checkpoints (and BF16 with
    stochastic rounding at T = 4)."""
    specs = []
    for family in FAMILIES:
        specs += _model_specs(family, (16,), ("bf16",), ("f32",), drafts=(1, 2, 4, 8))
        specs += _model_specs(family, (16,), ("bf16",), ("bf16",), ("sr",), drafts=(4,))
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
    """What tests/test_kda_gpu.py loads: K = V = 128 with 1 (Kimi-Linear, the Kimi-K3 shard)
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


PRESETS = {
    "ci": _preset_ci,
    "checkpoint-formats": _preset_checkpoint_formats,
    "models": _preset_models,
    "h200": _preset_h200,
    "sanitizer": _preset_sanitizer,
    "verify-tests": _preset_verify_tests,
    "verify-bench": _preset_verify_bench,
    "kda-tests": _preset_kda_tests,
}


def preset_specs(names: list[str]) -> list[KernelSpec]:
    specs: dict[str, KernelSpec] = {}
    for name in names:
        if name not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        for spec in PRESETS[name]():
            specs[spec.uri] = spec
    return list(specs.values())


def build_aot(
    specs: list[KernelSpec], out: Path, jobs: int, archs: list[str] | None = None
) -> list[Path]:
    """Build `specs` in parallel into `out`, keeping only each module and its manifest."""
    out.mkdir(parents=True, exist_ok=True)
    built = []
    with (
        tempfile.TemporaryDirectory(prefix="replayssm-aot-") as scratch,
        ThreadPoolExecutor(jobs) as pool,
    ):
        futures = {pool.submit(build, spec, Path(scratch), archs): spec for spec in specs}
        for future in tqdm(as_completed(futures), total=len(futures), desc="AOT", unit="module"):
            spec = futures[future]
            so_path = future.result()
            dest = out / spec.uri
            dest.mkdir(exist_ok=True)
            shutil.copy2(so_path, dest / so_path.name)
            shutil.copy2(so_path.parent / "manifest.json", dest / "manifest.json")
            built.append(dest / so_path.name)
    return built


def parse_spec(text: str) -> KernelSpec:
    """A spec from the command line: FAMILY:key=value,... with flags joined by '+', e.g.
    mamba2:headdim=64,dstate=128,heads_per_group=16,window=16,state_dtype=bf16,flags=d+dt_softplus"""
    family, _, rest = text.partition(":")
    if family not in FAMILIES:
        raise ValueError(
            f"--spec: expected FAMILY:key=value,... with FAMILY in {sorted(FAMILIES)}, got {text!r}"
        )
    kwargs: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--spec: expected key=value, got {item!r} in {text!r}")
        if key == "flags":
            kwargs[key] = tuple(filter(None, value.split("+")))
        else:
            # (ASCII digits only: str.isdigit() takes '²', which int() rejects)
            kwargs[key] = int(value) if value.isascii() and value.isdigit() else value
    try:
        return family_spec(family, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--spec {text!r}: {exc}") from None


def _parser(prog: str, description: str, out_help: str) -> argparse.ArgumentParser:
    """The options both commands take: what to build, how many compiles at once, --list."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, help=out_help)
    parser.add_argument(
        "--preset",
        action="append",
        default=[],
        choices=sorted(PRESETS),
        help="a list of specializations; repeatable (default: models, unless --spec is given)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="parallel builds (default REPLAYSSM_MAX_JOBS or CPUs)",
    )
    parser.add_argument(
        "--spec",
        action="append",
        default=[],
        help="one specialization, FAMILY:key=value,... (flags joined by '+'); repeatable",
    )
    parser.add_argument("--list", action="store_true", help="print the URIs and exit")
    return parser


def _parse(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[argparse.Namespace, list[KernelSpec]]:
    """The arguments and the specializations they name (each once); bad ones are usage errors."""
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs: expected >= 1, got {args.jobs}")
    try:
        chosen = [parse_spec(text) for text in args.spec]
    except ValueError as exc:
        parser.error(str(exc))
    if args.preset or not chosen:
        chosen += preset_specs(args.preset or ["models"])
    return args, list({spec.uri: spec for spec in chosen}.values())


def _build_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace, default_archs: list[str] | None
) -> tuple[list[str], int]:
    """(archs, jobs) from the environment and --jobs; a bad value is a usage error."""
    if args.out is None:
        parser.error("the following arguments are required: --out")
    try:
        archs = env.cuda_arch_list(default_archs)  # (its errors name REPLAYSSM_CUDA_ARCH_LIST)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        jobs = args.jobs or env.max_jobs()
    except ValueError:
        raw = os.environ.get("REPLAYSSM_MAX_JOBS")
        parser.error(f"REPLAYSSM_MAX_JOBS: expected an int, got {raw!r}")
    return archs, jobs


# The wheel's target unless REPLAYSSM_CUDA_ARCH_LIST says otherwise: Hopper (H100, H200), whatever
# GPU the building machine has.
WHEEL_ARCHS = ["9.0a"]


def _wheel_main(argv: list[str]) -> int:
    from replayssm_jit.jit.wheel import build_wheel, check_setuptools

    parser = _parser(
        "python -m replayssm_jit.aot wheel",
        f"Build an installable {env.CACHE_DISTRIBUTION} wheel of prebuilt modules, versioned "
        f"as this replayssm_jit, for REPLAYSSM_CUDA_ARCH_LIST (default {' '.join(WHEEL_ARCHS)}).",
        "the folder the wheel is written to (required unless --list)",
    )
    args, specs = _parse(parser, argv)
    if args.list:
        print("\n".join(s.uri for s in specs))
        return 0
    archs, jobs = _build_settings(parser, args, WHEEL_ARCHS)
    try:
        check_setuptools()
    except RuntimeError as exc:
        parser.error(str(exc))
    print(f"building {len(specs)} modules for {' '.join(archs)}", file=sys.stderr)
    wheel = build_wheel(specs, args.out, jobs, archs)
    print(wheel)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`aot [options]` builds modules into a folder; `aot wheel [options]` builds a wheel."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["wheel"]:
        return _wheel_main(argv[1:])
    parser = _parser(
        "python -m replayssm_jit aot",
        __doc__.splitlines()[0],
        "output directory (required unless --list)",
    )
    parser.epilog = (
        f"`aot wheel [options]` builds an installable {env.CACHE_DISTRIBUTION} wheel instead."
    )
    args, specs = _parse(parser, argv)
    if args.list:
        print("\n".join(s.uri for s in specs))
        return 0
    archs, jobs = _build_settings(parser, args, None)
    print(f"building {len(specs)} modules for {' '.join(archs)} into {args.out}", file=sys.stderr)
    build_aot(specs, args.out, jobs, archs)
    return 0
