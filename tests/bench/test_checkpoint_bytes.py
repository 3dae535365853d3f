"""benchmarks/checkpoint_bytes.py: the formats' byte counts (docs/precision.md) and the table."""

from __future__ import annotations

import sys

from support.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import checkpoint_bytes as cb

from replayssm_jit.core.models import get_model


def test_formats_count_values_and_scales():
    assert cb.checkpoint_bytes("fp32", 2, 4, 32) == 2 * 4 * 32 * 4
    assert cb.checkpoint_bytes("fp8", 2, 4, 32) == 2 * 4 * 32 + 2 * 4 * 4  # a scale per row
    assert cb.checkpoint_bytes("nvfp4", 2, 4, 32) == 2 * 4 * 32 / 2 + 2 * 4 * 32 / 16 + 2 * 4
    assert cb.checkpoint_bytes(None, 2, 4, 32) == 0


def test_records_follow_the_layouts_and_two_precision_delta_records_keep_v_and_beta():
    qwen, m2 = get_model("qwen4b"), get_model("super120b")
    one = cb.record_bytes(qwen, 1, False)
    assert one == 32 * 128 * 4 + 16 * 128 * 2 + 32 * 4  # u (fp32), k (bf16), g (fp32)
    assert cb.record_bytes(qwen, 1, True) == one + 32 * (128 * 2 + 4)
    assert cb.record_bytes(m2, 17, True) == cb.record_bytes(m2, 17, False)


def test_table_rows(capsys):
    assert cb.main(["--window", "16"]) == 0
    out = capsys.readouterr().out
    assert "ring capacity 17" in out and out.count("\n| ") == len(cb.CONFIGS) + 1


def test_built_formats_match_the_layouts():
    """Where a format is built, the analytic bytes are the layout's (cursors aside): shared FP8
    at every model shape, separate FP32 + FP8 at the Mamba-2 and GDN ones (GDN's records then
    keep v and beta too), and NVFP4 (shared and separate) at the Mamba-2 ones."""
    from replayssm_jit.core.models import MODELS
    from replayssm_jit.families import get_family
    from replayssm_jit.families.layout import family_layout
    from replayssm_jit.families.spec import checkpoint_tilings

    for model in MODELS.values():
        args = dict(zip(get_family(model.family).shape_args,
                        (model.key_heads, model.value_heads, model.d_k, model.d_v)))  # fmt: skip
        dims = (model.value_heads, model.d_v, model.d_k)
        cursors = 16
        fam = get_family(model.family)
        configs = [("e4m3", None, cb.checkpoint_bytes("fp8", *dims))]
        for read, name in (("e4m3", "fp8"), ("nvfp4", "nvfp4")):
            built = fam.read_copy and (read == "e4m3" or fam.nvfp4)
            if built and checkpoint_tilings(model.d_v, model.d_k, ("f32", read)):
                both = cb.checkpoint_bytes("fp32", *dims) + cb.checkpoint_bytes(name, *dims)
                configs.append(("f32", read, both))
        if fam.nvfp4:
            configs.append(("nvfp4", None, cb.checkpoint_bytes("nvfp4", *dims)))
        for state, read, ckpt in configs:
            layout = family_layout(model.family, window=16, state_dtype=state, read_dtype=read,
                                   **args)  # fmt: skip
            rings = cb.record_bytes(model, layout.capacity, two_precision=read is not None)
            assert layout.bytes_per_slot() == ckpt + rings + cursors, (model, state, read)
