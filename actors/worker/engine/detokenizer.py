"""Incremental detokenization for byte-level BPE and SentencePiece vocabularies, and stop strings.

* ``token_bytes_table``: the raw bytes of every token.  GPT-2 byte-level BPE stores each byte as
  one printable unicode char (``bytes_to_unicode`` from OpenAI's GPT-2 ``encoder.py``); we map the
  chars back.  SentencePiece (GGUF ``tokenizer.ggml.model = "llama"``): "▁" is a space and a BYTE-type
  ``<0xNN>`` token is that byte (actors/text/spm.py).  Control tokens (GGUF token_type 3, and
  SentencePiece's unknown token, type 2) decode to b"" when special tokens are skipped.
* ``TokenBytes``: that table plus the decoder's rule for the first token of a stream (SentencePiece
  strips the prefix space it added: Llama 2's ``Strip`` decoder, llama.cpp's ``detokenize``).
* ``IncrementalDetokenizer``: accumulates bytes and emits the longest complete UTF-8 prefix, so a
  character split across tokens (emoji, CJK, byte-fallback tokens) is never emitted broken; at the end of
  a stream an incomplete tail is dropped (never replaced by U+FFFD). Invalid bytes before it become U+FFFD.
* ``StopStringMatcher``: holds back text that may be the start of a stop string; truncates before
  a completed stop string.
"""

from __future__ import annotations

from functools import lru_cache

TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_BYTE = 6
SPM_SPACE = "\u2581"  # SentencePiece's visible space "▁"
LEAD_RULES = ("keep", "strip_space", "drop_spaces")


class TokenBytes(list):
    """``list[bytes]``: the bytes of every token id, plus ``lead``, how the first token of a stream that gives any
    bytes is changed, as the tokenizer's one-shot decode changes it:

    * "keep": unchanged (byte-level BPE);
    * "strip_space": one leading space removed (SentencePiece with a prefix space: Llama 2's tokenizer.json decoder
      ``Strip(" ", 1, 0)`` after ``Fuse``; a GGUF with ``tokenizer.ggml.add_space_prefix``);
    * "drop_spaces": every space of that token removed unless it is one of ``keep_ids`` (the ``Metaspace`` decoder
      of `tokenizers` drops every "▁" of the first token; its spaces that are no "▁", a ``<0x20>`` byte token or
      an added token's literal space, stay).

    Raises ValueError for another ``lead``."""

    def __init__(self, items=(), lead: str = "keep", keep_ids=()) -> None:
        super().__init__(items)
        if lead not in LEAD_RULES:
            raise ValueError(f"unknown first-token rule {lead!r}; known: {', '.join(LEAD_RULES)}")
        self.lead = lead
        self.keep_ids = frozenset(keep_ids)

    def first_bytes(self, token_id: int) -> bytes:
        """Bytes of ``token_id`` when it is the first token of a stream to give any bytes."""
        b = self[token_id]
        if self.lead == "strip_space":
            return b[1:] if b[:1] == b" " else b
        if self.lead == "drop_spaces" and token_id not in self.keep_ids:
            return b.replace(b" ", b"")
        return b


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of ``bytes_to_unicode``."""
    return {c: b for b, c in bytes_to_unicode().items()}


def token_to_bytes(token: str, token_type: int, skip_special: bool = True, spm: bool = False) -> bytes:
    """Raw bytes of one vocabulary entry (see module docstring); ``spm``: a SentencePiece vocabulary."""
    if token_type == TOKEN_TYPE_CONTROL or (spm and token_type == TOKEN_TYPE_UNKNOWN):
        return b"" if skip_special else token.encode("utf-8")
    if token_type == TOKEN_TYPE_BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    if spm:
        return token.replace(SPM_SPACE, " ").encode("utf-8")
    u2b = unicode_to_bytes()
    if all(c in u2b for c in token):
        return bytes(u2b[c] for c in token)
    return token.encode("utf-8")  # added tokens stored as plain text


def token_bytes_table(tokens: list[str], token_types: list[int] | None, skip_special: bool = True,
                      model: str | None = None, add_space_prefix: bool = True) -> TokenBytes:
    """Bytes of every token id; ``token_types`` None means all normal. ``model``: the GGUF's
    ``tokenizer.ggml.model`` ("llama": SentencePiece, whose stream drops its prefix space when
    ``add_space_prefix``, llama.cpp's default; anything else: byte-level)."""
    types = token_types or [1] * len(tokens)
    spm = model == "llama"
    table = [token_to_bytes(t, tt, skip_special, spm) for t, tt in zip(tokens, types)]
    return TokenBytes(table, "strip_space" if spm and add_space_prefix else "keep")


def load_token_bytes(gguf_path: str, skip_special: bool = True, reader=None) -> TokenBytes:
    """Read ``tokenizer.ggml.tokens``/``token_type``/``model``/``add_space_prefix`` from a GGUF file (or its open
    ``gguf.GGUFReader`` ``reader``) and build the bytes table."""
    import gguf

    reader = reader if reader is not None else gguf.GGUFReader(gguf_path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields.get("tokenizer.ggml.token_type")
    model = reader.fields.get("tokenizer.ggml.model")
    prefix = reader.fields.get("tokenizer.ggml.add_space_prefix")
    return token_bytes_table(tokens, types.contents() if types else None, skip_special,
                             model.contents() if model else None, bool(prefix.contents()) if prefix else True)


def complete_utf8_prefix_len(buf: bytes) -> int:
    """Length of ``buf`` without a trailing incomplete (but still possibly valid) UTF-8 sequence."""
    for k in range(1, min(3, len(buf)) + 1):
        b = buf[-k]
        if b & 0xC0 == 0x80:  # continuation byte: look further back for the lead byte
            continue
        need = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 1
        return len(buf) - k if need > k else len(buf)
    return len(buf)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of valid text deltas."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        """``token_bytes``: id -> bytes; a ``TokenBytes`` also brings its first-token rule."""
        self.token_bytes = token_bytes
        self._pending = b""
        self._lead = isinstance(token_bytes, TokenBytes) and token_bytes.lead != "keep"  # first token not seen yet

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return newly complete text (invalid bytes become U+FFFD)."""
        table, n = self.token_bytes, len(self.token_bytes)
        parts = []
        for t in token_ids:
            if 0 <= t < n and table[t]:
                if self._lead:
                    self._lead = False
                    parts.append(table.first_bytes(t))
                else:
                    parts.append(table[t])
        self._pending += b"".join(parts)
        cut = complete_utf8_prefix_len(self._pending)
        text, self._pending = self._pending[:cut].decode("utf-8", errors="replace"), self._pending[cut:]
        return text

    def flush(self) -> str:
        """End of stream: return the complete text still pending and drop an incomplete trailing UTF-8
        sequence (a character cut by max_tokens / a stop is never emitted, as mid-stream; never U+FFFD)."""
        cut = complete_utf8_prefix_len(self._pending)
        text, self._pending = self._pending[:cut].decode("utf-8", errors="replace"), b""
        return text


class StopStringMatcher:
    """Filters a text stream: truncates at the first stop string, holds back possible prefixes."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return text safe to emit.  Sets ``stopped`` when a stop string completes."""
        if self.stopped:
            return ""
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = self._partial_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Release held text at the end of a stream (no stop string completed)."""
        text, self._held = ("" if self.stopped else self._held), ""
        return text

    def _partial_len(self, text: str) -> int:
        """Longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def replay(detok: IncrementalDetokenizer, stop: StopStringMatcher, token_ids) -> list[str]:
    """Bring a fresh detokenizer and stop matcher to the state they had after ``token_ids`` (a migrated
    sequence's tokens generated so far, fed one per step as the engine fed them) and return the text each
    token released then (already sent by the previous worker: for re-deriving state, never to re-send)."""
    return [stop.feed(detok.add_tokens([t])) for t in token_ids]
