"""AOT presets of the benchmarks: `python -m replayssm_jit aot --presets-from
benchmarks/aot_presets.py --preset NAME --out DIR`."""

from __future__ import annotations

import sys
from pathlib import Path

from replayssm_jit.families import FAMILIES
from replayssm_jit.families.spec import KernelSpec
from replayssm_jit.jit.presets import model_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import format_spec, parse_format

# Issue 40's formats run (every checkpoint format beside FlashInfer and fla): shape -> formats.
FORMATS_BENCH = {
    "super120b": ("f32", "bf16", "bf16sr", "f16", "e4m3", "f32+e4m3", "f32+nvfp4"),
    "qwen122b": ("f32", "bf16", "e4m3", "f32+e4m3"),
    "kimi48b": ("f32", "bf16"),
}


def _preset_verify_bench() -> list[KernelSpec]:
    """What benchmarks/bench_verify.py loads: every model shape at L = 16, T = 1 (the standard
    step it compares with), 2, 4 and 8, BF16 activations, FP32 checkpoints (and BF16 with
    stochastic rounding at T = 4)."""
    specs = []
    for family in FAMILIES:
        specs += model_specs(family, (16,), ("bf16",), ("f32",), drafts=(1, 2, 4, 8))
        specs += model_specs(family, (16,), ("bf16",), ("bf16",), ("sr",), drafts=(4,))
    return specs


def _preset_formats_bench() -> list[KernelSpec]:
    """What bench_mamba2.py and bench_gdn.py load for FORMATS_BENCH: each format's L = 16
    ReplaySSM spec and, for one checkpoint copy, its conventional step's (L = 1)."""
    return [
        format_spec(shape, window, name)
        for shape, formats in FORMATS_BENCH.items()
        for name in formats
        for window in ((16,) if parse_format(name).read else (16, 1))
    ]


PRESETS = {"verify-bench": _preset_verify_bench, "formats-bench": _preset_formats_bench}
