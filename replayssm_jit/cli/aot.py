"""`python -m replayssm_jit aot --out DIR [--preset NAME ...] [--spec SPEC ...]`: build
specializations ahead of time into DIR (REPLAYSSM_AOT_DIR then points the loader at it).

`python -m replayssm_jit aot wheel --out DIST ...` builds the same modules, for sm_90a by
default, into an installable `replayssm-jit-cache` wheel (jit/wheel.py), which the loader
searches after REPLAYSSM_AOT_DIR. `--presets-from FILE` adds the presets a Python file defines
in a PRESETS dict (the test suites' own: tests/support/aot_presets.py, benchmarks/aot_presets.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from replayssm_jit.families import FAMILIES
from replayssm_jit.families.spec import KernelSpec, family_spec
from replayssm_jit.jit import env
from replayssm_jit.jit.aot import build_aot
from replayssm_jit.jit.presets import PRESETS, preset_specs
from replayssm_jit.jit.wheel import build_wheel, check_setuptools

__all__ = ["load_presets", "main", "parse_spec"]


def load_presets(path: Path) -> dict:
    """PRESETS of the Python file at `path` (name -> a function returning KernelSpecs)."""
    spec = importlib.util.spec_from_file_location(f"_replayssm_presets_{path.stem}", path)
    if spec is None or not path.is_file():
        raise ValueError(f"--presets-from: expected a Python file, got {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    presets = getattr(module, "PRESETS", None)
    if not isinstance(presets, dict) or not all(callable(f) for f in presets.values()):
        raise ValueError(f"--presets-from: {path} defines no PRESETS dict of functions")
    return presets


def _presets(argv: list[str]) -> dict:
    """The package's presets plus those of every --presets-from FILE in `argv`."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--presets-from", type=Path, action="append", default=[])
    known, _ = early.parse_known_args(argv)
    presets = dict(PRESETS)
    for path in known.presets_from:
        try:
            presets.update(load_presets(path))
        except ValueError as exc:
            early.error(str(exc))
    return presets


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


def _parser(prog: str, description: str, out_help: str, presets: dict) -> argparse.ArgumentParser:
    """The options both commands take: what to build, how many compiles at once, --list."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, help=out_help)
    parser.add_argument(
        "--preset",
        action="append",
        default=[],
        choices=sorted(presets),
        help="a list of specializations; repeatable (default: models, unless --spec is given)",
    )
    parser.add_argument(
        "--presets-from",
        type=Path,
        action="append",
        default=[],
        help="a Python file whose PRESETS dict adds presets (e.g. tests/support/aot_presets.py)",
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
    parser: argparse.ArgumentParser, argv: list[str], presets: dict
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
        chosen += preset_specs(args.preset or ["models"], presets)
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
    presets = _presets(argv)
    parser = _parser(
        "python -m replayssm_jit aot wheel",
        f"Build an installable {env.CACHE_DISTRIBUTION} wheel of prebuilt modules, versioned "
        f"as this replayssm_jit, for REPLAYSSM_CUDA_ARCH_LIST (default {' '.join(WHEEL_ARCHS)}).",
        "the folder the wheel is written to (required unless --list)",
        presets,
    )
    args, specs = _parse(parser, argv, presets)
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
    presets = _presets(argv)
    parser = _parser(
        "python -m replayssm_jit aot",
        "Build specializations ahead of time into a folder.",
        "output directory (required unless --list)",
        presets,
    )
    parser.epilog = (
        f"`aot wheel [options]` builds an installable {env.CACHE_DISTRIBUTION} wheel instead."
    )
    args, specs = _parse(parser, argv, presets)
    if args.list:
        print("\n".join(s.uri for s in specs))
        return 0
    archs, jobs = _build_settings(parser, args, None)
    print(f"building {len(specs)} modules for {' '.join(archs)} into {args.out}", file=sys.stderr)
    build_aot(specs, args.out, jobs, archs)
    return 0
