"""Family names key behaviour only in the registry (replayssm_jit/families/): no other module
compares with a family's name, keys a table by it or indexes by it. Names in messages, URIs
and docstrings are fine; read with ast, so strings inside them are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

from replayssm_jit.families import FAMILIES

PACKAGE = Path(__file__).resolve().parents[2] / "replayssm_jit"
NAMES = frozenset(FAMILIES)


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def name_keys(tree: ast.AST) -> list[int]:
    """Lines where a family name is compared with (alone or in a tuple, set or list), used as
    a dict key or a subscript, or matched as a case."""
    lines = []
    for node in ast.walk(tree):
        keyed = False
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            members = [e for c in sides if isinstance(c, (ast.Tuple, ast.Set, ast.List))
                       for e in c.elts]  # fmt: skip
            keyed = any(map(_is_name, sides + members))
        elif isinstance(node, ast.Dict):
            keyed = any(k is not None and _is_name(k) for k in node.keys)
        elif isinstance(node, ast.Subscript):
            keyed = _is_name(node.slice)
        elif isinstance(node, ast.MatchValue):
            keyed = _is_name(node.value)
        if keyed:
            lines.append(node.lineno)
    return lines


def offenders(root: Path = PACKAGE) -> dict[str, list[int]]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "families" in path.relative_to(root).parts:
            continue  # the registry and the families' own modules
        lines = name_keys(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(root))] = lines
    return found


def test_only_the_registry_keys_behaviour_by_family_name():
    assert offenders() == {}


def test_the_check_catches_a_branch_on_a_name():
    """The check fails on each way of keying by name."""
    for source in ('if plan.family.name == "kda": pass', 'x = {"mamba2": 1}',
                   'y = table["gdn"]', 'ok = name in ("gdn", "kda")',
                   'match name:\n    case "mamba2": pass'):  # fmt: skip
        assert name_keys(ast.parse(source)), source
    assert not name_keys(ast.parse('raise ValueError("kda: expected a KDA plan")'))
