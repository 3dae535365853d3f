"""Every committed results JSON names the commit it measured, and that commit is in git history."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from support.paths import ROOT

RESULTS = ROOT / "benchmarks" / "results"
FULL_SHA = re.compile(r"[0-9a-f]{40}")


def _records() -> list[tuple[str, dict]]:
    """(file and line, record) for each JSON file and each line of each JSONL file."""
    out = []
    for path in sorted(RESULTS.rglob("*.json")):
        out.append((str(path.relative_to(ROOT)), json.loads(path.read_text())))
    for path in sorted(RESULTS.rglob("*.jsonl")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            out.append((f"{path.relative_to(ROOT)}:{i}", json.loads(line)))
    return out


RECORDS = _records()


def test_results_exist():
    assert RECORDS, f"no results JSON under {RESULTS}"


@pytest.mark.parametrize("name,record", RECORDS, ids=[n for n, _ in RECORDS])
def test_names_commit_measured(name, record):
    commit = record.get("commit_measured")
    # "undetermined" is allowed only with the reason beside it, so no guess passes silently.
    if commit == "undetermined":
        assert record.get("commit_measured_note"), f"{name}: undetermined without a note"
        return
    assert isinstance(commit, str) and FULL_SHA.fullmatch(commit), f"{name}: {commit!r}"


def _in_head_history(commit: str) -> bool:
    # Ancestry of HEAD, not mere presence: CI clones main alone, so a commit kept only on a side branch is absent there.
    return (
        subprocess.run(
            ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", commit, "HEAD"],
            capture_output=True,
        ).returncode
        == 0
    )


def test_commits_measured_are_in_history():
    # A source tarball or a shallow clone has no history to check against.
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("git or the repository's history is absent")
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                      capture_output=True, text=True).stdout.strip() == "true":  # fmt: skip
        pytest.skip("shallow clone: older commits are absent")
    commits = {r["commit_measured"] for _, r in RECORDS} - {"undetermined", None}
    missing = sorted(c for c in commits if not _in_head_history(c))
    assert not missing, f"commits named in benchmarks/results but not in HEAD's history: {missing}"
