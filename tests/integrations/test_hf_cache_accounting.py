"""The HF drop-in keeps HF's cache accounting: after a patched decode the returned cache
continues exactly as an unpatched model's (a second generate(), a manual model(...) loop);
beam search is refused; a cast after patch() is followed; the transformers range is checked;
and the documented options behave as documented."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_hf_dropin import (
    F32,
    MODELS,
    NEW_TOKENS,
    VOCAB,
    WINDOW,
    check_bf16,
    forward_schedule,
    logits_error,
    nemotron_h,
    prompts,
)

from replayssm_jit.integrations import hf

pytest.importorskip("transformers")

FIRST, MORE = 24, 16  # tokens of the first generate(), then of the continuation


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny matmuls: one intra-op thread


def _greedy(model, ids, mask, new_tokens, cache=None):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
            pad_token_id=0, past_key_values=cache,
        )  # fmt: skip


def continue_from_cache(model):
    """generate() FIRST tokens, then continue from the returned cache twice over: a second
    generate() of MORE tokens, and (from a second first run) a manual model(...) loop feeding
    the same MORE tokens one at a time. Returns (the cache's length after the first run, the
    second generate's logits [MORE, batch, vocab], the loop's logits, the continued tokens)."""
    ids, mask = prompts()
    first = _greedy(model, ids, mask, FIRST)
    length = int(first.past_key_values.get_seq_length())
    grown = torch.cat([mask, torch.ones(mask.shape[0], FIRST, dtype=mask.dtype)], dim=1)
    second = _greedy(model, first.sequences, grown, MORE, cache=first.past_key_values)
    tokens = second.sequences[:, first.sequences.shape[1] :]
    loop_cache = _greedy(model, ids, mask, FIRST).past_key_values
    # The first run's last token is not in its cache yet: the loop feeds it first.
    feed = torch.cat([first.sequences[:, -1:], tokens[:, :-1]], dim=1)
    logits = []
    with torch.no_grad():
        for step in range(MORE):
            grown = torch.cat([grown, torch.ones_like(grown[:, :1])], dim=1)
            out = model(input_ids=feed[:, step : step + 1], attention_mask=grown,
                        past_key_values=loop_cache, use_cache=True)  # fmt: skip
            logits.append(out.logits[:, -1])
    return length, torch.stack(second.logits).double(), torch.stack(logits).double(), tokens


@pytest.mark.parametrize("name", sorted(MODELS))
def test_continuing_from_the_returned_cache_matches_hf(name):
    """Before the fix (no token count kept by the patched decode) the cache stayed at the
    prompt length: the second generate() re-fed the decoded tokens (|dlogit| ~0.9) and the
    loop's positions stuck (~0.1); both stay within 1e-4 of the unpatched model now."""
    model = MODELS[name]()
    expected = continue_from_cache(model)
    hf.patch(model, window=WINDOW, stagger_flushes=True)
    try:
        got = continue_from_cache(model)
    finally:
        hf.unpatch(model)
    prompt = prompts()[0].shape[1]
    assert expected[0] == got[0] == prompt + FIRST - 1  # the last token is not yet fed
    assert logits_error(got[1], expected[1]) < 1e-4
    assert logits_error(got[2], expected[2]) < 1e-4
    assert torch.equal(got[3], expected[3])


def test_a_decode_that_skips_the_token_count_fails_the_continuation(monkeypatch):
    """The check above can fail: a conv step without HF's bookkeeping (the adapter before the
    fix) moves the continued logits far outside 1e-4."""
    from replayssm_jit.integrations.hf import mixers

    def uncounted(mixer, mixed, cache):
        modeling = mixers._modeling(mixer)
        out = modeling.causal_conv1d_update(
            mixed.transpose(1, 2), cache.get_conv_state(mixer.layer_idx),
            mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation=mixer.activation,
        )  # fmt: skip
        return out[:, :, 0]

    model = MODELS["qwen3_next"]()
    expected = continue_from_cache(model)
    monkeypatch.setattr(mixers, "conv_step", uncounted)
    hf.patch(model, window=WINDOW)
    try:
        got = continue_from_cache(model)
    finally:
        hf.unpatch(model)
    if not hasattr(mixers._modeling(model.model.layers[0].linear_attn), "causal_conv1d_forward"):
        pytest.skip("this transformers keeps no linear-attention token count")
    assert got[0] < expected[0]
    assert logits_error(got[2], expected[2]) > 1e-2


# ---------------------------------------------------------------------------------------------
# Beam search, casts, versions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nemotron_h", "kimi_linear"])
def test_beam_search_is_refused_with_a_reason(name):
    model = MODELS[name]()
    ids, mask = prompts()
    hf.patch(model, window=WINDOW)
    try:
        with pytest.raises(RuntimeError, match=r"beam search.*num_beams=1"), torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        tokens = _greedy(model, ids, mask, 8).sequences  # the patch still decodes greedily
    finally:
        hf.unpatch(model)
    assert torch.equal(tokens, _greedy(model, ids, mask, 8).sequences)


@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_next"])
def test_a_cast_after_patch_is_followed(name):
    """patch() in FP32, then model.to(bfloat16): the layers decode at bf16 activations, as a
    model patched after the cast does (check_bf16's bounds against HF's own bf16 decode)."""
    model = MODELS[name](F32)
    hf.patch(model, window=WINDOW)
    try:
        model.to(torch.bfloat16)
        ids, mask = prompts()
        chunks = [ids, *torch.randint(3, VOCAB, (3, 4)).split(1, dim=1)]
        ours = forward_schedule(model, chunks, mask)
        assert all(layer.layout.act_dtype == torch.bfloat16 for layer in hf.patched_layers(model))
        assert all(layer.decode_steps == 4 for layer in hf.patched_layers(model))
    finally:
        hf.unpatch(model)
    assert logits_error(ours, forward_schedule(model, chunks, mask)) < 2e-2
    check_bf16(name, "cpu")  # and the path patched after the cast still holds


def test_a_cast_the_formats_refuse_raises_naming_the_patch(monkeypatch):
    from replayssm_jit.integrations.hf import layer as layer_module

    model = nemotron_h()
    hf.patch(model, window=WINDOW)
    try:
        model.to(torch.bfloat16)

        def refuse(*args):
            raise ValueError("state_dtype: refused at bfloat16")

        monkeypatch.setattr(layer_module, "layout_of", refuse)
        ids, _ = prompts()
        with pytest.raises(ValueError, match=r"cast to torch.bfloat16 after hf.patch\(\)"):
            forward_schedule(model, [ids, ids[:, :1]], None)
    finally:
        monkeypatch.undo()
        hf.unpatch(model)


def test_transformers_versions_outside_the_tested_range():
    oldest, newest = hf.TESTED_TRANSFORMERS
    with pytest.raises(RuntimeError, match=rf"transformers 5\.20\.1: .*>={oldest}, <={newest}"):
        hf.check_transformers("5.20.1")
    with pytest.raises(RuntimeError, match="transformers 4.57.6"):
        hf.check_transformers("4.57.6")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.check_transformers(oldest)
        hf.check_transformers(newest)
        hf.check_transformers(newest.rsplit(".", 1)[0] + ".9")  # a patch release of the newest
    with pytest.warns(RuntimeWarning, match=r"transformers 9\.1\.0 is newer"):
        hf.check_transformers("9.1.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.check_transformers("9.1.0")  # once per version


def test_the_installed_transformers_is_in_the_tested_range():
    """CI installs the newest release the test extra allows: it must be a tested one."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.check_transformers(transformers.__version__)


# ---------------------------------------------------------------------------------------------
# The documented options
# ---------------------------------------------------------------------------------------------


def test_window_one_flushes_every_step_and_matches_hf():
    from test_hf_dropin import generate, hf_reference

    model, (hf_tokens, hf_logits, _) = hf_reference("qwen3_next")
    handle = hf.patch(model, window=1)
    try:
        tokens, logits, _ = generate(model)
        epochs = [layer.pool["cursors"][:, 1].tolist() for layer in handle.layers]
    finally:
        hf.unpatch(model)
    assert torch.equal(tokens, hf_tokens) and logits_error(logits, hf_logits) < 1e-4
    assert all(row == [NEW_TOKENS - 1] * 3 for row in epochs)  # a flush every decode step


def test_the_nano4b_head_refuses_an_e4m3_read_copy_as_documented():
    """docs/integrations-direct-calls.md: headdim 80 / dstate 128 (Nemotron-3-Nano-4B) fits no
    tile that both an FP32 and an e4m3 copy share; nvfp4 as the read copy is refused too."""
    model = nemotron_h(headdim=80, dstate=128)
    for read_dtype in ("e4m3", "nvfp4"):
        with pytest.raises(ValueError, match="read_dtype|tiling"):
            hf.patch(model, read_dtype=read_dtype)
        assert hf.patched_layers(model) == []
    hf.patch(model, state_dtype="bf16")  # a 16-bit checkpoint fits
    hf.unpatch(model)
