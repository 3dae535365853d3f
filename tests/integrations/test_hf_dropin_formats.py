"""The HF transformers drop-in's checkpoint formats (FP8 e4m3, NVFP4, separate mode's read copy,
stochastic rounding): the tiny models of test_hf_dropin.py follow HF's FP32 decode within each
format's bound, and the formats the layouts refuse raise at patch time."""

from __future__ import annotations

import pytest
import torch
from test_hf_dropin import (
    F32,
    NEW_TOKENS,
    WINDOW,
    forward_schedule,
    generate,
    hf_reference,
    logits_error,
    nemotron_h,
    prompts,
    qwen3_next,
)

from replayssm_jit.integrations import hf

pytest.importorskip("transformers")

# Tiny matmuls: thread hand-offs would dominate on a shared 2-core runner (one thread).
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# Checkpoint formats: FP8 e4m3, separate mode's read copy, stochastic rounding
# ---------------------------------------------------------------------------------------------


def nemotron_h_formats(dtype=F32, seed=0):
    """NemotronH whose heads every format tiles: headdim 32, dstate 64 (test_hf_dropin.py's
    16 x 16 heads fit no e4m3 row tile, and separate mode needs one tile that both copies fit)."""
    return nemotron_h(dtype, seed, headdim=32, dstate=64)


def qwen3_next_formats(dtype=F32, seed=0):
    """Qwen3-Next with K = V = 32 heads (e4m3 and NVFP4 row tiles fit; K = V = 16 has none)."""
    return qwen3_next(dtype, seed, key_dim=32, value_dim=32)


FORMAT_MODELS = {"nemotron_h": nemotron_h_formats, "qwen3_next": qwen3_next_formats}
_FORMAT_RUNS: dict = {}


def format_reference(name):
    """(model, prompt chunks then HF's greedy tokens one at a time, the prompt mask, HF's
    teacher-forced logits [steps, batch, vocab] from the first new token's position on)."""
    if name not in _FORMAT_RUNS:
        model = FORMAT_MODELS[name]()
        ids, mask = prompts()
        hf_tokens, _, _ = generate(model)
        chunks = [ids, *hf_tokens[:, :-1].split(1, dim=1)]
        _FORMAT_RUNS[name] = (model, chunks, mask, _teacher_forced(model, chunks, mask))
    return _FORMAT_RUNS[name]


def _teacher_forced(model, chunks, mask):
    first = chunks[0].shape[1] - 1  # the position whose logits give the first new token
    return forward_schedule(model, chunks, mask)[:, first:].transpose(0, 1)


def run_format(name, **options):
    """Teacher-forced logits through our ops with `options`, and the layers' pools (read
    before write_back releases the slots)."""
    model, chunks, mask, _ = format_reference(name)
    handle = hf.patch(model, window=WINDOW, stagger_flushes=True, **options)
    try:
        logits = _teacher_forced(model, chunks, mask)
        assert all(layer.decode_steps == NEW_TOKENS - 1 for layer in handle.layers)
        pools = [dict(layer.pool) for layer in handle.layers]
        layouts = [layer.layout for layer in handle.layers]
    finally:
        hf.unpatch(model)
    return logits, pools, layouts


E4M3 = torch.float8_e4m3fn
# (model, patch options, bound on the logits error). Measured over the 63 steps (seed 0):
# replay / separate 0.012 to 0.047; conventional FP8+SR, rounded every step, 0.17 to 0.19.
FORMAT_CASES = [
    ("nemotron_h", dict(state_dtype=E4M3), 0.2),
    ("nemotron_h", dict(state_dtype="e4m3", stochastic_rounding=True, seed=5), 0.2),
    ("nemotron_h", dict(read_dtype="e4m3"), 0.2),
    ("nemotron_h", dict(state_dtype=torch.float16, read_dtype="e4m3", stochastic_rounding=True),
     0.2),
    ("nemotron_h", dict(mode="conventional", state_dtype=E4M3, stochastic_rounding=True), 0.4),
    ("nemotron_h", dict(mode="conventional", state_dtype=torch.bfloat16,
                        stochastic_rounding=True), 0.2),
    ("qwen3_next", dict(state_dtype=E4M3), 0.2),
    ("nemotron_h", dict(read_dtype="nvfp4"), 0.4),
    ("qwen3_next", dict(state_dtype="nvfp4"), 0.4),
    ("qwen3_next", dict(read_dtype="nvfp4"), 0.4),
    ("qwen3_next", dict(mode="conventional", state_dtype=E4M3, stochastic_rounding=True), 0.4),
]  # fmt: skip


def scale_names(prefix: str, dtype: torch.dtype) -> set[str]:
    """A copy's scale tensors besides its codes: row scales (e4m3), head and block scales (nvfp4)."""
    if dtype == E4M3:
        return {f"{prefix}_scale"}
    if dtype == torch.float4_e2m1fn_x2:
        return {f"{prefix}_scale", f"{prefix}_block_scale"}
    return set()


@pytest.mark.parametrize(("name", "options", "bound"), FORMAT_CASES)
def test_checkpoint_formats_follow_hf_decode(name, options, bound):
    """Each format's logits stay finite and near HF's FP32 decode (loosely: FP8 keeps 3
    mantissa bits), clearly off the FP32 replay's, which stays within 1e-4; every checkpoint
    tensor of the layout (codes, row scales, read copy) is passed and written."""
    *_, expected = format_reference(name)
    fp32, _, _ = run_format(name)
    fp32_error = logits_error(fp32, expected)
    assert fp32_error < 1e-4
    logits, pools, layouts = run_format(name, **options)
    assert torch.isfinite(logits).all()
    error = logits_error(logits, expected)
    assert 10 * fp32_error < error < bound, (error, fp32_error)
    for pool, layout in zip(pools, layouts):
        names = {"state"} | scale_names("state", layout.state_dtype)
        if layout.read_dtype is not None:
            names |= {"read_state"} | scale_names("read", layout.read_dtype)
        assert set(layout.checkpoint_names) == names
        dtypes = {t.name: t.dtype for t in layout.tensors()}
        for checkpoint in names:
            assert pool[checkpoint].dtype == dtypes[checkpoint]
            assert pool[checkpoint].view(torch.uint8).any(), checkpoint  # decoding wrote it


def test_stochastic_rounding_seeds(monkeypatch):
    """Replay SR keeps the plan's seed (its noise is keyed by the flush epoch); conventional SR
    gets a new seed every step. The same seed gives the same logits, another seed others."""
    seeds = []
    from replayssm_jit.integrations.hf import mixers

    decode = mixers.mamba2_decode

    def recording(plan, **kwargs):
        seeds.append((plan.seed, kwargs.get("seed")))
        return decode(plan, **kwargs)

    monkeypatch.setattr(mixers, "mamba2_decode", recording)
    run_format("nemotron_h", state_dtype=torch.bfloat16, stochastic_rounding=True, seed=9)
    assert set(seeds) == {(9, None)}
    seeds.clear()
    options = dict(mode="conventional", state_dtype=torch.bfloat16, stochastic_rounding=True)
    first, _, _ = run_format("nemotron_h", seed=9, **options)
    steps = NEW_TOKENS - 1
    layers = 2  # NemotronH's two Mamba-2 layers
    assert len(seeds) == steps * layers
    assert all(plan_seed == 9 for plan_seed, _ in seeds)
    per_step = [seed for _, seed in seeds]
    assert len(set(per_step)) == steps  # one seed per step, shared by the layers
    assert per_step[:2] == [(9 << 32) + 1] * 2
    again, _, _ = run_format("nemotron_h", seed=9, **options)
    other, _, _ = run_format("nemotron_h", seed=10, **options)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize(
    ("name", "options", "error", "match"),
    [
        ("qwen3_next", dict(state_dtype="nvfp4", read_dtype="e4m3"), ValueError,
         "^read_dtype: a read copy needs a wider carried state"),
        ("nemotron_h", dict(mode="conventional", read_dtype="e4m3"), ValueError,
         "^mode: expected 'replay' for a layout with a read copy"),
        ("nemotron_h", dict(stochastic_rounding=True), ValueError, "^flags: 'sr'"),
        ("nemotron_h", dict(read_dtype="f32"), ValueError, "^read_dtype: expected a format"),
        ("nemotron_h", dict(state_dtype="bf16", read_dtype="f16"), ValueError,
         "^read_dtype: a read copy"),
        ("nemotron_h", dict(read_dtype="fp8"), TypeError, "^read_dtype: expected one of"),
        ("nemotron_h", dict(state_dtype=torch.int8), TypeError, "^state_dtype: expected"),
        ("nemotron_h", dict(stochastic_rounding=1), TypeError, "^stochastic_rounding: expected"),
        ("nemotron_h", dict(seed="7"), TypeError, "^seed: expected an int"),
        ("nemotron_h", dict(read_dtype="e4m3", window=1), ValueError, "^read_dtype: .*window=1"),
        ("nemotron_h_16", dict(state_dtype=E4M3), ValueError, "^headdim: no row tiling fits"),
        ("qwen3_next_16", dict(state_dtype="e4m3"), ValueError, "^head_v_dim: no row tiling"),
    ],
)  # fmt: skip
def test_unsupported_formats_raise_and_change_nothing(name, options, error, match):
    """The layouts, specs and a CPU plan made at patch time refuse these before any forward is
    replaced (the 16 x 16 heads of the first models fit no e4m3 tile)."""
    if name.endswith("_16"):
        model, _ = hf_reference(name[: -len("_16")])
    else:
        model = format_reference(name)[0]
    with pytest.raises(error, match=match):
        hf.patch(model, **options)
    assert hf.patched_layers(model) == []
    assert not any("forward" in vars(m) for m in model.modules())
