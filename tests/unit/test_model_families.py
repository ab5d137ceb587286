"""The torch runner's model is built from the architecture config (actors/worker/engine/model_families.py)."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from actors.worker.engine.gguf_loader import load_gguf, read_config
from actors.worker.engine.model import LlamaModel
from actors.worker.engine.model_families import FAMILIES, build_model
from tests.engine_fixtures import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tinymf") / "tiny.gguf"))


def test_config_names_the_family_and_the_tied_head(tiny):
    reader = gguf.GGUFReader(tiny)
    cfg = read_config(reader)
    assert cfg.architecture == "llama" and cfg.architecture in FAMILIES
    assert cfg.tie_word_embeddings == (not any(t.name == "output.weight" for t in reader.tensors))


def test_build_model_picks_the_family_and_ties_the_head(tiny):
    cfg, weights = load_gguf(tiny, torch.float32)
    weights.pop("lm_head")
    model = build_model(dataclasses.replace(cfg, tie_word_embeddings=True), weights, 64, native_kernels=False)
    assert isinstance(model, LlamaModel) and model.lm_head.weight is model.embed


def test_unknown_architecture_is_refused(tiny):
    cfg, weights = load_gguf(tiny, torch.float32)
    with pytest.raises(ValueError, match="no model family"):
        build_model(dataclasses.replace(cfg, architecture="mamba"), weights, 64)
