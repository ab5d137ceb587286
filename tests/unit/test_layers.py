"""The floors of the code (issue 19 item 2) and no import cycle (issue 14 item 5), checked with ``ast``.

Walks every ``.py`` module under the project's top-level packages (nothing is imported): imports inside
functions count, relative imports are resolved against the importing package, ``from pkg import name``
points at the submodule ``pkg.name`` when there is one (else at ``pkg``), and importing ``a.b.c`` also
runs the packages ``a`` and ``a.b`` (their ``__init__``), so those count too (except the importer's own
enclosing packages, which Python has initialised before it). ``TYPE_CHECKING``-only imports count as well:
a cycle or an upward import is fixed by moving the shared piece down a floor, not by hiding an import.

Two checks on that graph:

* modules: no cycle (it fails with the modules in import order);
* units (the sub-packages ranked in ``FLOORS``, below): every import points to the same floor or
  below, and the units' graph has no cycle (two units of one floor may import each other's way only one
  way). The exceptions are listed in ``ALLOWED``, each with its reason.

See docs/architecture.md ("Floors") and docs/decisions/0039-floors.md.
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


def project_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """The import graph of the project's non-test modules."""
    files = module_files(root, packages)
    return import_graph({m: (p.read_text(), p.name == "__init__.py") for m, p in files.items()})


# -- the floors --------------------------------------------------------------------------------
#
# Bottom to top. A unit is a sub-package (its modules and sub-packages); "actors" stands for the
# modules directly in actors/ (runtime.py, serve.py, metrics.py, aio.py, ...: what every actor process
# shares), together with actors.text. A module belongs to the longest unit name that prefixes it.
# The bare namespace packages (``control``, the empty ``actors/__init__.py``) import nothing.

FLOOR_NAMES = ("pure", "bus", "state", "runtime", "actors", "operations", "entry points")
FLOORS: dict[str, int] = {
    "control.policy": 0,  # pure values and checks: no I/O, imports no other project package
    "bus": 1,  # subjects, wire messages, the Bus and its NATS / in-memory implementations
    "control.state": 2,  # etcd records and names: registry, tenants, routing, pools, elections, leases
    "actors": 3,  # runtime: the actor process (runtime, serve, metrics, aio, load reports, ...)
    "actors.text": 3,  # runtime: tokenizers, chat templates, tool-call formats
    "actors.autoscaler": 4,
    "actors.jobs": 4,
    "actors.rollout": 4,
    "actors.scheduler": 4,
    "actors.validator": 4,
    "actors.worker": 4,
    "gateway": 4,
    "control.ops": 5,  # the CLI, the supervisor, embedded servers, deployment helpers
    "control.sim": 5,  # the fleet simulator (runs the autoscaler's policies)
    # the `actorserve` command (it loads every verb, `bench ...` and `profile` included) and the benchmarks
    # (they start stacks with the supervisor): modules of control.ops ranked on their own, above the rest
    "control.ops.cli": 6,
    "control.ops.profile_cli": 6,  # `actorserve profile` measures with bench.engine_bench's drivers
    "control.ops.bench_cli": 6,  # `actorserve bench ...`: the verbs are the benchmarks of bench/
    "bench": 6,
}

# (importer module, imported module) -> why it stays for now. Each is debt: to move in [19].
ALLOWED: dict[tuple[str, str], str] = {
}


def unit_of(module: str, floors: Mapping[str, int] = FLOORS) -> str | None:
    """The unit of ``floors`` that ``module`` belongs to (longest prefix), or None (a bare namespace)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in floors:
            return ".".join(parts[:i])
    return None


def floor_violations(graph: Mapping[str, Iterable[str]], floors: Mapping[str, int] = FLOORS,
                     allowed: Mapping[tuple[str, str], str] = ALLOWED) -> list[str]:
    """Every import of ``graph`` that points up a floor, then one cycle among the units if any, as
    lines of text; the pairs in ``allowed`` are left out (of both checks)."""
    out, units = [], {}
    for mod, targets in sorted(graph.items()):
        u = unit_of(mod, floors)
        for t in sorted(targets):
            v = unit_of(t, floors)
            if u is None or v is None or u == v or (mod, t) in allowed:
                continue
            units.setdefault(u, set()).add(v)
            if floors[v] > floors[u]:
                out.append(f"up: {mod} ({u}, floor {floors[u]}) imports {t} ({v}, floor {floors[v]})")
    cycle = find_cycle(units)
    if cycle:
        out.append("cycle of units: " + " -> ".join(cycle))
    return out


def test_no_import_cycle():
    graph = project_graph()
    assert len(graph) > 50 and "control.ops.supervisor" in graph  # the walk found the tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_floors():
    graph = project_graph()
    found = floor_violations(graph)
    assert not found, "imports against the floors (move the shared piece down):\n" + "\n".join(found)


def test_every_sub_package_is_ranked_and_every_allowance_is_used():
    subs = {f"{top}.{d.name}" for top in ("actors", "control") for d in (ROOT / top).iterdir()
            if (d / "__init__.py").exists()}
    subs |= {"bus", "gateway", "bench"}
    assert subs <= set(FLOORS), f"rank the new sub-packages in FLOORS: {sorted(subs - set(FLOORS))}"
    graph = project_graph()
    stale = [pair for pair in ALLOWED if pair[1] not in graph.get(pair[0], ())]
    assert not stale, f"ALLOWED names imports that are gone, drop them: {stale}"


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


def _plant(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_floor_check_fails_on_a_planted_upward_import_and_on_a_function_level_one(tmp_path):
    floors = {"low": 0, "mid": 1, "high": 2}
    _plant(tmp_path, {
        "low/__init__.py": "", "low/pure.py": "import math\n",
        "mid/__init__.py": "", "mid/state.py": "from low.pure import x\n",
        "high/__init__.py": "", "high/cli.py": "from mid import state\nimport low.pure\n",
    })
    graph = project_graph(tmp_path, floors)
    assert graph["high.cli"] == {"mid", "mid.state", "low", "low.pure"}
    assert floor_violations(graph, floors, {}) == []
    # an upward import at the top of a module
    _plant(tmp_path, {"low/pure.py": "import math\nfrom high.cli import main\n"})
    found = floor_violations(project_graph(tmp_path, floors), floors, {})
    assert "up: low.pure (low, floor 0) imports high.cli (high, floor 2)" in found
    assert any(f.startswith("cycle of units:") for f in found)
    # the same import hidden in a function (relative, from a sub-package) still counts
    _plant(tmp_path, {"low/pure.py": "import math\n", "mid/sub/__init__.py": "",
                      "mid/sub/deep.py": "def f():\n    from ...high import cli\n    return cli\n"})
    found = floor_violations(project_graph(tmp_path, floors), floors, {})
    assert found == ["up: mid.sub.deep (mid, floor 1) imports high (high, floor 2)",
                     "up: mid.sub.deep (mid, floor 1) imports high.cli (high, floor 2)",
                     "cycle of units: high -> mid -> high"]
    # an allowance lifts it
    allowed = {("mid.sub.deep", "high"): "test", ("mid.sub.deep", "high.cli"): "test"}
    assert floor_violations(project_graph(tmp_path, floors), floors, allowed) == []


def test_floor_check_fails_on_a_cycle_between_units_of_one_floor(tmp_path):
    floors = {"a": 0, "b": 0}
    _plant(tmp_path, {"a/__init__.py": "", "a/x.py": "import b.y\n",
                      "b/__init__.py": "", "b/y.py": "def f():\n    import a.z\n", "a/z.py": ""})
    graph = project_graph(tmp_path, floors)
    assert find_cycle(graph) is None  # no module cycle: a.x -> b.y -> a.z
    assert floor_violations(graph, floors, {}) == ["cycle of units: a -> b -> a"]


def mixin_classes(root: Path, packages: Iterable[str] = PACKAGES) -> list[str]:
    """``"path:line Name"`` of every class whose name ends in ``Mixin`` under ``packages`` of ``root`` (issue [19]:
    classes are built from parts with named interfaces, never mixins that reach into a host's privates)."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return found


def test_no_mixin_classes():
    assert mixin_classes(ROOT) == []


def test_the_mixin_check_finds_a_planted_mixin(tmp_path):
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "host.py").write_text("class _HelperMixin:\n    pass\n\nclass Host(_HelperMixin):\n    pass\n")
    assert mixin_classes(tmp_path, ("actors",)) == ["actors/host.py:1 _HelperMixin"]
