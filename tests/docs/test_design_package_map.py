"""docs/design.md's package map names every module of replayssm_jit/ and every template file."""

from __future__ import annotations

import re

from support.paths import ROOT

FILE = re.compile(r"[\w.]+\.(?:py|cuh|jinja)\b")


def _mapped() -> set[str]:
    """Paths the map names: each file token under the folders its line sits in (by indent)."""
    text = (ROOT / "docs/design.md").read_text()
    block = text.split("## Package layout", 1)[1].split("```", 2)[1]
    names, stack = set(), []  # stack: (indent, [folders]) of the enclosing folder lines
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if first.endswith("/"):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            # A line such as "mamba2/ gdn/" opens folders that share what follows.
            folders = [w for w in line.split() if w.endswith("/") and "`" not in w]
            parents = stack[-1][1] if stack else [""]
            stack.append((indent, [p + f for p in parents for f in folders]))
        elif stack and indent <= stack[-1][0]:
            while stack and stack[-1][0] >= indent:
                stack.pop()
        folders = stack[-1][1] if stack else [""]
        names |= {f + name for f in folders for name in FILE.findall(line)}
    return names


def test_every_module_is_in_the_map():
    files = [*ROOT.glob("replayssm_jit/**/*.py"), *ROOT.glob("templates/**/*.*")]
    # A subpackage's __init__.py is the folder's own line.
    wanted = {
        str(p.relative_to(ROOT)) + ("/" if p.is_dir() else "")
        for p in files
        if "__pycache__" not in p.parts
        and not (p.name == "__init__.py" and p.parent.name != "replayssm_jit")
    }
    missing = sorted(wanted - _mapped())
    assert not missing, f"docs/design.md's package map lacks: {missing}"
