"""docs/integrations-vllm-pages.md's bytes per vLLM cache page are what
scripts/vllm_page_table.py computes with the package (the plugin's page_hooks.pages_for)."""

from __future__ import annotations

import importlib.util
import sys

from support.paths import ROOT


def _script():
    spec = importlib.util.spec_from_file_location(
        "vllm_page_table", ROOT / "scripts/vllm_page_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


page_table = _script()


def test_the_page_table_is_generated():
    _, block, _ = page_table.split_doc((ROOT / "docs/integrations-vllm-pages.md").read_text())
    assert block == page_table.table(), (
        "docs/integrations-vllm-pages.md's page table is stale or edited by hand: run "
        "`python scripts/vllm_page_table.py` (`--check` shows the difference)"
    )


def test_check_mode_catches_a_hand_edit(tmp_path, monkeypatch):
    text = (ROOT / "docs/integrations-vllm-pages.md").read_text()
    _, block, _ = page_table.split_doc(text)
    edited = tmp_path / "integrations-vllm-pages.md"
    edited.write_text(text.replace(block, block.replace("4,293,008", "4,293,009", 1)))
    monkeypatch.setattr(page_table, "DOC", edited)
    assert page_table.main(["--check"]) == 1
