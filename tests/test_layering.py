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


# control/, bottom to top: the shared modules on top of control/ (api, config, cluster, ranks, events,
# control_plane, metrics, ...) import no subpackage; a subpackage imports only the shared modules and
# the subpackages before it; the loop (controller.py, chaos.py) ties them together above all of them.
CONTROL_ORDER = ["epochs", "faults", "serving", "membership", "facade"]
CONTROL_LOOP = {"controller", "chaos"}


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def module_imports() -> dict[str, set[str]]:
    """module -> the elastic_ep modules it imports, TYPE_CHECKING imports included (`from a import b`
    counts as importing a, and a.b when that is a module)."""
    paths = {module_of(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        out = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            out |= {t for t in found if t in paths and t != module}
    return graph


def control_part(module: str) -> str | None:
    """The part of control/ a module belongs to: a subpackage, "shared", "loop", or None outside control/."""
    parts = module.split(".")
    if parts[:2] != ["elastic_ep", "control"] or len(parts) < 3:
        return None
    if parts[2] in CONTROL_LOOP:
        return "loop"
    return parts[2] if parts[2] in CONTROL_ORDER else "shared"


def test_no_import_cycle_among_the_modules():
    graph = module_imports()
    assert "elastic_ep.control.controller" in graph
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_control_subpackages_import_only_those_below_them():
    # a new subpackage has its place in the order (and in ARCHITECTURE) before it has modules
    assert {p.name for p in (ROOT / "control").iterdir() if (p / "__init__.py").exists()} == set(CONTROL_ORDER)
    wrong = []
    for module, targets in module_imports().items():
        here = control_part(module)
        if here is None or here == "loop":
            continue
        allowed = {"shared", here} | (set(CONTROL_ORDER[: CONTROL_ORDER.index(here)]) if here in CONTROL_ORDER
                                      else set())
        wrong += [f"{module} -> {t}" for t in targets if control_part(t) not in allowed | {None}]
    assert not wrong, "imports against the order of control/: " + "; ".join(wrong)


def test_no_role_is_handed_the_controller():
    importers = [m for m, ts in module_imports().items() if "elastic_ep.control.controller" in ts
                 and control_part(m) is not None]
    assert importers == []
