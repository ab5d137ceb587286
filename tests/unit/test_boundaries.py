"""Boundaries of bus/ (issue 14 item 2), checked on the syntax trees of every non-test module:

(a) no module outside ``bus/`` imports nats-py (``import nats...`` / ``from nats... import``, at any depth,
    inside functions too, or by ``importlib.import_module`` / ``__import__``) or calls ``.jetstream(``;
(b) no string literal that names a NATS subject, stream, bucket or object store appears outside
    ``bus/subjects.py`` and ``bus/streams.py`` (docstrings aside; comments are not in the tree).

What counts as such a literal (precise, so that prose, logger names and JSON fields pass):

* a subject: starts with ``as.`` + a lower-case letter or wildcard (``as.int.``, ``as.api.``, ``as.jobs.``),
  with ``_INBOX`` (then ``.``, ``_`` or the end), or with ``$JS`` / ``$KV`` / ``$O`` / ``$SYS`` (then ``.`` or the end);
* a stream / bucket / object store: equal to a name of ``bus.streams.NAMES``, matching ``^AS_[A-Z_]+$``,
  starting with the journal prefix ``SCHED_``, or matching ``^as_[a-z_]+$`` where used as a value
  (not as an attribute name of ``getattr``/``hasattr``/``setattr``/``delattr``, a dict-display key or a
  subscript: those are Python attributes and JSON fields such as ``"as_of"``).

Each checker is itself tested on synthetic sources with and without violations.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from bus import streams

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "bus", "control", "gateway", "bench")
NAME_MODULES = ("bus/subjects.py", "bus/streams.py")  # the only places that spell names

_SUBJECT = re.compile(r"^(as\.[a-z*>]|_INBOX(\.|_|$)|\$(JS|KV|O|SYS)(\.|$))")
_STREAM = re.compile(r"^AS_[A-Z_]+$")
_BUCKET = re.compile(r"^as_[a-z_]+$")
_ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


def modules(root: Path = ROOT) -> list[str]:
    """Paths (relative to ``root``, ``/``-separated) of every non-test ``.py`` file of the packages."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not any(p == "tests" or p.startswith("test_") for p in rel.split("/")):
                out.append(rel)
    return out


def _is_nats(module: str | None) -> bool:
    return module is not None and (module == "nats" or module.startswith("nats."))


def nats_uses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every nats-py import and ``.jetstream(`` call in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _is_nats(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_nats(node.module):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "jetstream":
                found.append((node.lineno, ".jetstream() call"))
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str) and _is_nats(node.args[0].value):
                found.append((node.lineno, f"{name}({node.args[0].value!r})"))
    return sorted(found)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the constant nodes that are docstrings (first statement of a module, class or function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _field_or_attr(node: ast.Constant, parent: ast.AST | None) -> bool:
    """True where a string is a JSON field or Python attribute name, not a value."""
    if isinstance(parent, ast.Dict):
        return any(k is node for k in parent.keys)
    if isinstance(parent, ast.Subscript):
        return parent.slice is node
    if isinstance(parent, ast.Call) and getattr(parent.func, "id", None) in _ATTR_FUNCS:
        return len(parent.args) > 1 and parent.args[1] is node
    return False


def looks_like_name(text: str, as_value: bool = True) -> bool:
    """Whether ``text`` is a NATS subject / stream / bucket / object-store name (module docstring rules)."""
    if _SUBJECT.match(text) or _STREAM.match(text) or text in streams.NAMES:
        return True
    return text.startswith(streams.JOURNAL_PREFIX) or (as_value and bool(_BUCKET.match(text)))


def name_literals(source: str) -> list[tuple[int, str]]:
    """``(line, literal)`` for every string constant of ``source`` that spells a NATS name (f-string parts
    included), docstrings aside."""
    tree = ast.parse(source)
    skip, parents = _docstrings(tree), {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if looks_like_name(node.value, not _field_or_attr(node, parents.get(id(node)))):
                found.append((node.lineno, node.col_offset, node.value))
    return [(line, text) for line, _, text in sorted(found)]


def violations(check, allowed: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """``path:line: what`` for every finding of ``check`` in the modules not in ``allowed``."""
    out = []
    for rel in modules(root):
        if rel in allowed or any(rel.startswith(a) for a in allowed if a.endswith("/")):
            continue
        out += [f"{rel}:{line}: {what}" for line, what in check((root / rel).read_text())]
    return out


# -- the tree --------------------------------------------------------------------------------------

def test_no_nats_outside_bus():
    assert len(modules()) > 50
    found = violations(nats_uses, ("bus/",))
    assert not found, "nats-py belongs behind bus/ (bus.jetstream, bus.kv, bus.nats_bus):\n" + "\n".join(found)


def test_no_subject_stream_or_bucket_literal_outside_the_name_modules():
    found = violations(name_literals, NAME_MODULES)
    assert not found, "build names with bus.subjects / bus.streams:\n" + "\n".join(found)


# -- the checkers themselves -----------------------------------------------------------------------

def test_nats_checker_finds_every_kind_of_use():
    src = '''
import nats
import os, nats.errors
from nats.js.api import StreamConfig
def f(bus):
    from nats import errors
    import importlib
    importlib.import_module("nats.js")
    return bus.client.jetstream(timeout=1)
'''
    assert [line for line, _ in nats_uses(src)] == [2, 3, 4, 6, 8, 9]


def test_nats_checker_passes_lookalikes():
    src = '''
"""uses nats via bus."""
import natsort
from bus import nats_bus
from bus.jetstream import JetStream
from . import nats
def f(bus):
    js = bus.js()
    return jetstream(js), js.jetstream_api, "import nats"
'''
    assert nats_uses(src) == []


def test_name_checker_finds_literal_names():
    src = '''
DONE = "as.int.done.>"
def sub(t):
    """Docstrings may say as.jobs.submit.<t>."""
    return f"as.jobs.submit.{t}"
INBOX = ["_INBOX.acme.>", "_INBOX_worker", "$JS.API.>", "$KV.as_idem.>"]
STREAM, BUCKET = "AS_DONE", "as_quota"
js.bucket(name="as_new_bucket")
JOURNAL = f"SCHED_{m}_{v}"
'''
    assert name_literals(src) == [(2, "as.int.done.>"), (5, "as.jobs.submit."), (6, "_INBOX.acme.>"),
                                  (6, "_INBOX_worker"), (6, "$JS.API.>"), (6, "$KV.as_idem.>"), (7, "AS_DONE"),
                                  (7, "as_quota"), (8, "as_new_bucket"), (9, "SCHED_")]


def test_name_checker_passes_prose_loggers_fields_and_attributes():
    src = '''
"""Module docstring: as.int.done.<name>.<version> and bucket as_quota."""
import logging
log = logging.getLogger("actorserve.gateway")
class C:
    """as_idem, AS_JOBS"""
msg = "as soon as possible; as. a word"
row = {"as_of": 1, "alias.x": 2, "basket": "grass"}
when = rec["as_of"]
f = getattr(obj, "as_dict")
url = "nats://h:4222"
aws = "ASSET_NAME"
'''
    assert name_literals(src) == []


def test_a_violation_in_a_real_module_is_reported(tmp_path):
    pkg = tmp_path / "gateway"
    pkg.mkdir()
    (pkg / "ok.py").write_text('"""as.int.x in prose."""\nX = 1\n')
    (pkg / "bad.py").write_text('def f(js):\n    import nats\n    return js.publish("as.int.done.m.1")\n')
    (pkg / "test_bad.py").write_text('import nats\n')  # tests may use nats
    assert violations(nats_uses, ("bus/",), tmp_path) == ["gateway/bad.py:2: import nats"]
    assert violations(name_literals, NAME_MODULES, tmp_path) == ["gateway/bad.py:3: as.int.done.m.1"]
