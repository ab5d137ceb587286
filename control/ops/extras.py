"""Optional extras of the ``actorserve`` package: which verb needs which, and the one line a user sees without one.

``make run`` installs the package without extras; ``actorserve simulate`` / ``plan`` need ``sim`` (scipy's HiGHS
MILP, matplotlib's plots) and ``actorserve bench ...`` needs ``bench`` (the transformers baseline, httpx). A verb
declares the extras it needs with ``set_defaults(extras=(...))``; control/ops/cli.py ``main`` calls
:func:`missing_extra` before running it, and :func:`extra_of_module` names the extra behind a
``ModuleNotFoundError`` that escapes a verb anyway. Either way the user gets one line naming the extra and the
command that installs it, and exit status 2 (usage), never a traceback (issue [18] item 2).

The extras and their requirements are read from the installed package's metadata (``Requires-Dist: scipy ;
extra == "sim"``), i.e. from pyproject.toml, so this module keeps no second list of them.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path

__all__ = ["extra_requirements", "missing_extra", "extra_of_module", "install_command", "missing_extra_line"]

PACKAGE = "actorserve"
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


@lru_cache(maxsize=1)
def extra_requirements() -> dict[str, tuple[str, ...]]:
    """Extra name -> the distribution names it requires (``{"sim": ("scipy", "matplotlib"), ...}``), from the
    installed ``actorserve`` metadata; empty when the package is not installed (running from a bare checkout)."""
    import importlib.metadata as md  # ~24 ms (email, zipfile): read only when a verb declares an extra

    try:
        reqs = md.requires(PACKAGE) or []
    except md.PackageNotFoundError:
        return {}
    out: dict[str, list[str]] = {}
    for req in reqs:
        marker = _EXTRA_MARKER.search(req)
        if marker:
            name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0]
            out.setdefault(marker.group(1), []).append(name)
    return {k: tuple(v) for k, v in out.items()}


@lru_cache(maxsize=1)
def _modules_of_distributions() -> dict[str, tuple[str, ...]]:
    """Distribution name (lower case) -> its top-level import names, for the installed distributions."""
    import importlib.metadata as md  # as in extra_requirements: kept out of every `actorserve` start

    out: dict[str, list[str]] = {}
    for module, dists in md.packages_distributions().items():
        for d in dists:
            out.setdefault(d.lower(), []).append(module)
    return {k: tuple(v) for k, v in out.items()}


def _import_names(dist: str) -> tuple[str, ...]:
    """Top-level modules of ``dist`` when installed; else its name with '-' as '_' (scipy -> scipy)."""
    return _modules_of_distributions().get(dist.lower()) or (dist.replace("-", "_").lower(),)


def missing_extra(extras: tuple[str, ...]) -> tuple[str, str] | None:
    """``(extra, distribution)`` of the first requirement of ``extras`` that cannot be imported, or None.
    An extra the metadata does not know is ignored (a bare checkout has no metadata)."""
    for extra in extras:
        for dist in extra_requirements().get(extra, ()):
            if any(importlib.util.find_spec(m) is None for m in _import_names(dist)):
                return extra, dist
    return None


def extra_of_module(module: str | None) -> str | None:
    """The extra whose requirement provides the top-level module ``module`` (``scipy.special`` -> ``sim``),
    or None when no extra does (then the error is not a missing extra and must surface as it is)."""
    if not module:
        return None
    top = module.split(".")[0]
    for extra, dists in extra_requirements().items():
        if extra == "test":
            continue  # the test extra repeats the others; name the one a verb needs
        if any(top == dist.replace("-", "_").lower() or top in _import_names(dist) for dist in dists):
            return extra
    return None


def install_command(extra: str) -> str:
    """The command that installs ``extra`` into this interpreter's environment: the checkout's editable
    install when the package runs from one (``make run`` installs it so), else by package name."""
    root = Path(__file__).resolve().parents[2]
    target = f"{root}[{extra}]" if (root / "pyproject.toml").exists() else f"{PACKAGE}[{extra}]"
    editable = "-e " if (root / "pyproject.toml").exists() else ""
    return f"{sys.executable} -m pip install {editable}'{target}'"


def missing_extra_line(verb: str, extra: str, what: str) -> str:
    """The one line printed for a verb whose extra is not installed (``what``: the missing distribution)."""
    return (f"actorserve {verb}: needs the '{extra}' extra ({what} is not installed); install it with: "
            f"{install_command(extra)}")
