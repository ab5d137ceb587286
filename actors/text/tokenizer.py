"""Tokenizer built from the vocabulary stored in a GGUF file: byte-level BPE (`gpt2`) or SentencePiece (`llama`).

A GGUF carries no `tokenizer.json`; it stores llama.cpp-named metadata (`tokenizer.ggml.tokens`,
`.merges`, `.token_type`, `.pre`, special token ids, `tokenizer.chat_template`). We build a Hugging Face
`tokenizers.Tokenizer` from those so that our ids equal the ids of the model's own `tokenizer.json`
(tests/unit/test_tokenizer_reference.py trains such vocabularies at test time and compares). The
construction rules (see docs/decisions/0003-tokenizer.md and 0038-tokenizers-and-templates.md):

* model: BPE over the file's vocabulary and merges; no dropout, no subword prefix/suffix, no unk
  fusing. Tokens that are not spelled in the GPT-2 byte-to-unicode alphabet are re-spelled from their
  UTF-8 bytes (this only matters for mislabelled files). `tokenizer.ggml.model == "llama"` (SentencePiece:
  Llama 2, Mistral, Phi-3) is built by actors/text/spm.py from `tokenizer.ggml.scores` (llama.cpp's SPM
  tokenizer; decision 0045); any other model is refused naming it.
* normalizer and pre-tokenizer: the ones `tokenizer.ggml.pre` names (actors/text/pretokenizers.py:
  gpt-2/default, smollm, llama-bpe/llama3, qwen2, ...); an unknown name is refused naming it.
* decoder: byte-level (SentencePiece: "▁" as a space, `<0xNN>` byte fallback, the prefix space stripped).
* normalisations a file may name that no path here applies (`tokenizer.ggml.remove_extra_whitespaces`,
  `.precompiled_charsmap`, `.normalizer.lowercase`, `.normalizer.strip_accents`) are refused naming the key.
* added tokens: `token_type == 3` (control) as special tokens, `== 4` (user defined) as plain added
  tokens; both unnormalized, matched whole in the input.
* end of generation: :attr:`GGUFTokenizer.eog_token_ids` (actors/text/eog.py, llama.cpp's rule).

Only `tokenizers` is needed at run time (transformers is a test-only dependency).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models

from .eog import gguf_eog_ids
from .gguf_meta import metadata_from_reader, read_gguf_metadata
from .pretokenizers import SUPPORTED_PRE_TOKENIZERS, gguf_pre_tokenizer
from .spm import MAX_TIED_SHARE, build_spm_backend, phi3_rstrip, spm_piece_bytes

log = logging.getLogger("actorserve.text")

__all__ = ["GGUFTokenizer", "TokenizerError", "bytes_to_unicode", "spelled_bytes", "check_token_id"]

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.scores",
    "tokenizer.chat_template",
    "tokenizer.ggml.remove_extra_whitespaces",
    "tokenizer.ggml.normalizer.lowercase",
    "tokenizer.ggml.normalizer.strip_accents",
    "tokenizer.ggml.precompiled_charsmap",
    "general.name",
)
_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")
SUPPORTED_MODELS = ("gpt2", "llama")
# normalisations llama.cpp applies to other vocabulary types (UGM, WPM) only: a file naming one is refused
_UNAPPLIED = ("tokenizer.ggml.remove_extra_whitespaces", "tokenizer.ggml.normalizer.lowercase",
              "tokenizer.ggml.normalizer.strip_accents", "tokenizer.ggml.precompiled_charsmap")


class TokenizerError(ValueError):
    """The GGUF does not describe a tokenizer this module can build."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (Radford et al., 2019, `encoder.py`).

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes map to code points from 256
    upward, in byte order. Byte-level BPE vocabularies are spelled in this alphabet (space is "Ġ").
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def spelled_bytes(spelling: str) -> bytes:
    """The raw bytes a byte-level token spelling stands for (GPT-2's byte/unicode table, ``bytes_to_unicode``
    reversed); text outside that alphabet (an added token's text) as its UTF-8."""
    inv = _unicode_to_bytes()
    try:
        return bytes(inv[c] for c in spelling)
    except KeyError:
        return spelling.encode("utf-8")


def check_token_id(token_id: int, vocab_size: int) -> None:
    """ValueError unless ``0 <= token_id < vocab_size`` (the message names both)."""
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} is outside the vocabulary of {vocab_size} tokens")


class GGUFTokenizer:
    """Tokenizer for a GGUF whose `tokenizer.ggml.model` is `gpt2` (byte-level BPE) or `llama` (SentencePiece).

    Build it with :meth:`from_gguf`. Ids are ints in `[0, vocab_size)`.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        pre_tokenizer: str | None = None,
        eot_token_id: int | None = None,
        eom_token_id: int | None = None,
        model: str = "gpt2",
        scores: Sequence[float] | None = None,
        add_space_prefix: bool = True,
        model_name: str | None = None,
    ) -> None:
        """Build from raw GGUF tokenizer fields (see :meth:`from_gguf` for the usual entry point).

        `model` is `tokenizer.ggml.model`: "gpt2" uses `merges` and `pre_tokenizer` (`tokenizer.ggml.pre`, None:
        GPT-2's); "llama" (SentencePiece) uses `scores` and `add_space_prefix` and ignores `merges`, as llama.cpp
        does, and takes no pre-tokenizer but "default"; `model_name` (`general.name`) names Phi-3 files, whose
        special tokens strip the whitespace after them in llama.cpp (spm.phi3_rstrip). Raises TokenizerError when
        a special token id lies outside the vocabulary, the model or pre-tokenizer name is not one this module
        knows, or SentencePiece scores are missing or mostly tied (spm.MAX_TIED_SHARE).
        """
        n = len(tokens)
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); supported: "
                                 f"{', '.join(SUPPORTED_MODELS)}")
        for name, tid in (("bos", bos_token_id), ("eos", eos_token_id), ("unk", unk_token_id), ("pad", pad_token_id)):
            if tid is not None and not 0 <= tid < n:
                raise TokenizerError(f"GGUF {name}_token_id {tid} is outside the vocabulary of {n} tokens")
        types = list(token_types) if token_types is not None else [1] * n
        self._spm = model == "llama"
        if self._spm:
            tok, control, user_defined, spelled = self._sentencepiece(tokens, scores, types, pre_tokenizer,
                                                                     add_space_prefix, unk_token_id, model_name)
        else:
            tok, control, user_defined, spelled = self._byte_level(tokens, merges, types, pre_tokenizer)
        vocab = {t: i for i, t in enumerate(tokens if self._spm else spelled)}

        self._tok = tok
        self._types = types
        self._tokens = list(tokens)
        self._spelled = spelled
        self._vocab_size = n
        self._bos = bos_token_id
        self._eos = eos_token_id
        self._unk = unk_token_id
        self._pad = pad_token_id
        self._add_bos = bool(add_bos_token)
        self._add_eos = bool(add_eos_token)
        self._add_space_prefix = bool(add_space_prefix) and self._spm
        self._chat_template = chat_template
        self._pre = pre_tokenizer
        self._model = model
        self._special = {a.content: vocab[a.content] for a in control}
        self._special_ids = frozenset(self._special.values())
        self._added_ids = frozenset(vocab[a.content] for a in user_defined)
        self._eog = gguf_eog_ids(self._tokens, {"tokenizer.ggml.eos_token_id": eos_token_id,
                                                "tokenizer.ggml.eot_token_id": eot_token_id,
                                                "tokenizer.ggml.eom_token_id": eom_token_id})

    @staticmethod
    def _byte_level(tokens: Sequence[str], merges: Sequence[str], types: list[int],
                    pre_tokenizer: str | None) -> tuple[Tokenizer, list[AddedToken], list[AddedToken], list[str]]:
        """(tokenizer, control tokens, user-defined tokens, byte-level spellings) of a `gpt2` vocabulary."""
        pre = gguf_pre_tokenizer(pre_tokenizer)
        if pre is None:
            raise TokenizerError(
                f"unsupported GGUF pre-tokenizer {pre_tokenizer!r} (tokenizer.ggml.pre): its split rules are "
                f"unknown here, and another one would give different ids; supported: "
                f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}"
            )
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        spelled: list[str] = [
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens
        ]
        vocab = {t: i for i, t in enumerate(spelled)}
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(
            vocab=vocab,
            merges=merge_pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
        tok = Tokenizer(bpe)
        normalizer, tok.pre_tokenizer = pre
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.decoder = decoders.ByteLevel()
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == _TOKEN_TYPE_CONTROL and set(t) <= alphabet
        ]
        if control:
            tok.add_special_tokens(control)
        user_defined = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == _TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
        if user_defined:
            tok.add_tokens(user_defined)
        return tok, control, user_defined, spelled

    @staticmethod
    def _sentencepiece(tokens: Sequence[str], scores: Sequence[float] | None, types: list[int],
                       pre_tokenizer: str | None, add_space_prefix: bool, unk_token_id: int | None,
                       model_name: str | None) -> tuple[Tokenizer, list[AddedToken], list[AddedToken], list[str]]:
        """(tokenizer, control tokens, user-defined tokens, spellings) of a `llama` (SentencePiece) vocabulary."""
        if pre_tokenizer not in (None, "default"):
            raise TokenizerError(f"unsupported GGUF pre-tokenizer {pre_tokenizer!r} (tokenizer.ggml.pre) for a "
                                 f"SentencePiece vocabulary: llama.cpp applies none to it; supported: 'default'")
        if not isinstance(scores, (list, tuple)) or len(scores) != len(tokens):
            raise TokenizerError("GGUF SentencePiece vocabulary (tokenizer.ggml.model 'llama') needs "
                                 "tokenizer.ggml.scores, one per token: the merge order comes from them")
        tok, control, user, ties = build_spm_backend(tokens, scores, types, add_space_prefix=add_space_prefix,
                                                     unk_token_id=unk_token_id, rstrip_specials=phi3_rstrip(model_name))
        tied, merged = ties
        if tied > MAX_TIED_SHARE * merged:
            raise TokenizerError(f"GGUF tokenizer.ggml.scores: {tied} of {merged} merge results share their score "
                                 f"with another (a placeholder score?); llama.cpp merges tied candidates leftmost "
                                 f"first, which its BPE form here cannot reproduce, so ids would differ")
        if tied:
            log.warning("GGUF SentencePiece vocabulary: %d of %d merge results share their score with another; "
                        "llama.cpp merges tied candidates leftmost first, BPE by a fixed order (longer left piece "
                        "first), so rare ids may differ (actors/text/spm.py)", tied, merged)
        return tok, control, user, list(tokens)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | Any) -> GGUFTokenizer:
        """Build the tokenizer from a GGUF file path or an already-open `gguf.GGUFReader`.

        With a path only the metadata section is parsed (tens of ms), not the tensors.
        Raises TokenizerError when the file has no vocabulary or an unsupported tokenizer model
        (only `gpt2`, byte-level BPE, is supported), ValueError for a malformed file, OSError when
        the file cannot be read.
        """
        if isinstance(source, (str, os.PathLike)):
            meta = read_gguf_metadata(os.fspath(source), full_arrays=_ARRAYS)
        else:
            meta = metadata_from_reader(source, _KEYS)
        return cls.from_metadata(meta)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> GGUFTokenizer:
        """Build from a `{gguf key: value}` mapping (keys as in the GGUF, e.g. `tokenizer.ggml.tokens`).

        Raises TokenizerError as :meth:`from_gguf`.
        """
        model = meta.get("tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); supported: "
                                 f"{', '.join(SUPPORTED_MODELS)}")
        for key in _UNAPPLIED:
            value = meta.get(key)
            if value not in (None, False, 0, []):
                raise TokenizerError(f"unsupported GGUF normalisation {key} = {value!r}: not applied to a "
                                     f"{model!r} vocabulary here (nor by llama.cpp), so ids could differ")
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError("GGUF has no tokenizer.ggml.tokens")
        if model == "gpt2" and not isinstance(merges, list):
            raise TokenizerError("GGUF has no tokenizer.ggml.merges (needed for BPE)")
        llama = model == "llama"
        return cls(
            tokens,
            merges if isinstance(merges, list) else [],
            meta.get("tokenizer.ggml.token_type") if isinstance(meta.get("tokenizer.ggml.token_type"), list) else None,
            # a SentencePiece file without these ids means llama.cpp's defaults (llama-vocab.cpp): 1, 2, 0
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id", 1 if llama else None),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id", 2 if llama else None),
            unk_token_id=meta.get("tokenizer.ggml.unknown_token_id", 0 if llama else None),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            # llama.cpp's defaults for a SentencePiece vocabulary: BOS added, a prefix space (llama-vocab.cpp)
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", llama)),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            pre_tokenizer=meta.get("tokenizer.ggml.pre"),
            eot_token_id=meta.get("tokenizer.ggml.eot_token_id"),
            eom_token_id=meta.get("tokenizer.ggml.eom_token_id"),
            model=model,
            scores=meta.get("tokenizer.ggml.scores"),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            model_name=meta.get("general.name"),
        )

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. "<|im_start|>") become their
        single id. With `add_special_tokens`, BOS/EOS are added only where the GGUF asks for them
        (`tokenizer.ggml.add_bos_token` / `add_eos_token`; both false for SmolLM2).
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos and self._bos is not None:
                ids.insert(0, self._bos)
            if self._add_eos and self._eos is not None:
                ids.append(self._eos)
        return ids

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat template: special-token strings become their id, and BOS is prepended when the
        GGUF asks for it (`add_bos_token`) unless the text already starts with it. llama.cpp does the same: it
        removes a leading BOS text the template wrote and lets the tokenizer add one (common/chat.cpp), so a
        Llama 2 / Mistral template writing "<s>" gives one BOS, never two."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._add_bos and self._bos is not None and ids[:1] != [self._bos]:
            ids.insert(0, self._bos)
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` for many texts at once (parallel inside the `tokenizers` library)."""
        out = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        if add_special_tokens:
            for ids in out:
                if self._add_bos and self._bos is not None:
                    ids.insert(0, self._bos)
                if self._add_eos and self._eos is not None:
                    ids.append(self._eos)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 sequences (a split multi-byte character) become U+FFFD.

        Raises ValueError for an id outside `[0, vocab_size)`.
        """
        ids = list(ids)
        for i in ids:
            check_token_id(i, self._vocab_size)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes token `token_id` stands for (for incremental detokenization).

        A byte-level token maps back through GPT-2's byte/unicode table; a SentencePiece piece is its text with
        "▁" as a space and a `<0xNN>` byte token that byte (spm.spm_piece_bytes); special tokens give the
        UTF-8 of their text (e.g. b"<|im_end|>"). Raises ValueError for an id outside the vocabulary.
        """
        check_token_id(token_id, self._vocab_size)
        if self._spm:
            return spm_piece_bytes(self._tokens[token_id], self._types[token_id])
        return spelled_bytes(self._spelled[token_id])

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of `token_id` as stored in the GGUF (byte-level spelling, or the SentencePiece
        piece with "▁")."""
        return self._tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (byte-level spelling, or a special token's text), or None."""
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (skipped by `decode(..., skip_special_tokens=True)`)."""
        return token_id in self._special_ids

    # ------------------------------------------------------------------ properties
    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token from the GGUF (1 for SmolLM2)."""
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token from the GGUF (2, "<|im_end|>", for SmolLM2)."""
        return self._eos

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Ids that end a generation by default (llama.cpp's end-of-generation set: eos, eot, eom and the
        end markers it recognises by text, e.g. "<|eot_id|>", "<|im_end|>"; actors/text/eog.py)."""
        return self._eog

    @property
    def unk_token_id(self) -> int | None:
        """Id of the unknown token, if the GGUF names one."""
        return self._unk

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, if the GGUF names one."""
        return self._pad

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (for chat templates), or None."""
        return self._tokens[self._bos] if self._bos is not None else None

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token (for chat templates), or None."""
        return self._tokens[self._eos] if self._eos is not None else None

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS (from the GGUF)."""
        return self._add_bos

    @property
    def lead_space(self) -> str:
        """How a decoded stream's first token changes: "strip_space" (SentencePiece with a prefix space: the
        leading " " goes, as the decoder's `Strip`) or "keep" (actors/worker/engine/detokenizer.py)."""
        return "strip_space" if self._add_space_prefix else "keep"

    @property
    def model(self) -> str:
        """`tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece)."""
        return self._model

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the GGUF vocabulary (49152 for SmolLM2)."""
        return self._vocab_size

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template stored in the GGUF (`tokenizer.chat_template`), or None."""
        return self._chat_template

    @property
    def pre_tokenizer_name(self) -> str | None:
        """`tokenizer.ggml.pre` as stored in the GGUF (selects the pre-tokenizer: actors/text/pretokenizers.py)."""
        return self._pre

    @property
    def special_tokens(self) -> dict[str, int]:
        """Control tokens (GGUF token_type 3) as `{text: id}`; a copy."""
        return dict(self._special)

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (do not mutate)."""
        return self._tok

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"GGUFTokenizer(vocab_size={self._vocab_size}, pre={self._pre!r}, specials={len(self._special)})"
