"""Our tokenizers vs the `tokenizers` reference, on vocabularies trained at test time (tests/tokenizer_fixtures.py).

For every vocabulary type (GPT-2, SmolLM, Llama 3 and Qwen2 pre-tokenizers), the GGUF built from the same
vocabulary and merges (`tokenizer.ggml.pre` naming the pre-tokenizer) and the HF directory give the ids of the
model's `tokenizer.json` on a corpus of more than 200 strings; the engine's streaming detokenizer gives the
one-shot decode; a wrong pre-tokenizer gives other ids (so these tests can fail); unknown names are refused.
"""

from __future__ import annotations

import random

import pytest

from actors.text.gguf_meta import read_gguf_metadata
from actors.text.hf_tokenizer import HFTokenizer
from actors.text.loader import TextTokenizer, load_tokenizer
from actors.text.tokenizer import GGUFTokenizer, TokenizerError
from actors.worker.engine.detokenizer import IncrementalDetokenizer, load_token_bytes, token_bytes_table
from tests.tokenizer_fixtures import FAMILIES, build, reference_corpus
from tests.tokenizer_fixtures import streamed_detokenize as _streamed

FAMILY_NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tok"))
    return {f: build(f, root) for f in FAMILY_NAMES}


def _ref_ids(fx, text: str, add_special_tokens: bool = False) -> list[int]:
    return fx.reference.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gguf_ids_equal_the_reference_on_the_corpus(fixtures, family):
    fx = fixtures[family]
    tok = GGUFTokenizer.from_gguf(fx.gguf_path)
    assert tok.pre_tokenizer_name == FAMILIES[family].gguf_pre
    corpus = reference_corpus(family)
    assert len(corpus) >= 200
    wrong = [t for t in corpus if tok.encode(t) != _ref_ids(fx, t)]
    assert not wrong, f"{len(wrong)} strings differ, first: {wrong[0]!r}"
    assert tok.encode_batch(corpus) == [_ref_ids(fx, t) for t in corpus]
    # BOS exactly where the reference's post-processor adds it (Llama 3)
    for text in corpus[:20]:
        assert tok.encode(text, add_special_tokens=True) == _ref_ids(fx, text, True)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hf_dir_ids_equal_the_reference_on_the_corpus(fixtures, family):
    fx = fixtures[family]
    tok = HFTokenizer.from_dir(fx.hf_dir)
    corpus = reference_corpus(family)
    assert [tok.encode(t) for t in corpus] == [_ref_ids(fx, t) for t in corpus]
    assert [tok.encode(t, add_special_tokens=True) for t in corpus[:20]] == [_ref_ids(fx, t, True) for t in corpus[:20]]
    assert tok.add_bos_token == FAMILIES[family].add_bos
    assert tok.vocab_size == GGUFTokenizer.from_gguf(fx.gguf_path).vocab_size


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_specials_added_tokens_and_decode(fixtures, family):
    fx = fixtures[family]
    fam = FAMILIES[family]
    for tok in (GGUFTokenizer.from_gguf(fx.gguf_path), HFTokenizer.from_dir(fx.hf_dir)):
        assert set(tok.special_tokens) == set(fam.specials)
        for text, tid in tok.special_tokens.items():
            assert tok.encode(text) == [tid] and tok.is_special(tid)
        for text in fam.plain_added:  # matched whole, not special (kept by decode)
            (tid,) = tok.encode(text)
            assert not tok.is_special(tid) and tok.decode([tid]) == text
        assert tok.eos_token == fam.eos and tok.bos_token == fam.bos
        for text in reference_corpus(family):
            ids = tok.encode(text)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == fx.reference.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_streamed_detokenization_equals_one_shot_decode(fixtures, family):
    fx = fixtures[family]
    rng = random.Random(family)
    gguf_table = load_token_bytes(fx.gguf_path)  # what the worker loads (special tokens skipped)
    assert gguf_table == token_bytes_table(fx.tokens, fx.token_types)
    hf = HFTokenizer.from_dir(fx.hf_dir)
    hf_table = [hf.token_bytes(i) for i in range(hf.vocab_size)]  # special tokens as their text
    gg = GGUFTokenizer.from_gguf(fx.gguf_path)
    assert hf_table == [gg.token_bytes(i) for i in range(gg.vocab_size)]
    for text in reference_corpus(family):
        ids = _ref_ids(fx, text)
        assert _streamed(gguf_table, ids, rng) == fx.reference.decode(ids, skip_special_tokens=True), text
        assert _streamed(hf_table, ids, rng) == fx.reference.decode(ids, skip_special_tokens=False), text
        # one token at a time: a character split over tokens (emoji, CJK) is never released broken
        detok = IncrementalDetokenizer(hf_table)
        assert all("\ufffd" not in detok.add_tokens([t]) for t in ids if "\ufffd" not in text)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_wrong_pre_tokenizer_gives_other_ids(fixtures, family):
    """Negative control: the same vocabulary with any other family's pre-tokenizer differs on the corpus."""
    fx = fixtures[family]
    meta = read_gguf_metadata(fx.gguf_path)
    corpus = reference_corpus(family)
    for other in FAMILY_NAMES:
        if other == family:
            continue
        tok = GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": FAMILIES[other].gguf_pre})
        assert any(tok.encode(t) != _ref_ids(fx, t) for t in corpus), (family, other)


def test_qwen2_needs_its_nfc_normalizer(fixtures):
    fx = fixtures["qwen2"]
    tok = GGUFTokenizer.from_gguf(fx.gguf_path)
    text = "e\u0301te\u0301"  # not NFC
    assert tok.encode(text) == _ref_ids(fx, text) == tok.encode("\u00e9t\u00e9")
    tok.backend.normalizer = None  # only this test's copy
    assert tok.encode(text) != _ref_ids(fx, text)


@pytest.mark.parametrize("name", ["llama-bpe", "llama3", "qwen2", "smollm", "gpt-2", "default"])
def test_supported_pre_tokenizer_names_load(fixtures, name):
    meta = read_gguf_metadata(fixtures["gpt2"].gguf_path)
    assert GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": name}).pre_tokenizer_name == name


@pytest.mark.parametrize("name", ["deepseek-llm", "tekken", "chatglm-bpe", "made-up"])
def test_unknown_pre_tokenizer_refused_by_name(fixtures, name):
    meta = read_gguf_metadata(fixtures["gpt2"].gguf_path)
    with pytest.raises(TokenizerError) as e:
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": name})
    assert repr(name) in str(e.value) and "llama-bpe" in str(e.value) and "qwen2" in str(e.value)


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv"])  # "llama": tests/unit/test_tokenizer_spm.py
def test_unknown_vocabulary_type_refused_by_name(fixtures, model):
    meta = read_gguf_metadata(fixtures["gpt2"].gguf_path)
    with pytest.raises(TokenizerError) as e:
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.model": model})
    assert repr(model) in str(e.value)


def test_end_of_generation_ids(fixtures):
    fx = fixtures["llama3"]
    ref = fx.reference
    ids = {t: ref.token_to_id(t) for t in FAMILIES["llama3"].specials}
    # GGUF: eos (end_of_text), eot, eom, and the end markers llama.cpp recognises by text
    assert GGUFTokenizer.from_gguf(fx.gguf_path).eog_token_ids == {
        ids["<|end_of_text|>"], ids["<|eot_id|>"], ids["<|eom_id|>"]}
    # HF: generation_config.json's list
    assert HFTokenizer.from_dir(fx.hf_dir).eog_token_ids == {
        ids["<|end_of_text|>"], ids["<|eot_id|>"], ids["<|eom_id|>"]}
    q = fixtures["qwen2"]
    assert GGUFTokenizer.from_gguf(q.gguf_path).eog_token_ids == {
        q.reference.token_to_id("<|im_end|>"), q.reference.token_to_id("<|endoftext|>")}


def test_load_tokenizer_picks_by_path(fixtures, tmp_path):
    fx = fixtures["qwen2"]
    assert isinstance(load_tokenizer(fx.gguf_path), GGUFTokenizer)
    assert isinstance(load_tokenizer(fx.hf_dir), HFTokenizer)
    assert isinstance(load_tokenizer(fx.gguf_path), TextTokenizer) and isinstance(load_tokenizer(fx.hf_dir), TextTokenizer)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_tokenizer(tmp_path / "x.gguf")


def test_gguf_eog_rule_of_llama_cpp():
    from actors.text.eog import gguf_eog_ids

    toks = ["a", "<|end|>", "<|return|>", "<|call|>", "<|file_sep|>", "<|fim_pad|>", "b", "<|end_of_text|>"]
    meta = {"tokenizer.ggml.eos_token_id": 6, "tokenizer.ggml.eot_token_id": 99}  # 99: outside, ignored
    # harmony (gpt-oss): with <|return|> and <|call|>, <|end|> ends a message, not the generation
    assert gguf_eog_ids(toks, meta) == {2, 3, 4, 5, 6, 7}
    assert gguf_eog_ids(toks[:2], {}) == {1}
    assert gguf_eog_ids(["x", "y"], {"tokenizer.ggml.eom_token_id": 1}) == {1}


def test_hf_dir_refusals(fixtures, tmp_path):
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(fixtures["llama3"].hf_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        HFTokenizer.from_dir(d)
    (d / "generation_config.json").unlink()
    assert HFTokenizer.from_dir(d).eog_token_ids == {fixtures["llama3"].reference.token_to_id("<|end_of_text|>")}
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"},
                                                        "content": " "}, {"type": "CTC"}]}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match="unsupported decoder step.*CTC"):
        HFTokenizer.from_dir(d)
