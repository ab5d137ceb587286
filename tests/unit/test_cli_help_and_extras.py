"""Every ``actorserve`` verb answers ``--help``; a verb whose optional extra is missing says so in one line (issue [18]).

The parser tree is walked (argparse's sub-parser actions) and each verb and sub-verb is run with ``--help``
through ``control.ops.cli.main``, as a user would type it: exit 0 and a usage line, never a traceback (an
unescaped ``%`` in a help string made ``actorserve bench --help`` die in argparse's formatter). The extras test
runs the CLI in a fresh interpreter where the extras' modules cannot be imported (``sys.modules[name] = None``,
which makes ``import`` raise ModuleNotFoundError and ``importlib.util.find_spec`` answer None, as on an install
without the extra).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from control.ops.cli import build_parser, main
from control.ops.extras import extra_of_module, extra_requirements, missing_extra

ROOT = Path(__file__).resolve().parents[2]


def _verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every verb path of the parser tree (``("models", "register")``, ...), the root as ``()``."""
    out = [path]
    for action in parser._actions:  # argparse exposes sub-parsers only through its actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _verbs(sub, path + (name,))
    return out


def _run_help(path: tuple[str, ...]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as ei:
        main([*path, "--help"])
    return ei.value.code, out.getvalue()


def test_every_verb_and_subverb_answers_help():
    verbs = _verbs(build_parser())
    assert ("bench", "sim-check") in verbs and ("models", "register") in verbs and len(verbs) > 40
    for path in verbs:
        code, text = _run_help(path)
        assert code == 0, path
        assert text.startswith("usage: actorserve" + "".join(" " + p for p in path)), (path, text[:200])


def _cli_without(modules: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)
    code = f"import sys; {block}; from control.ops.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, extra", [
    (("simulate", "--days", "0.01"), "sim"),
    (("plan", "--rate", "5", "--prompt-tokens", "100", "--output-tokens", "50"), "sim"),
    (("bench", "engine", "--no-baseline"), "bench"),
    (("bench", "fairness"), "bench"),
])
def test_a_verb_without_its_extra_prints_one_line_and_exits_2(args, extra):
    if not extra_requirements():
        pytest.skip("actorserve is not installed (no package metadata to read the extras from)")
    proc = _cli_without(("scipy", "matplotlib", "transformers", "httpx"), *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"'{extra}' extra" in lines[0] and f"[{extra}]'" in lines[0] and "pip install" in lines[0]
    assert proc.stdout == ""


def test_a_module_error_outside_any_extra_is_not_called_a_missing_extra():
    if not extra_requirements():
        pytest.skip("actorserve is not installed (no package metadata to read the extras from)")
    assert extra_of_module("scipy.special") == "sim" and extra_of_module("transformers") == "bench"
    assert extra_of_module("numpy") is None and extra_of_module("no_such_module") is None
    assert extra_of_module(None) is None
    assert missing_extra(("sim", "bench")) is None  # this test environment has both
    assert missing_extra(("no-such-extra",)) is None
