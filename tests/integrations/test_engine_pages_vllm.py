"""The vLLM plugin with its rings, scales and cursors inside vLLM's cache pages
(REPLAYSSM_VLLM_PAGES, on by default), through a fake vLLM (fake_vllm.py) and its runner
(fake_vllm_runner.py): the model class's entries size the padded page at config time, the layer
declares vLLM's conv and SSM state then ours, and the runner carves one view per entry out of
one buffer of random bytes (a block vLLM hands out is not zeroed). Mamba-2, GDN and KDA layers
then prefill, decode and verify (MTP, num_accepted_tokens) through their own core methods,
against float64 references, with a recycled slot; the layer's tensors are the runner's views,
vLLM's code sees its own two entries, and pages no row names keep every byte.

Broken variants that must fail: a runner that carves our entries 16 bytes early (refused as
overlapping), a plugin that allocates its own rings (not the page's), one that leaves a page's
cursor words unreset before the layer's first decode (refused as corrupted on the CPU path; the
kernels' NaN rows), and Kimi-Linear's mixed batch without the fold of the page's records."""

from __future__ import annotations

import logging

import pytest
import torch
from fake_vllm import Mamba2AttentionMetadata as M2Metadata
from fake_vllm_runner import allocate, entry_bytes
from vllm_page_runs import (
    I32,
    SLOTS,
    TOL,
    L,
    Run,
    config,
    gdn_metadata,
    install_vllm_pages,
    rel,
    run_pages,
)

from replayssm_jit.core.cursor_words import CURSOR_HELD
from replayssm_jit.integrations.vllm import hooks, page_hooks, plugin
from replayssm_jit.integrations.vllm.backend import VLLMLayer
from replayssm_jit.jit import env

pytestmark = pytest.mark.usefixtures("no_launch_env")


@pytest.fixture
def vllm(monkeypatch):
    return install_vllm_pages(monkeypatch)


# ---------------------------------------------------------------------------------------------
# What the layer declares, what vLLM sizes and profiles
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_the_page_holds_vllms_entries_then_ours_and_the_profiler_counts_them(vllm, family, T):
    model_cls, cfg, padded = config(vllm, family, T)
    run = Run(vllm, family, T, padded, torch.Generator().manual_seed(0))
    base = type(run.layer)._replayssm_base
    own = (tuple(base.get_state_shape(run.layer)), tuple(base.get_state_dtype(run.layer)))
    shapes, dtypes = tuple(run.layer.get_state_shape()), tuple(run.layer.get_state_dtype())
    pages = run.layer.__dict__["_replayssm_pages"]
    assert (shapes[:2], dtypes[:2]) == own  # vLLM's conv and SSM state, first and unchanged
    assert pages.layout.drafts == T and pages.layout.window == L
    assert sorted(n for n in pages.entries.names if n) == sorted(
        t.name for t in pages.layout.tensors()
    )
    # MambaSpec's bytes: page_entries' page (a multiple of 16), within vLLM's padded page.
    assert entry_bytes(shapes, dtypes) == pages.entries.page_bytes
    assert pages.entries.page_bytes % 16 == 0 and padded >= pages.entries.page_bytes
    # The model class reports the same entries, so the attention page vLLM pads to holds them.
    assert model_cls.get_mamba_state_shape_from_config(cfg) == shapes
    assert tuple(model_cls.get_mamba_state_dtype_from_config(cfg)) == dtypes
    state = entry_bytes(own[0][1:], own[1][1:])
    pads = pages.entries.page_bytes - entry_bytes(*own) - pages.layout.bytes_per_slot() + state
    assert 0 <= pads < 16 * pages.entries.names.count(None)
    assert plugin.register() is True  # twice: nothing wrapped twice
    assert model_cls.get_mamba_state_shape_from_config(cfg) == shapes


# ---------------------------------------------------------------------------------------------
# Prefill, decode and MTP on the runner's views
# ---------------------------------------------------------------------------------------------

ALL_OK = {"outputs": True, "in_pages": True, "untouched": True, "vllm_entries": True}


@pytest.mark.parametrize("form", ["as_strided", "bind_kv_cache"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "mtp"])
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_prefill_decode_and_mtp_run_in_the_pages(vllm, family, T, form):
    assert run_pages(vllm, family, T, form) == ALL_OK


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_runner_that_carves_our_entries_over_vllms_is_refused(vllm, family):
    """Our entries 16 bytes early overlap the SSM state's last bytes: the layer's first decode
    refuses the views (every tensor a step writes needs its own memory)."""
    with pytest.raises(ValueError, match="expected memory disjoint from state"):
        run_pages(vllm, family, 1, shift=16)


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_layer_that_allocates_its_own_rings_fails(vllm, monkeypatch, family):
    """Correct outputs, but outside what vLLM counted and carved."""
    monkeypatch.setattr(page_hooks, "page_pool", lambda state, layout: None)
    checks = run_pages(vllm, family, 1)
    assert {k for k, ok in checks.items() if not ok} == {"in_pages"}


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_page_whose_cursors_are_not_reset_before_the_first_decode_fails(
    vllm, monkeypatch, family
):
    """The prefill's reset skipping a layer that has not decoded yet: its slots' cursor words
    are the page's old bytes (on the CPU path a refused cursor; the kernels' NaN rows)."""
    reset = hooks.reset_held
    monkeypatch.setattr(hooks, "reset_held", lambda owner, slots: (
        reset(owner, slots) if isinstance(owner, VLLMLayer) else None))  # fmt: skip
    with pytest.raises(ValueError, match="corrupted"):
        run_pages(vllm, family, 1)


def test_kimis_mixed_batch_folds_the_pages_records_first(vllm, monkeypatch):
    """Kimi-Linear runs a mixed batch's decode row through the chunk kernel from its page's
    checkpoint: without the fold of the records it holds (flush_held), that start is stale."""
    monkeypatch.setattr(hooks, "flush_held", lambda *args: None)
    assert {k for k, ok in run_pages(vllm, "kda", 1).items() if not ok} == {"outputs"}


# ---------------------------------------------------------------------------------------------
# Cursor words: a garbage one is a fault row, never a read out of range
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_an_invalid_cursor_is_a_nan_row_that_touches_nothing(vllm, family):
    gen = torch.Generator().manual_seed(4)
    _, _, padded = config(vllm, family, 1)
    run = Run(vllm, family, 1, padded, gen)
    pages = allocate([run.layer], SLOTS, padded, fill=gen)
    run.prefill([2, 5], [2, 2])
    assert run.step([2, 5, 0], [1, 1, 1]) < TOL
    layer = plugin.BACKEND.layer(run.state)
    cursors = layer.pool["cursors"]
    cursors[5, CURSOR_HELD] = L
    with pytest.raises(ValueError, match="got n=4 records held"):  # the CPU path's own check
        run.step([2, 5, 0], [1, 1, 1])
    layer.check_slot_values = False  # the kernels' containment: a NaN row
    layer._rows.clear()
    for held in (-1, L, 2**31 - 1):
        cursors[5, CURSOR_HELD] = held
        before = pages.raw.view(SLOTS, pages.page).clone()
        tok = run.tokens(3)
        out = run.call(gdn_metadata([2, 5, 0], [], []) if family != "mamba2" else M2Metadata(
            0, 0, 3, 3, None, None, None, torch.tensor([2, 5, 0], dtype=I32)), tok, 3)  # fmt: skip
        assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
        o, run.ref[2] = run.reference(run.ref[2], tok, 0)
        assert rel(out[0], o.view(out[0].shape)) < TOL
        after = pages.raw.view(SLOTS, pages.page)
        keep = [s for s in range(SLOTS) if s != 2]
        assert torch.equal(before[keep], after[keep])  # slot 5's page too: nothing written


# ---------------------------------------------------------------------------------------------
# The setting, and a page vLLM sized without our entries
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_with_the_setting_off_the_rings_are_allocated_apart(vllm, monkeypatch, family):
    monkeypatch.setenv("REPLAYSSM_VLLM_PAGES", "0")
    model_cls, cfg, padded = config(vllm, family, 1)
    gen = torch.Generator().manual_seed(5)
    run = Run(vllm, family, 1, padded, gen)
    base = type(run.layer)._replayssm_base
    assert tuple(run.layer.get_state_shape()) == tuple(base.get_state_shape(run.layer))
    assert len(model_cls.get_mamba_state_shape_from_config(cfg)) == 2
    pages = allocate([run.layer], SLOTS, padded, fill=gen)
    run.prefill([2, 5], [2, 2])
    assert max(run.step([2, 5, 0], [1, 1, 1]) for _ in range(L + 1)) < TOL
    layer = plugin.BACKEND.layer(run.state)
    assert layer.pool["cursors"].untyped_storage().data_ptr() != pages.raw.data_ptr()


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_page_padded_without_our_entries_keeps_them_apart(vllm, family, caplog):
    """A model class the plugin does not hook: vLLM pads the page from vLLM's entries alone."""
    gen = torch.Generator().manual_seed(6)
    probe = Run(vllm, family, 1, None, gen)
    base = type(probe.layer)._replayssm_base
    own = entry_bytes(base.get_state_shape(probe.layer), base.get_state_dtype(probe.layer))
    with caplog.at_level(logging.WARNING, "replayssm_jit.vllm"):
        run = Run(vllm, family, 1, own, gen)
        assert len(run.layer.get_state_shape()) == 2
    assert "stay apart" in caplog.text
    allocate([run.layer], SLOTS, own, fill=gen)
    run.prefill([2, 5], [2, 2])
    assert max(run.step([2, 5, 0], [1, 1, 1]) for _ in range(L + 1)) < TOL


def test_the_setting_takes_1_or_0(monkeypatch):
    for value, on in (("1", True), ("0", False), ("off", False), ("", None)):
        monkeypatch.setenv("REPLAYSSM_VLLM_PAGES", value)
        if on is None:
            with pytest.raises(ValueError, match="REPLAYSSM_VLLM_PAGES: expected 1 or 0"):
                env.vllm_pages()
        else:
            assert env.vllm_pages() is on
    monkeypatch.delenv("REPLAYSSM_VLLM_PAGES")
    assert env.vllm_pages() is True
