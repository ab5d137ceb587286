"""SentencePiece-style vocabularies trained at test time with `tokenizers`, saved as an HF directory and a GGUF.

The reference is a `tokenizers.Tokenizer` laid out as Llama 2's own tokenizer.json (spelled here, independently of
actors/text/spm.py): BPE with byte fallback and `<unk>` fused, normalizer `Prepend("▁")` + `Replace(" ", "▁")`, no
pre-tokenizer, decoder `Replace("▁", " ")`, `ByteFallback`, `Fuse`, `Strip(" ", 1, 0)`, `<s>` added by the
post-processor. Its pieces are learned by `BpeTrainer` on tests/tokenizer_fixtures.py's training text (words split
after "▁" while training, as SentencePiece's `split_by_whitespace`), with a small alphabet so that byte fallback
happens; the vocabulary is laid out as Llama 2's: `<unk>`, `<s>`, `</s>`, the 256 `<0xNN>` byte tokens, then the
merged pieces in merge order, then the single characters.

The GGUF is what llama.cpp's converter writes for such a model (`_set_vocab_sentencepiece`): `tokenizer.ggml.model =
"llama"`, `pre = "default"`, tokens, scores (minus the merge order, as SentencePiece's BPE trainer scores pieces; the
characters below every merge; special and byte tokens 0), token types (NORMAL 1, UNKNOWN 2, CONTROL 3,
USER_DEFINED 4, BYTE 6), bos/eos/unk ids, `add_bos_token`, `add_space_prefix`, and no merges.

A second HF directory holds the same vocabulary with `Metaspace` pre-tokenizer and decoder (what
`tokenizers.implementations.SentencePieceBPETokenizer` writes) plus byte fallback, for the streaming test of the
other decoder style.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.tokenizer_fixtures import _training_text, reference_corpus

SPACE = "\u2581"
SPECIALS = ("<unk>", "<s>", "</s>")
USER_DEFINED = ("<tool>",)  # a plain added token (GGUF USER_DEFINED)
BYTES = tuple(f"<0x{b:02X}>" for b in range(256))


@dataclass(frozen=True)
class SpmFixture:
    reference: Tokenizer  # Llama 2 layout (Prepend normalizer, Strip decoder)
    metaspace: Tokenizer  # same vocabulary, Metaspace pre-tokenizer and decoder
    hf_dir: str
    metaspace_dir: str
    gguf_path: str
    tokens: list[str]
    scores: list[float]
    token_types: list[int]


def corpus() -> list[str]:
    """The fixed corpus of [20] (>= 200 strings), with this vocabulary's special and added tokens in some of them."""
    base = [t for t in reference_corpus("gpt2") if "<|" not in t]
    extra = ["<s>hello</s>", "<s> spaced </s>", "text <s> and </s> after", "<s>\n</s>\n\n", "near miss <s and /s>",
             "<unk> literal", "<tool>call</tool> <tool> x", "a<tool>b", " <s>", "</s></s>", "<s>[INST] hi [/INST]"]
    return list(dict.fromkeys(base + extra))


@lru_cache(maxsize=None)
def _pieces() -> tuple[tuple[str, ...], tuple[float, ...], tuple[tuple[str, str], ...]]:
    """(pieces, scores, merges) learned by BpeTrainer: merged pieces in merge order, then the remaining characters;
    scores minus the position; the trainer's merges as pairs."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = pre_tokenizers.Split(SPACE, behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=1100, min_frequency=2, show_progress=False, special_tokens=list(SPECIALS),
                                  limit_alphabet=120)
    tok.train_from_iterator(_training_text(), trainer)
    spec = json.loads(tok.to_str())
    merges = tuple(tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in spec["model"]["merges"])
    merged = list(dict.fromkeys(a + b for a, b in merges))
    chars = [t for t in spec["model"]["vocab"] if t not in SPECIALS and t not in set(merged)]
    pieces = merged + chars
    return tuple(pieces), tuple(-float(i) for i in range(len(pieces))), merges


def _reference(tokens: list[str], merges: list[tuple[str, str]], metaspace: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement=SPACE,
                                                                                     prepend_scheme="always")])
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in USER_DEFINED])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def write_spm_gguf(path: str, tokens: list[str], scores: list[float], types: list[int], *, add_bos: bool | None = True,
                   add_space_prefix: bool | None = True, extra: dict | None = None, model: bool = False,
                   add_eos: bool = False) -> None:
    """A GGUF with SentencePiece tokenizer metadata as llama.cpp's converter lays it out; no tensors, or with
    ``model`` a tiny random Llama over this vocabulary (bench/tiny_model.py's shapes and weights)."""
    import gguf
    import numpy as np

    from bench.tiny_model import _add_metadata, _tensors

    w = gguf.GGUFWriter(path, "llama")
    if model:
        _add_metadata(w, 2, 64, 4, 2, 128, len(tokens), 512)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_unk_token_id(tokens.index("<unk>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, arr in (_tensors(np.random.default_rng(0), 2, 64, 4, 2, 128, len(tokens)) if model else {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_spm(root: str) -> SpmFixture:
    """Train (once per process) the vocabulary and write its two HF directories and its GGUF under ``root``."""
    pieces, piece_scores, merges = _pieces()
    tokens = list(SPECIALS) + list(BYTES) + list(pieces) + list(USER_DEFINED)
    scores = [0.0] * (len(SPECIALS) + 256) + list(piece_scores) + [0.0] * len(USER_DEFINED)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4] * len(USER_DEFINED)
    assert len(merges) > 100
    ref, meta = _reference(tokens, list(merges), False), _reference(tokens, list(merges), True)
    dirs = []
    for name, tok in (("spm-hf", ref), ("spm-metaspace", meta)):
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
            json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, fh)
        dirs.append(d)
    gguf_path = os.path.join(root, "spm.gguf")
    write_spm_gguf(gguf_path, tokens, scores, types)
    return SpmFixture(ref, meta, dirs[0], dirs[1], gguf_path, tokens, scores, types)
