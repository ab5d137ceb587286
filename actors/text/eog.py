"""End-of-generation token ids: the tokens that end a generation by default, from a GGUF or an HF directory.

GGUF (:func:`gguf_eog_ids`) -- llama.cpp's rule (ggml-org/llama.cpp, `src/llama-vocab.cpp`, "maintain a list
of tokens that cause end-of-generation", ref. llama.cpp issue #9606): the FIM pad / repo / file-separator
tokens, every token whose *text* is a known end marker, then `tokenizer.ggml.eos_token_id`,
`eot_token_id` and `eom_token_id`; when both "<|return|>" and "<|call|>" are there (gpt-oss's harmony
format), "<|end|>" is not one (it ends a message, not the generation).

HF directory (:func:`hf_eog_ids`) -- what transformers' `generate` stops on: `generation_config.json`
`eos_token_id` (an int or a list), else `tokenizer_config.json`'s `eos_token`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["EOG_TOKEN_TEXTS", "FIM_EOG_TOKEN_TEXTS", "gguf_eog_ids", "hf_eog_ids", "token_text"]

# Token texts llama.cpp's vocab loader treats as end of generation (llama-vocab.cpp, the list after
# "maintain a list of tokens that cause end-of-generation").
EOG_TOKEN_TEXTS: tuple[str, ...] = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)
# FIM pad / repo-name / file-separator texts llama.cpp detects by name (same function, "find FIM_PAD / FIM_REP
# / FIM_SEP token") and then puts in the end-of-generation set.
FIM_EOG_TOKEN_TEXTS: tuple[str, ...] = (
    "<|fim_pad|>", "<fim-pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
    "<|file_sep|>",
)


def gguf_eog_ids(tokens: list[str], meta: Mapping[str, Any]) -> frozenset[int]:
    """End-of-generation ids of a GGUF vocabulary ``tokens`` with metadata ``meta`` (GGUF keys; see the
    module docstring). Ids outside the vocabulary are ignored."""
    n = len(tokens)
    by_text: dict[str, int] = {}
    for i, t in enumerate(tokens):
        by_text.setdefault(t, i)
    ids: set[int] = set()
    for text in (*FIM_EOG_TOKEN_TEXTS, *EOG_TOKEN_TEXTS):
        if text in by_text:
            ids.add(by_text[text])
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
            ids.add(v)
    if "<|return|>" in by_text and "<|call|>" in by_text and "<|end|>" in by_text:
        ids.discard(by_text["<|end|>"])
    return frozenset(ids)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string, or `{"content": ...}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def hf_eog_ids(model_dir: str | os.PathLike[str], token_to_id: Callable[[str], int | None]) -> frozenset[int]:
    """End-of-generation ids of the HF model directory ``model_dir``: `generation_config.json`'s
    `eos_token_id` (int or list of ints), else the id (by ``token_to_id``) of `tokenizer_config.json`'s
    `eos_token`; empty when neither is there. ValueError for a malformed `eos_token_id`."""
    gen = _read_json(os.path.join(model_dir, "generation_config.json"))
    eos = gen.get("eos_token_id")
    if eos is not None:
        values = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ValueError(f"generation_config.json eos_token_id must be an id or a list of ids, got {eos!r}")
        return frozenset(values)
    text = token_text(_read_json(os.path.join(model_dir, "tokenizer_config.json")).get("eos_token"))
    tid = token_to_id(text) if text is not None else None
    return frozenset() if tid is None else frozenset({tid})
