"""``actorserve bench structured``: its CLI parses, and a tiny run writes every key of the issue's JSON.

Runs on the tiny random GGUF (tests/engine_fixtures.py) so it takes seconds; the full benchmark uses the
shipped SmolLM2 model (docs/bench.md)."""

from __future__ import annotations

import json

import pytest

from control.ops.cli import build_parser, main
from tests.engine_fixtures import write_tiny_llama_gguf


def test_bench_structured_cli_parses():
    a = build_parser().parse_args(["bench", "structured", "--json", "x.json", "--seqs", "8", "--max-tokens", "16"])
    assert (a.json, a.seqs, a.max_tokens, a.quick, a.model) == ("x.json", 8, 16, False, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "structured", "--seqs", "0"])


def test_bench_structured_quick_writes_the_json(tmp_path):
    out = tmp_path / "structured.json"
    model = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"), context_length=1024)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "structured", "--quick", "--model", model, "--json", str(out)])
    assert exc.value.code == 0
    r = json.loads(out.read_text())
    assert r["unconstrained_tok_s"] > 0 and r["structured_tok_s"] > 0
    assert r["ratio"] == pytest.approx(r["structured_tok_s"] / r["unconstrained_tok_s"])
    assert r["cpu"]["model"] and isinstance(r["cpu"]["flags"], list)
    free, shaped = r["runs"]["unconstrained"], r["runs"]["structured"]
    assert free["tokens"] == 4 * 8 and free["constrained_sequences"] == 0  # EOS ignored: exactly max_tokens
    assert free["num_constrained_steps"] == 0
    assert shaped["constrained_sequences"] == 2 and 0 < shaped["constrained_tokens"] <= 2 * 8
    # every step of run 2 that sampled a constrained row counts: at least the longest constrained sequence
    assert r["num_constrained_steps"] == shaped["num_constrained_steps"] >= shaped["constrained_tokens"] / 2
    assert len(r["repeats"]["structured_tok_s"]) == 2
    assert r["full_batch_step_ratio"] == pytest.approx(free["full_batch_step_ms"] / shaped["full_batch_step_ms"])
    assert r["full_batch_step_ratio"] > 0
