"""README.md's performance table is what scripts/readme_table.py writes from the results JSON."""

from __future__ import annotations

import importlib.util
import re
import sys

from support.paths import ROOT


def _script():
    # scripts/ is not a package; load the file itself so the test runs what CI would run.
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts/readme_table.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the file executes.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


readme_table = _script()


def test_readme_table_is_generated():
    _, block, _ = readme_table.split_readme((ROOT / "README.md").read_text())
    assert block == readme_table.table(), (
        "README.md's performance table is stale or edited by hand: run "
        "`python scripts/readme_table.py` (`--check` shows the difference)"
    )


def test_check_mode_catches_a_hand_edit(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    _, block, _ = readme_table.split_readme(text)
    figure = re.search(r"\| (\d+\.\d) \|", block).group(1)
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(f"| {figure} |", f"| {float(figure) + 0.1:.1f} |", 1))
    monkeypatch.setattr(readme_table, "README", edited)
    assert readme_table.main(["--check"]) == 1


def test_rows_link_existing_results():
    links = re.findall(r"\]\((benchmarks/results/[^)]+)\)", readme_table.table())
    assert links and all((ROOT / link).is_dir() for link in links), links
