"""Imports run one way through the package's layers, and no module imports itself back.

core -> families -> jit / launch -> ops (and the float64 references) -> wrappers / integrations
-> the top-level package -> cli. Every import counts, function-level ones too (read with ast,
nothing imported): a lazy import hides a circle from Python, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import ROOT

PACKAGE = ROOT / "replayssm_jit"

# Rank of each layer: a module may import its own layer and the layers ranked below it.
LAYERS = {
    "core": 0,
    "families": 1,
    "jit": 2,
    "launch": 2,
    "ops": 3,
    "reference": 3,
    "wrappers": 4,
    "integrations": 4,
    "": 5,  # replayssm_jit/__init__.py and __main__.py: the public surface
    "cli": 6,
}
# Layers of one rank that must not import each other (they are siblings, not a stack).
SIBLINGS = [{"jit", "launch"}, {"ops", "reference"}, {"wrappers", "integrations"}]


def module_name(path: Path) -> str:
    parts = ["replayssm_jit", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def package_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in it (resolved to modules that exist)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1],
                                 *([base] if base else [])])  # fmt: skip
            # `from pkg import sub` depends on pkg.sub; `from pkg import name` on pkg itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]  # fmt: skip
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("replayssm_jit") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): package_imports(p, modules) for p in paths}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in graph.items():
        layer = layer_of(module)
        for target in imported:
            other = layer_of(target)
            if other == "" and target != "replayssm_jit":
                continue  # (a module directly under the package with no layer of its own)
            sibling = any({layer, other} == pair for pair in SIBLINGS)
            if LAYERS[other] > LAYERS[layer] or sibling:
                bad.append(f"{module} ({layer or 'top'}) imports {target} ({other or 'top'})")
    return sorted(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    loose = [m for m in import_graph() if layer_of(m) == "" and m.count(".") > 1]
    assert loose == []
    top = {m for m in import_graph() if layer_of(m) == ""}
    assert top == {"replayssm_jit", "replayssm_jit.__main__"}


def test_imports_follow_the_layers():
    assert layer_violations(import_graph()) == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_nothing_imports_the_cli():
    graph = import_graph()
    assert [m for m, imported in graph.items()
            if layer_of(m) != "cli" and m != "replayssm_jit.__main__"
            and any(layer_of(t) == "cli" for t in imported)] == []  # fmt: skip


def test_the_fast_path_never_imports_the_references():
    graph = import_graph()
    fast = [m for m in graph if layer_of(m) in ("core", "families", "jit", "launch", "ops")]
    assert [m for m in fast if any(layer_of(t) == "reference" for t in graph[m])] == []


@pytest.mark.parametrize("broken", ["circle", "upward", "sibling"])
def test_the_checks_catch_a_broken_graph(broken):
    """Each check fails on a graph broken the way it guards against."""
    graph = {k: set(v) for k, v in import_graph().items()}
    if broken == "circle":
        graph["replayssm_jit.core.checks"].add("replayssm_jit.core.tiles")
        graph["replayssm_jit.core.tiles"].add("replayssm_jit.core.checks")
        assert circles(graph)
    elif broken == "upward":
        graph["replayssm_jit.families.layout"].add("replayssm_jit.ops.plan")
        assert layer_violations(graph)
    else:
        graph["replayssm_jit.jit.build"].add("replayssm_jit.launch.policy")
        assert layer_violations(graph)
