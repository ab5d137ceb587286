"""Pick the tokenizer of a model artifact: a GGUF file or a Hugging Face model directory.

:func:`load_tokenizer` returns a :class:`TextTokenizer` (both :class:`~actors.text.tokenizer.GGUFTokenizer` and
:class:`~actors.text.hf_tokenizer.HFTokenizer` have that interface).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from .hf_tokenizer import HFTokenizer
from .tokenizer import GGUFTokenizer, TokenizerError

__all__ = ["TextTokenizer", "TokenizerError", "load_tokenizer"]


@runtime_checkable
class TextTokenizer(Protocol):
    """What serving needs of a tokenizer, whatever file it came from."""

    @property
    def bos_token(self) -> str | None: ...
    @property
    def eos_token(self) -> str | None: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def eog_token_ids(self) -> frozenset[int]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def special_tokens(self) -> dict[str, int]: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def encode_chat(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...


def load_tokenizer(artifact: str | os.PathLike[str]) -> GGUFTokenizer | HFTokenizer:
    """The tokenizer of ``artifact``: a directory is an HF model directory (`tokenizer.json`, ...:
    HFTokenizer.from_dir); a file is read as a GGUF (GGUFTokenizer.from_gguf).

    Raises TokenizerError for an unsupported tokenizer (naming what is unsupported), ValueError for a file
    that is not a GGUF, OSError when the artifact cannot be read.
    """
    path = os.fspath(artifact)
    if os.path.isdir(path):
        return HFTokenizer.from_dir(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model artifact {path!r} does not exist")
    return GGUFTokenizer.from_gguf(path)

