"""vLLM's prefix caching in align mode (mamba_cache_mode "align", no drafts) with the plugin's
rings, scales and cursors in the cache pages (fake_vllm.py, fake_vllm_runner.py).

vLLM keeps a request's running state in the block of its last scheduled token; when that block
changes it copies the state there from the previous one, entry by entry, through the model
class's copy specs (v1/worker/mamba_utils.py preprocess_mamba), and a full block stays behind as
the cached state of its prefix. The plugin adds a whole-block copy spec per entry of its own, so
a slot's records and cursor words move with its checkpoint, and folds the records of a prefill
row that starts from a state (a block from the prefix cache) before vLLM's chunk kernel reads
its checkpoint. Request A prefills and decodes across block ends (holding records at each);
request B then takes A's first two blocks from the prefix cache, prefills its own tail and
decodes beside A, all against float64 references; the cached blocks keep every byte.

Broken variants that must fail: copy specs for vLLM's entries only (the moved block's cursor
words are the page's garbage) and a plugin that skips the fold (B starts from the checkpoint
without its records)."""

from __future__ import annotations

import pytest
import torch
from fake_vllm_runner import allocate, copy_block
from vllm_page_runs import SLOTS, TOL, L, Run, config, install_vllm_pages

from replayssm_jit.core.cursor_words import CURSOR_HELD
from replayssm_jit.integrations.vllm import hooks, page_hooks, plugin

BS = 3  # tokens a block (mamba_block_size); with L = 4 block ends and flushes interleave

pytestmark = pytest.mark.usefixtures("no_launch_env")


@pytest.fixture
def vllm(monkeypatch):
    mods = install_vllm_pages(monkeypatch)
    mods["vllm.config"].get_current_vllm_config().cache_config.mamba_cache_mode = "align"
    return mods


class AlignRequests:
    """vLLM's align-mode bookkeeping (preprocess_mamba, no drafts) for one layer's requests:
    block tables, computed tokens and the running state's block index."""

    def __init__(self, run, pages, copy_funcs):
        self.run, self.pages, self.copy_funcs = run, pages, copy_funcs
        self.blocks, self.computed, self.running = {}, {}, {}

    def schedule(self, req, tokens):
        """The slot of `req`'s running state for `tokens` more, after the copy into it."""
        computed = self.computed[req]
        prev = self.running.get(req, (computed - 1) // BS)
        curr = -(-(computed + tokens) // BS) - 1
        self.running[req] = curr
        if prev not in (-1, curr):
            copy_block(self.pages, [self.run.layer], self.copy_funcs, self.blocks[req], prev, curr)
            self.run.ref[self.blocks[req][curr]] = self.run.ref[self.blocks[req][prev]]
        self.computed[req] = computed + tokens
        return self.blocks[req][curr]


def run_align(mods, family, seed=3):
    """A's prompt and decodes, then B on A's first two blocks beside A; the checks."""
    gen = torch.Generator().manual_seed(seed)
    model_cls, _, padded = config(mods, family, 1)
    run = Run(mods, family, 1, padded, gen)
    pages = allocate([run.layer], SLOTS, padded, fill=gen)
    funcs = model_cls.get_mamba_state_copy_func()
    reqs = AlignRequests(run, pages, funcs)
    reqs.blocks = {"A": [1, 2, 3, 4, 7], "B": [1, 2, 5, 6]}
    reqs.computed = {"A": 0, "B": 2 * BS}  # B's first two blocks: A's, from the prefix cache
    worst = run.prefill([reqs.schedule("A", 1)], [1])
    for _ in range(2 * BS + 1):
        worst = max(worst, run.step([reqs.schedule("A", 1)], [1]))
    cursors = plugin.BACKEND.layer(run.state).pool["cursors"]
    held = cursors[[1, 2], CURSOR_HELD].tolist()  # A's cached blocks hold records
    cached = pages.raw.view(SLOTS, pages.page)[[1, 2]].clone()
    b = reqs.schedule("B", 2)
    worst = max(worst, run.prefill([b], [2], decodes=[reqs.schedule("A", 1)], initial={b}))
    for _ in range(BS + 1):
        slots = [reqs.schedule("A", 1), reqs.schedule("B", 1)]
        worst = max(worst, run.step(slots, [1, 1]))
    return {
        "outputs": worst < TOL,
        "held_records": min(held) > 0,
        "cached_untouched": torch.equal(cached, pages.raw.view(SLOTS, pages.page)[[1, 2]]),
        "copy_specs": len(funcs) == len(run.layer.kv_cache) > 2,
    }


ALL_OK = {"outputs": True, "held_records": True, "cached_untouched": True, "copy_specs": True}


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_align_mode_moves_records_with_the_state_and_serves_the_prefix_cache(vllm, family):
    assert L == 4
    assert run_align(vllm, family) == ALL_OK


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_copy_specs_for_vllms_entries_only_fail(vllm, monkeypatch, family):
    """The moved block's rings and cursor words stay the page's: refused as corrupted (the CPU
    path; the kernels' NaN rows)."""
    monkeypatch.setattr(page_hooks, "_entry_count", lambda cls, family: None)
    with pytest.raises(ValueError, match="corrupted"):
        run_align(vllm, family)


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_plugin_that_skips_the_fold_fails(vllm, monkeypatch, family):
    monkeypatch.setattr(hooks, "flush_held", lambda *args: None)
    assert {k for k, ok in run_align(vllm, family).items() if not ok} == {"outputs"}


def test_align_mode_without_room_in_the_page_is_refused(vllm, monkeypatch):
    """A page vLLM padded without our entries (a model class the plugin does not hook): the
    layer cannot declare them, so align mode's copies would miss them; refused by name."""
    _, _, padded = config(vllm, "gdn", 1)
    run = Run(vllm, "gdn", 1, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="mamba_cache_mode: 'align' needs the rings"):
        run.layer.get_state_shape()
    assert padded is None or padded > 64
