"""No import cycle among the project's non-test modules (issue 14 item 5).

Walks every ``.py`` module under the project's top-level packages with ``ast`` (nothing is imported):
imports inside functions count, relative imports are resolved against the importing package,
``from pkg import name`` points at the submodule ``pkg.name`` when there is one (else at ``pkg``), and
importing ``a.b.c`` also runs the packages ``a`` and ``a.b`` (their ``__init__``), so those count too
(except the importer's own enclosing packages, which Python has initialised before it). A cycle fails
the test with its modules in import order. ``TYPE_CHECKING``-only imports count as well: a cycle is
fixed by moving the shared piece down a layer, not by hiding an import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "bus", "control", "gateway", "bench")


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file of every non-test ``.py`` module under ``packages`` (a package is
    named by its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if any(p == "tests" or p.startswith("test_") for p in rel.parts):
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """Absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imported_names(module: str, source: str, is_package: bool = False) -> list[str]:
    """Every dotted name ``source`` (the text of ``module``) imports, anywhere in the file; for
    ``from X import a, b`` both ``X.a`` and ``X.b`` (the caller keeps those that are modules, else X)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                    else node.module or "")
            names += [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
    return names


def _with_parents(name: str, known: Mapping[str, object], importer: str) -> set[str]:
    """``name`` (or its longest known prefix) and the packages above it, minus the importer's own."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - own


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> project modules it imports, from ``{module: (source, is_package)}``; imports of
    modules outside ``sources`` (the standard library, third parties) are dropped."""
    graph: dict[str, set[str]] = {}
    for mod, (source, is_package) in sources.items():
        edges: set[str] = set()
        for name in imported_names(mod, source, is_package):
            edges |= _with_parents(name, sources, mod)
        graph[mod] = edges - {mod}
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[m0, m1, ..., m0]`` (each imports the next), or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt) and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def project_graph() -> dict[str, set[str]]:
    """The import graph of the project's non-test modules."""
    files = module_files()
    return import_graph({m: (p.read_text(), p.name == "__init__.py") for m, p in files.items()})


def test_no_import_cycle():
    graph = project_graph()
    assert len(graph) > 50 and "control.ops.supervisor" in graph  # the walk found the tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# -- the checker itself ------------------------------------------------------------------------


def test_checker_reports_a_cycle_through_a_function_level_relative_import():
    sources = {
        "pkg": ("", True),
        "pkg.a": ("import os\nfrom pkg import b\n", False),
        "pkg.b": ("def f():\n    from . import c\n", False),
        "pkg.c": ("def g():\n    from .a import thing\n", False),
    }
    graph = import_graph(sources)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


def test_checker_counts_package_inits_and_resolves_parents():
    sources = {
        "p": ("", True),
        "p.q": ("from p.q.r import x\n", True),  # the package p.q imports its submodule
        "p.q.r": ("", False),
        "p.s": ("from ..p import q\nimport p.q.r\n", False),
        "t": ("import p.s\n", False),
        "t2": ("from .. import t\n", False),  # relative beyond the top: an unknown name, dropped
    }
    graph = import_graph(sources)
    assert graph["p.s"] == {"p.q", "p.q.r"} and graph["t"] == {"p", "p.s"}
    assert find_cycle(graph) is None
    sources["p.q.r"] = ("import t\n", False)  # p.q.r -> t -> p.s -> p.q -> p.q.r
    cycle = find_cycle(import_graph(sources))
    assert cycle is not None and cycle[0] == cycle[-1] and {"t", "p.s", "p.q.r"} <= set(cycle)


def test_checker_finds_a_cycle_added_to_the_real_tree():
    graph = project_graph()
    graph["bus.subjects"] = set(graph["bus.subjects"]) | {"control.ops.supervisor"}
    cycle = find_cycle(graph)
    assert cycle is not None and "bus.subjects" in cycle and "control.ops.supervisor" in cycle
