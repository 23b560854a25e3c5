"""The project's layout: no import cycle among the modules of `vaswani_hf` and `vaswani_training` (every import the
`ast` of a module holds counts, those inside functions and under `TYPE_CHECKING` too), and the commands apart from
the run's machinery: each console entry point is a module of `vaswani_training` itself, and `vaswani_training.lib`
imports none of them."""

from __future__ import annotations

import ast
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"vaswani_hf": ROOT / "vaswani_hf", "vaswani_training": ROOT / "training"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a package's `__init__` counts as the package)."""
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_of_three_and_not_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_of_the_project_imports_itself_back():
    modules = _modules()
    graph = import_graph(modules)
    assert len(modules) > 60 and "vaswani_training.lib.run" in graph
    assert "vaswani_training.lib.checkpoints" in graph["vaswani_training.lib.run"]  # the graph sees relative imports
    assert cycles(graph) == []


def test_the_commands_are_the_modules_of_vaswani_training_and_lib_imports_none_of_them():
    modules = _modules()
    graph = import_graph(modules)
    commands = {name for name, path in modules.items()
                if name.startswith("vaswani_training.") and path.parent == PACKAGES["vaswani_training"]}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry_modules = {target.split(":")[0] for target in scripts.values()}
    assert entry_modules <= commands and len(entry_modules) >= 10
    for name, targets in graph.items():
        if name.startswith("vaswani_training.lib"):
            assert not targets & commands, (name, sorted(targets & commands))
        if name.startswith("vaswani_hf"):
            assert not any(target.startswith("vaswani_training") for target in targets), name
