"""The package's import graph: subpackages import each other one way only, and the pure
libraries import nothing from the runtime side."""

from __future__ import annotations

import ast
from pathlib import Path

import elastic_ep

ROOT = Path(elastic_ep.__file__).parent
PURE = {"model", "placement", "sim", "doctor", "policy"}
RUNTIME_SIDE = {"runtime", "node", "control", "serve", "wire", "harness", "commands", "cli", "demo_view"}


def part_of(module: str) -> str:
    """The subpackage (or top-level module) of a dotted elastic_ep module name."""
    return module.split(".")[1]


def imports() -> dict[str, set[str]]:
    """subpackage -> the other subpackages its modules import."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts)
        if rel.name == "__init__":
            module = ".".join(rel.parts[:-1])
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        here = part_of(module) if module.count(".") else "__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("elastic_ep.") and part_of(t) != here:
                    graph.setdefault(here, set()).add(part_of(t))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_subpackages_import_each_other_one_way_only():
    graph = imports()
    assert "control" in graph and "runtime" in graph  # the scan found the packages
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_pure_libraries_import_nothing_from_the_runtime_side():
    graph = imports()
    for lib in PURE:
        assert not graph.get(lib, set()) & RUNTIME_SIDE, f"{lib} imports {graph[lib] & RUNTIME_SIDE}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None
