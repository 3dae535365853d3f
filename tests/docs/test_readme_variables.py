"""The README's variable table names every REPLAYSSM_* variable the package reads."""

from __future__ import annotations

import re

from support.paths import ROOT


def variables_read() -> set[str]:
    names = set()
    for path in (ROOT / "replayssm_jit").rglob("*.py"):
        names |= set(re.findall(r"REPLAYSSM_[A-Z_]+[A-Z]", path.read_text()))
    return names


def variables_documented(readme: str) -> set[str]:
    return set(re.findall(r"^\| `(REPLAYSSM_[A-Z_]+)` \|", readme, re.M))


def test_every_variable_read_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    assert variables_read() - variables_documented(readme) == set()
    assert variables_documented(readme) - variables_read() == set()


def test_the_check_sees_a_missing_row():
    readme = (ROOT / "README.md").read_text()
    cut = re.sub(r"^\| `REPLAYSSM_TUNING` \|.*\n", "", readme, flags=re.M)
    assert variables_read() - variables_documented(cut) == {"REPLAYSSM_TUNING"}
