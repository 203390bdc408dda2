"""Who imports whom: the controller and the node meet only in the contract, and no
modules import each other in a circle.

Read from the source (every import statement, at any depth: in functions too),
so an import that runs late still counts.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contract", "service", "worker")
# What the contract must not pull in: the controller's web and database stacks, torch.
HEAVY = ("torch", "fastapi", "sqlalchemy")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


MODULES = find_modules()


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Each module that ``module`` imports, as written (``from a import b``: ``a.b`` when
    that is a module, else ``a``), relative imports resolved."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                yield candidate if candidate in MODULES else source


def top(name: str) -> str:
    return name.split(".", 1)[0]


def imports_of(module: str) -> set[str]:
    return set(imported_names(module, MODULES[module]))


def test_the_modules_are_found() -> None:
    assert {"contract.protocol", "service.api.app", "worker.agent"} <= set(MODULES)


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("service", {"worker"}),
        ("worker", {"service"}),
        ("contract", {"service", "worker", *HEAVY}),
    ],
)
def test_the_controller_and_the_node_meet_only_in_the_contract(
    importer: str, forbidden: set[str]
) -> None:
    found = sorted(
        f"{module} imports {name}"
        for module in MODULES
        if top(module) == importer
        for name in imports_of(module)
        if top(name) in forbidden
    )
    assert found == [], "\n".join(found)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``PACKAGES`` it imports."""
    return {module: {n for n in imports_of(module) if n in MODULES} for module in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module that
    imports itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"], ["d"]]


def test_no_modules_import_each_other_in_a_circle() -> None:
    found = circles(import_graph())
    assert found == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)
