"""AOT presets of the benchmarks: `python -m replayssm_jit aot --presets-from
benchmarks/aot_presets.py --preset NAME --out DIR`."""

from __future__ import annotations

from replayssm_jit.families import FAMILIES
from replayssm_jit.families.spec import KernelSpec
from replayssm_jit.jit.presets import model_specs


def _preset_verify_bench() -> list[KernelSpec]:
    """What benchmarks/bench_verify.py loads: every model shape at L = 16, T = 1 (the standard
    step it compares with), 2, 4 and 8, BF16 activations, FP32 checkpoints (and BF16 with
    stochastic rounding at T = 4)."""
    specs = []
    for family in FAMILIES:
        specs += model_specs(family, (16,), ("bf16",), ("f32",), drafts=(1, 2, 4, 8))
        specs += model_specs(family, (16,), ("bf16",), ("bf16",), ("sr",), drafts=(4,))
    return specs


PRESETS = {"verify-bench": _preset_verify_bench}
