"""SentencePiece vocabularies stored in a GGUF (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Phi-3).

llama.cpp tokenizes these files with its SPM tokenizer (`llm_tokenizer_spm_session`, src/llama-vocab.cpp):

1. the text gets a leading space when `tokenizer.ggml.add_space_prefix` is true (the default for this model type)
   and the text starts the input or follows a special or user-defined token; then every " " becomes "▁" (U+2581,
   `llama_escape_whitespace`);
2. the text is cut into UTF-8 characters; two neighbouring symbols whose concatenation is a vocabulary entry form a
   candidate, and the candidate whose entry has the highest `tokenizer.ggml.scores` value is merged first (ties:
   the leftmost), until no candidate is left;
3. a symbol that is no vocabulary entry becomes one `<0xNN>` byte token per UTF-8 byte (byte fallback).

That is BPE whose merges are every split `(a, b)` of every entry `a + b` into two entries, ranked by the score of
`a + b`, highest first: SentencePiece's own BPE encoder (google/sentencepiece, `bpe_model.cc`) works the same
way, and transformers rebuilds a Llama tokenizer's merges from the scores so (`generate_merges`,
transformers/tokenization_utils_base.py; ties between splits of one entry: the longer left piece first, which we
follow). :func:`spm_merges` builds that list and :func:`build_spm_backend` a `tokenizers.Tokenizer` around it
(BPE with `byte_fallback`; normalizer `Prepend("▁")` + `Replace(" ", "▁")`, as Llama 2's own tokenizer.json
has it; no pre-tokenizer, so merges may cross "▁" as llama.cpp's may; decoder `Replace("▁", " ")`,
`ByteFallback`, `Fuse`, `Strip(" ", 1, 0)`). The BPE form equals llama.cpp's tie rule (leftmost first) whenever
no two different merge results share a score, which holds for SentencePiece-trained files (score = minus the
merge order), and for runs of one repeated character whose tokens tie (the longer left piece first is then the
leftmost). :func:`tied_merge_scores` counts the ties: a few are logged, more than :data:`MAX_TIED_SHARE` of the merge
results (a converter's placeholder score on every token) are refused, since BPE cannot express llama.cpp's
leftmost-first order (on the test corpus such a file gives other ids for about half the strings).

`tests/unit/test_tokenizer_spm.py` checks this against a vocabulary trained at test time and against an
independent transcription of the bigram algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

__all__ = ["SPACE", "BYTE_TOKEN_TYPE", "MAX_TIED_SHARE", "build_spm_backend", "byte_token_value", "phi3_rstrip",
           "spm_merges", "spm_piece_bytes", "tied_merge_scores"]

SPACE = "\u2581"  # "▁": SentencePiece's visible space
BYTE_TOKEN_TYPE = 6  # GGUF token type BYTE (<0xNN>)
_CONTROL, _UNKNOWN, _USER_DEFINED = 3, 2, 4
MAX_TIED_SHARE = 0.1  # tied merge results a vocabulary may have (share of all merge results) before it is refused


def byte_token_value(piece: str) -> int | None:
    """The byte a `<0xNN>` piece stands for (two hex digits), else None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def spm_piece_bytes(piece: str, token_type: int) -> bytes:
    """Raw bytes of one SentencePiece vocabulary entry: a BYTE-type `<0xNN>` entry is that byte; any other entry
    is its text with "▁" read as a space, in UTF-8 (what llama.cpp's `token_to_piece` and the decoder above give)."""
    if token_type == BYTE_TOKEN_TYPE:
        value = byte_token_value(piece)
        if value is not None:
            return bytes([value])
    return piece.replace(SPACE, " ").encode("utf-8")


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split `(a, b)` of a vocabulary entry `a + b` into two entries, highest score of `a + b` first; for one
    entry, the longer `a` first. A text listed twice means its last id, as llama.cpp's `token_to_id`.
    O(sum of lengths)."""
    first = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for text, i in first.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in first and right in first:
                ranked.append((-float(scores[i]), -len(left), -len(right), left, right))
    ranked.sort(key=lambda r: r[:3])  # stable: equal keys keep vocabulary order
    return [(r[3], r[4]) for r in ranked]


def tied_merge_scores(tokens: Sequence[str], scores: Sequence[float],
                      merges: Sequence[tuple[str, str]]) -> tuple[int, int]:
    """`(merge results sharing their score with another, all merge results)`; 0 tied for SentencePiece-trained
    files."""
    first = {t: i for i, t in enumerate(tokens)}
    seen: dict[float, set[str]] = {}
    for a, b in merges:
        seen.setdefault(float(scores[first[a + b]]), set()).add(a + b)
    return sum(len(v) for v in seen.values() if len(v) > 1), sum(len(v) for v in seen.values())


def phi3_rstrip(model_name: str | None) -> bool:
    """Whether llama.cpp strips the whitespace after this file's special tokens: it does so, by `general.name`
    containing "phi-3" or "phi3" (any case), for every control, unknown and user-defined token but `<unk>`, `<s>`
    and `<|endoftext|>`, and for `</s>` (llama-vocab.cpp, "set attributes by model/tokenizer/architecture name";
    Phi-3's tokenizer.json has `rstrip` on those tokens)."""
    name = (model_name or "").lower()
    return "phi-3" in name or "phi3" in name


_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")


def build_spm_backend(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int], *,
                      add_space_prefix: bool, unk_token_id: int | None,
                      rstrip_specials: bool = False) -> tuple[Tokenizer, list[AddedToken], list[AddedToken],
                                                              tuple[int, int]]:
    """`(tokenizer, control tokens, user-defined tokens, (tied, all) merge results)` of a SentencePiece GGUF
    vocabulary.

    `tokens`/`scores`/`token_types`: `tokenizer.ggml.tokens` / `.scores` / `.token_type` (same length).
    Control (3) and unknown (2) entries become special added tokens and user-defined (4) entries plain added
    tokens, all matched whole in the raw text (llama.cpp partitions them out before tokenizing; the text after one
    gets the prefix space again, which the per-segment `Prepend` normalizer reproduces). `rstrip_specials`
    (:func:`phi3_rstrip`): those tokens but `<unk>`, `<s>`, `<|endoftext|>` eat the whitespace after them.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = spm_merges(tokens, scores)
    unk = tokens[unk_token_id] if unk_token_id is not None else None
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True, dropout=None)
    tok = Tokenizer(bpe)
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    def rstrip(t: str) -> bool:
        return rstrip_specials and t not in _NO_RSTRIP

    control = [AddedToken(t, normalized=False, special=True, rstrip=rstrip(t)) for t, ty in zip(tokens, token_types)
               if ty in (_CONTROL, _UNKNOWN) and vocab.get(t) is not None]
    user = [AddedToken(t, normalized=False, special=False, rstrip=rstrip(t)) for t, ty in zip(tokens, token_types)
            if ty == _USER_DEFINED and vocab.get(t) is not None]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok, control, user, tied_merge_scores(tokens, scores, merges)
