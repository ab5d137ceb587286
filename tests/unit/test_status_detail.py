"""The per-worker detail line of ``actorserve status`` (control/ops/status_detail.py)."""

from control.ops.status_detail import worker_detail


def test_tensor_parallel_ranks_and_adapters_are_shown():
    info = {"dtype": "bfloat16", "quantization": None, "adapters": ["sql", "chat"],
            "ranks": [{"rank": 0, "weights_bytes": 2**20, "kv_bytes": 2 * 2**20},
                      {"rank": 1, "weights_bytes": 2**20, "kv_bytes": 2**20}]}
    line = worker_detail(info)
    assert line.startswith("bfloat16")
    assert "2 tensor-parallel ranks (0: weights 1.0 MiB + KV 2.0 MiB; 1: weights 1.0 MiB + KV 1.0 MiB)" in line
    assert line.endswith("LoRA adapters sql, chat")


def test_one_rank_and_no_adapters_add_nothing():
    line = worker_detail({"dtype": "float32", "quantization": "int4", "adapters": [],
                          "ranks": [{"rank": 0, "weights_bytes": 1, "kv_bytes": 1}]})
    assert line == "float32+int4" and worker_detail("x") == ""
