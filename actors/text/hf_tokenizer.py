"""Tokenizer of a Hugging Face model directory: `tokenizer.json` through `tokenizers`, as it is.

The directory's `tokenizer.json` brings its own normalizer, pre-tokenizer, model, post-processor (which
decides whether `encode(..., add_special_tokens=True)` adds BOS) and decoder; nothing is rebuilt, so the ids
are the `tokenizers` reference by construction. Around it:

* `tokenizer_config.json`: `bos_token` / `eos_token` (a string or `{"content": ...}`) and, for older
  models, `chat_template` (a string, or a list of `{"name", "template"}` of which "default" is used);
* `chat_template.jinja`, when present, is the chat template (it wins over tokenizer_config's, as in
  transformers);
* `generation_config.json`: the end-of-generation ids (:attr:`HFTokenizer.eog_token_ids`, actors/text/eog.py).

Only byte-level decoders are accepted (`token_bytes`, which the streaming detokenizer needs, is exact for
them); any other decoder is refused naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer

from .eog import hf_eog_ids, token_text
from .tokenizer import TokenizerError, check_token_id, spelled_bytes

__all__ = ["HFTokenizer"]

SUPPORTED_DECODERS = ("ByteLevel",)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _decoder_types(decoder: Any) -> list[str]:
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return [t for d in decoder.get("decoders") or () for t in _decoder_types(d)]
    return [str(decoder.get("type"))]


def _chat_template(model_dir: str, config: dict) -> str | None:
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: the "default" one
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) and tpl else None


class HFTokenizer:
    """Tokenizer of an HF model directory (build it with :meth:`from_dir`); the interface of GGUFTokenizer."""

    def __init__(self, tok: Tokenizer, config: dict, chat_template: str | None, eog: frozenset[int]) -> None:
        self._tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        added = tok.get_added_tokens_decoder()
        self._added = {i: a.content for i, a in added.items()}
        self._special = {a.content: i for i, a in added.items() if a.special}
        self._special_ids = frozenset(self._special.values())
        self._bos_token = token_text(config.get("bos_token"))
        self._eos_token = token_text(config.get("eos_token"))
        self._bos = tok.token_to_id(self._bos_token) if self._bos_token is not None else None
        self._eos = tok.token_to_id(self._eos_token) if self._eos_token is not None else None
        self._chat_template = chat_template
        self._eog = eog
        with_specials = tok.encode("", add_special_tokens=True).ids
        self._add_bos = bool(with_specials) and self._bos is not None and with_specials[0] == self._bos

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> HFTokenizer:
        """Build from an HF model directory holding `tokenizer.json` (+ `tokenizer_config.json`,
        `chat_template.jinja`, `generation_config.json` when present).

        Raises TokenizerError when `tokenizer.json` is missing or malformed or its decoder is not byte-level
        (the message names it), OSError when a file cannot be read.
        """
        model_dir = os.fspath(model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise TokenizerError(f"{model_dir}: no tokenizer.json")
        spec = _read_json(path)
        decoders = _decoder_types(spec.get("decoder"))
        if "ByteLevel" not in decoders:
            raise TokenizerError(
                f"{path}: unsupported decoder {'+'.join(decoders) or 'none'!r} (supported: "
                f"{', '.join(SUPPORTED_DECODERS)}): streamed text could not be decoded byte-exactly")
        try:
            tok = Tokenizer.from_str(json.dumps(spec))
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            raise TokenizerError(f"{path}: {exc}") from exc
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        try:
            eog = hf_eog_ids(model_dir, tok.token_to_id)
        except ValueError as exc:
            raise TokenizerError(str(exc)) from exc
        return cls(tok, config, _chat_template(model_dir, config), eog)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their id. With `add_special_tokens`,
        the tokenizer.json post-processor adds what it adds (BOS for Llama 3, nothing for Qwen2)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` for many texts at once."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (the tokenizer.json decoder). Raises ValueError for an id outside the vocabulary."""
        ids = list(ids)
        for i in ids:
            check_token_id(i, self._vocab_size)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of token `token_id` (added tokens: the UTF-8 of their text). ValueError out of range."""
        check_token_id(token_id, self._vocab_size)
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        s = self._tok.id_to_token(token_id)
        return b"" if s is None else spelled_bytes(s)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level spelling), None for a gap in the ids."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string or an added token's text, or None."""
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """True for special added tokens (skipped by `decode(..., skip_special_tokens=True)`)."""
        return token_id in self._special_ids

    # ------------------------------------------------------------------ properties
    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Ids that end a generation by default: generation_config.json `eos_token_id` (int or list), else
        tokenizer_config.json's `eos_token` (actors/text/eog.py)."""
        return self._eog

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS (the tokenizer.json post-processor)."""
        return self._add_bos

    @property
    def vocab_size(self) -> int:
        """1 + the largest id (added tokens included)."""
        return self._vocab_size

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def pre_tokenizer_name(self) -> str | None:
        """None: the pre-tokenizer is spelled out in tokenizer.json."""
        return None

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special added tokens as `{text: id}`; a copy."""
        return dict(self._special)

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (do not mutate)."""
        return self._tok

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self._vocab_size}, specials={len(self._special)})"
