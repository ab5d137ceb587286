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


def test_host_lines_show_budget_residents_and_evictions():
    from control.ops.status_detail import host_lines

    lines = host_lines([{"host_id": "h1", "pid": 7, "budget_bytes": 64 * 2**20, "free_bytes": 2**20, "loads": 3,
                         "evictions": 2, "asked": ["b@1"],
                         "resident": [{"model": "a@1", "worker_id": "h1-v1", "weights_bytes": 2**20,
                                       "kv_bytes": 2 * 2**20, "shared": False, "quantization": "float32",
                                       "state": "serving"},
                                      {"model": "a@2", "worker_id": "h1-v2", "weights_bytes": 2**20,
                                       "kv_bytes": 2**20, "shared": True, "quantization": "float32",
                                       "state": "draining"}]}])
    assert lines[0] == "h1 (pid 7): budget 64.0 MiB, free 1.0 MiB, 3 load(s), 2 eviction(s), asked for b@1"
    assert lines[1] == "  a@1 as h1-v1: weights 1.0 MiB + KV 2.0 MiB, float32, serving"
    assert lines[2] == "  a@2 as h1-v2: weights 1.0 MiB (shared) + KV 1.0 MiB, float32, draining"


def test_a_sleeping_worker_says_so_first():
    asleep = {"dtype": "bfloat16", "quantization": "int4",
              "sleep": {"state": "sleeping", "freed_bytes": 256 * 2**20, "wake_s": 0.19, "wakes": 2}}
    assert worker_detail(asleep).startswith("ASLEEP (256.0 MiB freed; last wake 0.19 s), bfloat16+int4")
    awake = {"dtype": "bfloat16", "sleep": {"state": "running", "wake_s": 0.2, "wakes": 3}}
    assert worker_detail(awake).startswith("woke 3 times, last in 0.20 s")
    assert worker_detail({"dtype": "bfloat16", "sleep": {"state": "running", "wakes": 0}}) == "bfloat16"


def test_what_the_engine_holds_is_shown_beside_its_path():
    """Issue [23]: the worker record's ``holds`` (engine/kquant.py) follows the engine path."""
    line = worker_detail({"dtype": "bfloat16", "quantization": "int4",
                          "holds": "int4, scale/zero in bfloat16 (Q4_K) x 6; bfloat16 (Q6_K) x 1"})
    assert line == "bfloat16+int4 (holds int4, scale/zero in bfloat16 (Q4_K) x 6; bfloat16 (Q6_K) x 1)"


def test_the_kernel_per_row_count_is_shown_beside_the_path():
    """Issue [24] item 1: the worker record's ``row_kernels`` (engine/row_kernels.py) after what it holds."""
    line = worker_detail({"dtype": "bfloat16", "quantization": "int4", "holds": "int4 exact (Q4_1 blocks) (Q4_1) x 120",
                          "row_kernels": "1 row avx2, 2-4 avx512, 5-8 avx512, 9-32 avx512"})
    assert line == ("bfloat16+int4 (holds int4 exact (Q4_1 blocks) (Q4_1) x 120) "
                    "(kernels by rows: 1 row avx2, 2-4 avx512, 5-8 avx512, 9-32 avx512)")
