"""Read the project's imports with ast: circles among modules and imports made inside functions.

    python scripts/import_graph.py [--list]

Counts every import of a project module (ckptconv, service, worker), at module level or inside a
function; imports under ``if TYPE_CHECKING:`` are for annotations only and never run. A circle is
a strongly connected component of more than one module; a package's ``__init__`` counts as a
module, so a submodule importing its own package's re-exports closes one. ``--list`` prints each
function-level project import with its place.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("ckptconv", "service", "worker")


def module_files(root: Path) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def graph(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    mods = module_files(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    deferred: list[tuple[str, int, str]] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        in_function: set[int] = set()
        type_only: set[int] = set()
        for block in ast.walk(tree):
            if isinstance(block, ast.FunctionDef | ast.AsyncFunctionDef):
                in_function.update(id(n) for n in ast.walk(block) if isinstance(n, ast.Import | ast.ImportFrom))
            elif isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
                type_only.update(
                    id(n) for s in block.body for n in ast.walk(s) if isinstance(n, ast.Import | ast.ImportFrom)
                )
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in type_only:
                continue
            names = [n for n in imported_names(node, package) if n.split(".")[0] in PACKAGES]
            targets = {resolve(n) for n in names} - {None, mod}
            edges[mod] |= targets  # type: ignore[arg-type]
            if names and id(node) in in_function:
                deferred.append((str(path.relative_to(root)), node.lineno, names[0]))
    return edges, deferred


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively; only those of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    edges, deferred = graph(root)
    found = circles(edges)
    print(f"modules {len(module_files(root))}, function-level project imports {len(deferred)}, circles {len(found)}")
    for component in found:
        print(f"  circle of {len(component)}: {' '.join(component)}")
    if "--list" in sys.argv:
        for path, line, name in deferred:
            print(f"  {path}:{line} {name}")


if __name__ == "__main__":
    main()
