"""Tokenizer of a Hugging Face model directory: `tokenizer.json` through `tokenizers`, as it is.

The directory's `tokenizer.json` brings its own normalizer, pre-tokenizer, model, post-processor (which
decides whether `encode(..., add_special_tokens=True)` adds BOS) and decoder; nothing is rebuilt, so the ids
are the `tokenizers` reference by construction. Around it:

* `tokenizer_config.json`: `bos_token` / `eos_token` (a string or `{"content": ...}`) and, for older
  models, `chat_template` (a string, or a list of `{"name", "template"}` of which "default" is used);
* `chat_template.jinja`, when present, is the chat template (it wins over tokenizer_config's, as in
  transformers);
* `generation_config.json`: the end-of-generation ids (:attr:`HFTokenizer.eog_token_ids`, actors/text/eog.py).

Decoders accepted (`token_bytes` and `lead_space`, which the streaming detokenizer needs, are exact for them):
byte-level (`ByteLevel`), and SentencePiece style: a `Metaspace` decoder, or a sequence of `Replace("▁", " ")`,
`ByteFallback`, `Fuse`, `Strip(" ", 0 or 1, 0)` (Llama 2's and Mistral's tokenizer.json), `Metaspace`; any other
decoder or step is refused naming it (decision 0045).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer

from .eog import hf_eog_ids, token_text
from .spm import SPACE, byte_token_value
from .tokenizer import TokenizerError, check_token_id, spelled_bytes

__all__ = ["HFTokenizer"]

SUPPORTED_DECODERS = ("ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip")


def _spm_decoder(decoder: Any, path: str) -> tuple[bool, bool, str]:
    """`(replace "▁", byte fallback, lead rule)` of a SentencePiece-style decoder (module docstring). The lead rule
    is detokenizer.TokenBytes': "strip_space" for `Strip(" ", 1, 0)` after `Fuse`, "drop_spaces" for a `Metaspace`
    that prepends (it drops every "▁" of the first token), else "keep". TokenizerError naming anything else."""
    steps = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]
    replace = fallback = fused = False
    lead = "keep"
    for step in steps:
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "Replace" and (step.get("pattern") or {}).get("String") == SPACE and step.get("content") == " ":
            replace = True
        elif kind == "Metaspace" and step.get("replacement") == SPACE and not fused:
            replace = True
            prepends = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            lead = "drop_spaces" if prepends in ("always", "first") else "keep"
        elif kind == "ByteFallback":
            fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and step.get("content") == " " and step.get("stop") == 0 and step.get("start") in (0, 1) \
                and (fused or step.get("start") == 0):
            lead = "strip_space" if step.get("start") == 1 else lead
        else:
            raise TokenizerError(f"{path}: unsupported decoder step {json.dumps(step, ensure_ascii=False)} (supported: "
                                 f"{', '.join(SUPPORTED_DECODERS)}, as Llama 2's tokenizer.json has them): streamed "
                                 f"text could not be decoded byte-exactly")
    return replace, fallback, lead


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

    def __init__(self, tok: Tokenizer, config: dict, chat_template: str | None, eog: frozenset[int],
                 spm: tuple[bool, bool, str] | None = None) -> None:
        """`spm`: `(replace "▁", byte fallback, lead rule)` of a SentencePiece-style decoder, None for byte-level."""
        self._tok = tok
        self._spm = spm
        self._byte_ids = frozenset(i for t, i in tok.get_vocab(with_added_tokens=False).items()
                                   if spm is not None and spm[1] and byte_token_value(t) is not None)
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
        spm = None
        if "ByteLevel" not in decoders:
            if not decoders:
                raise TokenizerError(f"{path}: unsupported decoder 'none' (supported: {', '.join(SUPPORTED_DECODERS)})"
                                     f": streamed text could not be decoded byte-exactly")
            spm = _spm_decoder(spec["decoder"], path)
        try:
            tok = Tokenizer.from_str(json.dumps(spec))
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            raise TokenizerError(f"{path}: {exc}") from exc
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        try:
            eog = hf_eog_ids(model_dir, tok.token_to_id)
        except ValueError as exc:
            raise TokenizerError(str(exc)) from exc
        return cls(tok, config, _chat_template(model_dir, config), eog, spm)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their id. With `add_special_tokens`,
        the tokenizer.json post-processor adds what it adds (BOS for Llama 3, nothing for Qwen2)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat template: nothing added (the template writes BOS where the model wants it), as
        transformers' `apply_chat_template` and vLLM's chat endpoint tokenize."""
        return self._tok.encode(text, add_special_tokens=False).ids

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
        if self._spm is not None:  # SentencePiece: "▁" is a space (added tokens too: the decoder sees them)
            if token_id in self._byte_ids:
                return bytes([byte_token_value(self._tok.id_to_token(token_id))])
            s = self._added.get(token_id) or self._tok.id_to_token(token_id) or ""
            return (s.replace(SPACE, " ") if self._spm[0] else s).encode("utf-8")
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
    def lead_space(self) -> str:
        """How the decoder changes a stream's first token (detokenizer.TokenBytes' rule): "keep" (byte-level),
        "strip_space" (`Strip(" ", 1, 0)`) or "drop_spaces" (`Metaspace`)."""
        return "keep" if self._spm is None else self._spm[2]

    @property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of the `<0xNN>` tokens the `ByteFallback` decoder turns into bytes (empty without one)."""
        return self._byte_ids

    @property
    def lead_keep_ids(self) -> frozenset[int]:
        """Ids whose spaces the "drop_spaces" rule keeps: byte tokens, and tokens whose text holds a literal " "
        (the `Metaspace` decoder drops only "▁")."""
        if self._spm is None or self._spm[2] != "drop_spaces":
            return frozenset()
        return self._byte_ids | {i for i in range(self._vocab_size) if " " in (self._added.get(i) or
                                                                             self._tok.id_to_token(i) or "")}

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
