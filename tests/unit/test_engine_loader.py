"""GGUF loader: config from metadata, Q/K un-permutation, Q8_0 dequantization, tied head."""

import numpy as np
import pytest
import torch

from actors.worker.engine.gguf_loader import load_gguf, unpermute_qk
from actors.worker.engine.kv_cache import KVCache, bytes_per_block
from tests.engine_fixtures import write_tiny_llama_gguf


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The permutation llama.cpp's convert_hf_to_gguf.py applies to HF Q/K weights."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, 8), 8), w)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("ld") / "t.gguf"))


def test_config_and_shapes(tiny, capsys):
    cfg, w = load_gguf(tiny, progress=True)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert (cfg.ffn_size, cfg.vocab_size, cfg.context_length, cfg.bos_token_id, cfg.eos_token_id) == (128, 269, 512, 1, 2)
    assert w["layers.0.wq"].shape == (64, 64) and w["layers.0.wk"].shape == (32, 64)
    assert w["layers.0.w_down"].shape == (64, 128) and w["layers.1.w_gate"].shape == (128, 64)
    assert w["lm_head"] is w["embed"] and w["embed"].dtype == torch.float32
    assert "loading" in capsys.readouterr().err


def test_q8_0_tensor_close_to_f32_original(tiny):
    from bench.tiny_model import _tensors

    _, w = load_gguf(tiny)
    orig = _tensors(np.random.default_rng(0), 2, 64, 4, 2, 128, 269)["blk.0.ffn_down.weight"]
    err = (w["layers.0.w_down"] - torch.from_numpy(orig)).abs().max().item()
    assert 0 < err < np.abs(orig).max() / 100  # Q8_0: 8-bit per 32-block scale


def test_bfloat16_load(tiny):
    _, w = load_gguf(tiny, dtype=torch.bfloat16)
    assert w["layers.1.wo"].dtype == torch.bfloat16


def test_kv_cache_sizing(tiny):
    cfg, _ = load_gguf(tiny)
    per_block = bytes_per_block(cfg, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    kv = KVCache(cfg, 10 * per_block + 5, 16, torch.float32, "cpu")
    assert kv.num_blocks == 10 and kv.capacity_tokens == 160 and kv.num_bytes == 10 * per_block
    assert kv.tensor.shape == (2, 2, 10, 16, 2, 16)
    assert "10 blocks" in kv.describe()
    with pytest.raises(ValueError):
        KVCache(cfg, per_block - 1, 16, torch.float32, "cpu")


def test_an_engine_load_parses_the_gguf_once(tiny, monkeypatch):
    """One parse of the default model's metadata costs seconds: weights, quantization, token bytes and the
    control-token names all come from one ``GGUFReader``."""
    import gguf

    from actors.worker.engine.engine import EngineConfig, LLMEngine

    opened: list[str] = []
    real = gguf.GGUFReader

    class Counting(real):
        def __init__(self, path, mode="r"):
            opened.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    engine = LLMEngine(EngineConfig(model_path=tiny, dtype="bfloat16", quantization="auto",
                                    kv_cache_bytes=1 << 20, max_num_seqs=2))
    assert opened == [tiny]
    assert engine.structured.tokenizer is not None  # control-token names were read from that one parse
    assert opened == [tiny]
