"""JSON Lines records stay one line for readers that split like ``str.splitlines`` (the openai SDK's users).

The chaos suite's batch test (CI of stop 45) read a batch output file with ``.text.splitlines()`` and a sampled
token holding U+2028 cut one record in two; every JSONL writer now goes through :mod:`bus.jsonline`.
"""

from __future__ import annotations

import ast
import pathlib

import orjson
import pytest

from actors import job_batches as batch_lines
from bus import jsonline

SPLITLINES_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ch", list(SPLITLINES_BREAKS), ids=[f"U+{ord(c):04X}" for c in SPLITLINES_BREAKS])
def test_batch_result_line_is_one_line_and_round_trips(ch):
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"a{ch}b"}}]}
    raw = batch_lines.result_line("c-1", "chatcmpl-1", 200, body)
    text = raw.decode()
    assert text.splitlines() == [text[:-1]] and text.endswith("\n")
    assert orjson.loads(raw)["response"]["body"] == body


def test_a_file_of_records_reads_back_record_for_record():
    texts = ["plain", "nel\x85", "ls\u2028", "ps\u2029", "é漢字", "multi\nline"]
    data = b"".join(jsonline.line({"i": i, "t": t}) for i, t in enumerate(texts)).decode()
    assert [orjson.loads(x)["t"] for x in data.splitlines()] == texts


def _raw_jsonl_writes(tree: ast.AST) -> list[int]:
    """Lines of ``orjson.dumps(...) + b"\\n"`` expressions (a JSONL record without the escape)."""
    def is_dumps(node):
        f = node.func if isinstance(node, ast.Call) else None
        return isinstance(f, ast.Attribute) and f.attr == "dumps" and getattr(f.value, "id", "") == "orjson"
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add)
            and is_dumps(n.left) and isinstance(n.right, ast.Constant) and n.right.value == b"\n"]


def test_the_raw_write_finder_finds_one():
    assert _raw_jsonl_writes(ast.parse('x = orjson.dumps({"a": 1,\n  "b": 2}) + b"\\n"')) == [1]


def test_no_jsonl_writer_bypasses_the_escape():
    offenders = []
    for pkg in ("actors", "bus", "control", "gateway"):
        for path in (ROOT / pkg).rglob("*.py"):
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n in _raw_jsonl_writes(ast.parse(path.read_text()))]
    assert not offenders, offenders
