"""``actorserve bench engine --quick`` runs end to end and writes every key of the issue's JSON.

Runs on the tiny random GGUF (tests/engine_fixtures.py) so it takes seconds; the full benchmark
uses the shipped SmolLM2 model."""

from __future__ import annotations

import json

import pytest

from control.ops.cli import main
from tests.engine_fixtures import write_tiny_llama_gguf


def test_bench_engine_quick(tmp_path):
    out = tmp_path / "bench.json"
    model = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"), context_length=1024)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--quick", "--model", model, "--json", str(out)])
    assert exc.value.code == 0
    r = json.loads(out.read_text())
    for key in ("decode_tok_s", "baseline_decode_tok_s", "prefill_tok_s"):
        assert r[key] and all(v > 0 for v in r[key].values()), key
    assert set(r["baseline_runs"]) == {"fp32", "bf16"}
    assert r["matmul_gflops"]["bf16"] > 0 and r["matmul_gflops"]["fp32"] > 0
    for key in ("roofline_fraction_64", "prefill_roofline_fraction_512", "prefix_cache_speedup"):
        assert r[key] > 0, key
    env = r["environment"]
    assert env["threads"] >= 1 and env["torch_version"] and env["cpu_model"] and env["dtype"] in ("float32", "bfloat16")


def test_missing_transformers_is_one_line_before_any_measurement(monkeypatch):
    import importlib.util

    from bench import engine_bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    monkeypatch.setattr(engine_bench, "matmul_gflops", lambda *a: pytest.fail("measured before checking"))
    with pytest.raises(SystemExit, match=r"bench extra.*--no-baseline"):
        engine_bench.run(quick=True, model=engine_bench.default_model_path() or "x.gguf")
