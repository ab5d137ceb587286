"""The worker's default engine path: ISA ranking (kernel_policy.py), GGUF header shapes, start-up
measurement and its cache (kernel_choice.py), the worker CLI defaults and bench engine's roofline peak."""

from __future__ import annotations

import argparse
import os
import time

import pytest

from actors.worker.engine import kernel_choice as kc
from actors.worker.engine import kernel_policy as pol
from actors.worker.engine.kernel_policy import Candidate
from tests.engine_fixtures import write_tiny_llama_gguf

EPYC = {"avx2", "avx512_vnni", "avx_vnni", "avx512_bf16"}  # this project's 2-core AMD EPYC (no AMX)
SPR = EPYC | {"amx_bf16"}


@pytest.fixture
def tiny(tmp_path) -> str:
    return write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", str(d))
    return d


# --------------------------------------------------------------------------- pure policy


@pytest.mark.parametrize("flags,cls", [(SPR, "amx"), (EPYC, "avx512_bf16"), ({"avx2", "avx512_vnni"}, "vnni"),
                                       ({"avx2", "avx_vnni"}, "vnni"), ({"avx2"}, "avx2"), (set(), "base")])
def test_isa_class(flags, cls):
    assert pol.isa_class(flags) == cls


def test_rank_on_this_cpu_class_puts_bf16_int4_first_and_measures_the_close_pair():
    cands = pol.rank(EPYC, "cpu", "int4")
    assert [c.label for c in cands] == ["bfloat16+int4", "bfloat16", "float32+int4", "float32"]
    assert pol.close(EPYC, cands)  # 1210 vs 1120 tok/s at 32 rows: within CLOSE_RATIO


def test_rank_elsewhere():
    amx = pol.rank(SPR, "cpu", "int4")
    assert amx[0] == Candidate("bfloat16", "int4") and not pol.close(SPR, amx)  # AMX int4: far ahead at both
    assert pol.close(SPR, pol.rank(SPR, "cpu", "int8"))  # int8 = the dense copy above 4 rows: close
    vnni = pol.rank({"avx2", "avx512_vnni"}, "cpu", "int4")
    assert [c.label for c in vnni] == ["float32+int4", "float32"] and pol.close({"avx512_vnni"}, vnni)
    assert [c.label for c in pol.rank(set(), "cpu", "int4")] == ["float32"]
    assert not pol.close(set(), pol.rank(set(), "cpu", "int4"))
    assert [c.label for c in pol.rank(EPYC, "cpu", None)] == ["bfloat16", "float32"]  # float file: no quantization


def test_pins_filter_the_ranking():
    assert [c.label for c in pol.rank(EPYC, "cpu", "int4", dtype="float32")] == ["float32+int4", "float32"]
    assert [c.label for c in pol.rank(EPYC, "cpu", "int4", quantization="none")] == ["bfloat16", "float32"]
    assert pol.rank(EPYC, "cpu", "int4", "float32", "int8") == [Candidate("float32", "int8")]
    assert pol.rank(set(), "cpu", None, quantization="int4") == [Candidate("float32", "int4")]
    assert pol.rank(EPYC, "cuda:0", "int4", cuda_bf16=True) == [Candidate("bfloat16", None)]
    assert pol.rank(EPYC, "cuda:0", "int4", quantization="int8") == [Candidate("float32", "int8")]
    with pytest.raises(ValueError, match="dtype"):
        pol.rank(EPYC, dtype="float16")
    with pytest.raises(ValueError, match="quantization"):
        pol.rank(EPYC, quantization="q4")


def test_decide_by_geometric_mean_and_explain():
    m = {Candidate("bfloat16", None): {"1": 87.0, "32": 1120.0}, Candidate("bfloat16", "int4"): {"1": 150.0, "32": 1000.0}}
    assert pol.decide(m) == Candidate("bfloat16", "int4")  # sqrt(150*1000)=387 > sqrt(87*1120)=312
    m[Candidate("bfloat16", "int4")] = {"1": 150.0}  # a level missing scores 0
    assert pol.decide(m) == Candidate("bfloat16", None)
    with pytest.raises(ValueError):
        pol.decide({})
    line = pol.explain(EPYC, Candidate("bfloat16", None), pol.rank(EPYC, "cpu", "int4"), m)
    assert line.startswith("bfloat16: avx512_bf16, measured 87 vs 150 tok/s at 1 row") and "bfloat16+int4" in line
    assert "by record" in pol.explain(SPR, Candidate("bfloat16", "int4"), pol.rank(SPR, "cpu", "int4"), None)


def test_labels_and_manifest_pins():
    assert Candidate.parse("bfloat16+int4") == Candidate("bfloat16", "int4")
    assert Candidate.parse("float32").label == "float32"
    with pytest.raises(ValueError, match="float16"):
        Candidate.parse("float16")
    assert [pol.manifest_pin(x) for x in ("int4", "INT8", "none", "Q4_1", None, "")] == ["int4", "int8", "none",
                                                                                         None, None, None]


# --------------------------------------------------------------------------- GGUF header


def test_header_shapes_match_the_gguf_reader(tiny):
    import gguf

    infos = kc.read_tensor_infos(tiny)
    reader = gguf.GGUFReader(tiny)
    assert {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors} == infos
    s = kc.read_shapes(tiny)
    assert s.layers == len({t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")})
    assert s.qkv[1] == s.hidden and s.gate_up[0] == 2 * s.down[1] and "Q8_0" in s.proj_types


def test_header_refuses_a_non_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 40)
    with pytest.raises(ValueError, match="not a GGUF"):
        kc.read_tensor_infos(str(p))


# --------------------------------------------------------------------------- choice + cache


def test_choice_is_measured_once_then_read_from_the_cache(tiny, cache_dir, monkeypatch):
    from actors.worker.engine import hardware

    monkeypatch.setattr(hardware, "isa_flags", lambda: frozenset(EPYC))  # bf16+int8 vs bf16: no record, measured
    calls = []
    real = kc.measure
    monkeypatch.setattr(kc, "measure", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    first = kc.choose(tiny, "tiny@1")
    print(first.line())
    assert calls == [[Candidate("bfloat16", "int8"), Candidate("bfloat16", None)]]
    assert set(first.measured) == {"bfloat16+int8", "bfloat16"} and "measured" in first.reason
    assert first.cached == str(cache_dir / kc.CACHE_FILE) and (cache_dir / kc.CACHE_FILE).exists()
    assert (first.dtype, first.quantization) in (("bfloat16", "int8"), ("bfloat16", None))
    t = time.perf_counter()
    again = kc.choose(tiny, "tiny@1")
    assert time.perf_counter() - t < 0.5 and len(calls) == 1
    assert (again.dtype, again.quantization, again.reason) == (first.dtype, first.quantization, first.reason)
    os.utime(tiny, ns=(1, 1))  # another file (mtime) -> another key -> measured anew
    kc.choose(tiny, "tiny@1")
    assert len(calls) == 2
    kc.choose(tiny, "tiny@2")  # another version of the same file: the same answer, not measured again
    assert len(calls) == 2


def test_cache_keeps_the_newest_entries(tmp_path):
    path = tmp_path / kc.CACHE_FILE
    for i in range(kc.CACHE_ENTRIES + 6):
        assert kc._write_cache(path, f"k{i}", {"dtype": "float32", "at": f"2026-12-02T08:{i:02d}:00Z"})
    data = kc._read_cache(path)
    assert len(data) == kc.CACHE_ENTRIES and "k0" not in data and f"k{kc.CACHE_ENTRIES + 5}" in data


def test_pins_are_not_measured(tiny, cache_dir, monkeypatch):
    monkeypatch.setattr(kc, "measure", lambda *a, **k: pytest.fail("measured a pinned path"))
    c = kc.choose(tiny, "tiny@1", dtype="float32", quantization="none")
    assert (c.dtype, c.quantization) == ("float32", None) and "pinned" in c.reason
    c = kc.choose(tiny, "tiny@1", dtype="bfloat16")  # quantization for a pinned dtype: the engine's rule
    assert (c.dtype, c.quantization) == ("bfloat16", "auto")
    c = kc.choose(tiny, "tiny@1", dtype="float32", manifest_quantization="int8")
    assert (c.dtype, c.quantization) == ("float32", "int8") and "manifest quantization int8" in c.reason
    cached = kc._read_cache(cache_dir / kc.CACHE_FILE)  # a pinned quantized path: only its kernel per row count
    assert not [k for k, v in cached.items() if "dtype" in v] and all(k.endswith(":rows") for k in cached)


def test_measure_gives_rates_for_both_candidates(tiny):
    shapes = kc.read_shapes(tiny)
    got = kc.measure([Candidate("float32", "int8"), Candidate("float32", None)], shapes, reps=2)
    print(got)
    assert set(got) == {"float32+int8", "float32"}
    assert all(r["1"] > 0 and r["32"] > 0 and r["ms"] > 0 for r in got.values())


# --------------------------------------------------------------------------- worker and bench


def test_worker_defaults_to_the_chosen_path(tiny, cache_dir, capsys):
    from actors.worker.actor import add_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny@1", "--kv-cache-bytes", str(2**20), "--no-progress"])
    assert (args.dtype, args.quantization) == ("auto", "auto")
    engine = build_engine({"artifact": tiny, "format": "gguf"}, args)
    choice = kc.choose(tiny, "tiny@1")  # the cached answer the worker used
    assert (engine.dtype_name, engine.quantization) == (choice.dtype, choice.quantization)
    assert f"worker: engine path {choice.reason}" in capsys.readouterr().err
    from actors.worker.engine.row_kernels import RowTable
    from actors.worker.registration import worker_info

    assert engine.row_table == RowTable.from_json(choice.row_table)  # the measured kernel per row count, run
    assert worker_info(engine, args, "w1")["row_kernels"] == (engine.row_table.line() if engine.row_table else None)


def test_roofline_divides_by_the_peak_of_the_dtype_run():
    from bench.engine_bench import roofline_peak

    assert roofline_peak("float32") == "fp32" and roofline_peak("bfloat16") == "bf16"
