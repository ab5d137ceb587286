"""The normalizer and pre-tokenizer a GGUF `gpt2` (byte-level BPE) vocabulary needs, by `tokenizer.ggml.pre`.

A GGUF names its pre-tokenizer (`tokenizer.ggml.pre`) instead of spelling it out. llama.cpp maps each name
to split regexes (ggml-org/llama.cpp, `src/llama-vocab.cpp`: the `tokenizer_pre == ...` chain in
`llama_vocab::impl::load` picks a `LLAMA_VOCAB_PRE_TYPE_*`, and `llm_tokenizer_bpe`'s constructor holds the
regexes of each type); Hugging Face transformers does the same in
`integrations/gguf/gguf_tokenizer_mapping.py` (`GGUF_PRE_TOKENIZER_SPLITS`). The reference we match is the
model's own `tokenizer.json`, which is how the vocabulary was trained and what `tokenizers` produces:

* ``gpt2`` family (`gpt-2`, `gpt2`, `default`, or no name): byte-level with GPT-2's built-in split regex
  (`ByteLevel(add_prefix_space=False, use_regex=True)`), as transformers loads any name it does not list.
  llama.cpp's `default` type adds splits of its own; files named `default` are old conversions whose real
  pre-tokenizer was unknown, and GPT-2's is the one their `tokenizer.json` most likely had.
* ``smollm``: every digit isolated, then GPT-2's byte-level split: SmolLM2's `tokenizer.json`
  (`Digits(individual_digits=true)` then `ByteLevel(use_regex=true)`) and llama.cpp's `SMOLLM` type
  (`\\p{N}` then the GPT-2 regex) agree. transformers' GGUF loader keeps GPT-2's only; the two differ only for
  a non-ASCII numeral after a space (" ٣").
* ``llama3`` family (`llama-bpe`, `llama3`, `llama-v3`, `falcon3`, `dbrx`, `smaug-bpe`): Meta Llama 3's split
  regex (its `tokenizer.json` Split pattern; llama.cpp's `LLAMA3` type; transformers' `_LLAMA3_SPLIT`), then
  byte-level without a regex.
* ``qwen2`` family (`qwen2`, `deepseek-r1-qwen`): Qwen2's split regex (digits one by one:
  `transformers/models/qwen2/tokenization_qwen2.py` `PRETOKENIZE_REGEX`; llama.cpp's `QWEN2` type), then
  byte-level without a regex, after Qwen2's NFC normalizer (Qwen2's `tokenizer.json`; transformers' GGUF
  loader and llama.cpp skip it, so they differ from the model's own tokenizer on text that is not NFC).

Any other name is refused with its name (:func:`gguf_pre_tokenizer` returns None; the caller raises).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, normalizers, pre_tokenizers

__all__ = ["LLAMA3_SPLIT", "QWEN2_SPLIT", "PRE_TOKENIZER_FAMILIES", "SUPPORTED_PRE_TOKENIZERS",
           "pre_tokenizer_family", "gguf_pre_tokenizer"]

# Meta Llama 3 `tokenizer.json` pre_tokenizer Split pattern (= llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3, whose
# `'[sS]|...` spells the same case-insensitive contractions). Numbers in runs of up to three digits.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 `tokenizer.json` Split pattern (= llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2): as Llama 3's, but every
# digit on its own.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# family -> the `tokenizer.ggml.pre` names that use it
PRE_TOKENIZER_FAMILIES: dict[str, tuple[str, ...]] = {
    "gpt2": ("gpt-2", "gpt2", "default"),
    "smollm": ("smollm",),
    "llama3": ("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"),
    "qwen2": ("qwen2", "deepseek-r1-qwen"),
}
_BY_NAME = {name: family for family, names in PRE_TOKENIZER_FAMILIES.items() for name in names}
SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_BY_NAME))


def pre_tokenizer_family(name: str | None) -> str | None:
    """The family ("gpt2", "smollm", "llama3", "qwen2") of a `tokenizer.ggml.pre` name; "gpt2" when the file
    names none; None for a name this module does not know."""
    if name is None or name == "":
        return "gpt2"
    return _BY_NAME.get(name)


def _split_then_bytes(pattern: str) -> Any:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def gguf_pre_tokenizer(name: str | None) -> tuple[Any, Any] | None:
    """`(normalizer or None, pre_tokenizer)` for the `tokenizer.ggml.pre` ``name`` (see the module docstring),
    or None when the name is unknown (the caller refuses the file naming it)."""
    family = pre_tokenizer_family(name)
    if family == "gpt2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "smollm":
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if family == "llama3":
        return None, _split_then_bytes(LLAMA3_SPLIT)
    if family == "qwen2":
        return normalizers.NFC(), _split_then_bytes(QWEN2_SPLIT)
    return None
