"""A Hugging Face directory through what surrounds the engine (issue [20] item 2): the converted-weights cache,
the host's memory estimate, the kernel choice and ``actorserve profile``; and the status line of a model the
native kernels do not cover."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

from tests.family_models import build


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build("qwen3", tmp_path_factory.mktemp("plumbing"))


def test_weights_cache_reads_a_directory_back(qwen3, tmp_path, monkeypatch):
    from actors.worker.engine.weights_cache import read_artifact

    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", str(tmp_path))
    first = read_artifact(qwen3["hf"], torch.float32, use_cache=True)
    again = read_artifact(qwen3["hf"], torch.float32, use_cache=True)
    assert not first.cached and again.cached and again.config == first.config
    assert again.config.qk_norm and again.config.head_dim == 128
    assert set(again.weights) == set(first.weights)
    assert all(torch.equal(again.weights[k], first.weights[k]) for k in first.weights)


def test_host_memory_estimate_and_stamp_of_a_directory(qwen3):
    import os

    from actors.worker.host import _file_size
    from actors.worker.host_measured import _stamp

    size = os.path.getsize(os.path.join(qwen3["hf"], "model.safetensors"))
    assert _file_size(qwen3["hf"]) >= size
    assert _stamp(qwen3["hf"])[0] == _file_size(qwen3["hf"])


def test_kernel_choice_reads_a_directorys_shapes(qwen3):
    from actors.worker.engine.kernel_choice import read_shapes

    s = read_shapes(qwen3["hf"])
    assert (s.layers, s.qkv, s.o, s.gate_up, s.down, s.vocab, s.hidden) == (
        2, ((4 + 2 * 2) * 128, 64), (64, 4 * 128), (256, 64), (64, 128), 269, 64)
    assert set(s.proj_types) == {"F32"}


def test_profile_measures_a_directory(qwen3, tmp_path, monkeypatch):
    from control.ops.profile_cli import _engine, measure_curve

    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", str(tmp_path))
    args = argparse.Namespace(dtype="float32", device="cpu", quantization="none", kv_cache_bytes=4 * 2**20,
                              batches=(1, 2), prompts=(16,))
    engine = _engine({"artifact": qwen3["hf"], "format": "hf"}, args)
    assert engine.native_off_reason and "q/k" in engine.native_off_reason
    curve = measure_curve(engine, "local", (1, 2), (16,), 8, 4, log=lambda *a: None, repeats=1)
    assert [p.batch for p in curve.decode] == [1, 2] and curve.prefill[0].ttft_ms > 0


def test_status_says_why_a_model_runs_the_torch_path():
    from control.ops.status_detail import worker_detail

    line = worker_detail({"dtype": "float32", "quantization": None,
                          "native_off": "q/k RMSNorm (qwen3) is not in the native kernels"})
    assert line == "float32 (torch path: q/k RMSNorm (qwen3) is not in the native kernels)"
    assert worker_detail({"dtype": "float32", "quantization": None, "native_off": None}) == "float32"


def test_worker_record_carries_the_reason():
    from actors.worker.registration import worker_info

    engine = argparse.Namespace(dtype_name="float32", quantization=None, native_off_reason="dynamic NTK RoPE ...")
    args = argparse.Namespace(device="cpu", dtype="auto", max_num_seqs=4)
    assert worker_info(engine, args, "w1")["native_off"] == "dynamic NTK RoPE ..."


def test_manifest_records_a_hugging_face_directory():
    from control.state.manifest import ModelManifest

    m = ModelManifest.from_dict({"name": "q", "version": "1", "artifact": "/models/qwen3/"})
    assert m.format == "hf" and m.to_dict()["format"] == "hf"
    assert ModelManifest.from_dict({"name": "q", "version": "1", "artifact": "/m/x.gguf"}).format == "gguf"
    assert ModelManifest.from_dict({"name": "q", "version": "1", "artifact": "/m/q", "format": "hf"}).format == "hf"
    with pytest.raises(ValueError, match="format exl2 is not supported yet"):
        ModelManifest.from_dict({"name": "q", "version": "1", "artifact": "/m/q", "format": "exl2"})


def test_a_directorys_token_bytes_equal_the_gguf_of_the_same_vocabulary(qwen3):
    from actors.worker.engine.weights_cache import read_artifact

    hf, gg = read_artifact(qwen3["hf"], torch.float32), read_artifact(qwen3["gguf"], torch.float32)
    assert hf.token_bytes == gg.token_bytes and hf.token_bytes[3 + ord("a")] == b"a"
    assert sorted(hf.special_names) == sorted(gg.special_names) == [0, 1, 2]


def test_a_plain_llama_file_builds_the_tuned_structure(tmp_path):
    """The default model's family gains nothing per call: a llama GGUF without scaling builds LlamaModel itself,
    plain projections (no bias wrapper), no q/k norms, the static RoPE table and the native kernels where they
    build (the same structure as before the spec)."""
    from actors.worker.engine import cpu_kernels
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from actors.worker.engine.model import BiasedLinear, LlamaModel, RotaryEmbedding
    from tests.engine_fixtures import write_tiny_llama_gguf

    eng = LLMEngine(EngineConfig(model_path=write_tiny_llama_gguf(str(tmp_path / "t.gguf")), dtype="float32",
                                 kv_cache_bytes=2**20, max_loras=0))
    m = eng.model
    assert type(m) is LlamaModel and type(m.rope) is RotaryEmbedding and eng.native_off_reason is None
    assert not any(isinstance(lw.qkv, BiasedLinear) or lw.q_norm is not None for lw in m.layers)
    assert (m.kernels is not None) == (cpu_kernels.load() is not None)
