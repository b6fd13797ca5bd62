"""The package's shape: imports between its modules form no cycle (counting imports inside functions), and
the product speaks only of itself (no tracker words a user could not follow)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pipeline

PACKAGE = Path(pipeline.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body, function bodies included."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "templates" not in p.parts}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            graph[name] |= {t for t in targets if t in paths and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycles() -> None:
    graph = _import_graph()
    assert len(graph) > 100  # the walk found the package
    assert _cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


TRACKER_WORDS = re.compile(r"\bissues? ?#?[0-9]+|\bsessions? [0-9]|REFERENCE\.md|\bP[0-9]+\b", re.IGNORECASE)
PERCENTILE = re.compile(r"\bp(50|90|95|99)\b")


def test_the_product_names_no_tracker_words() -> None:
    hits = []
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".md", ".tmpl", ".cpp", ".h", ".txt") or "__pycache__" in path.parts:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if any(not PERCENTILE.fullmatch(m.group(0)) for m in TRACKER_WORDS.finditer(line)):
                hits.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert hits == []
