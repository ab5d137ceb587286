"""Byte-level BPE vocabularies trained at test time with `tokenizers`, saved as an HF directory and a GGUF.

Each family's normalizer and pre-tokenizer are spelled here as the models' own `tokenizer.json` files spell
them (Meta Llama 3, Qwen2, GPT-2, SmolLM2), independently of actors/text/pretokenizers.py, so that the
tokenizer under test is compared against a reference it does not share code with.

:func:`build` returns a :class:`Fixture`: the reference `tokenizers.Tokenizer`, the HF directory
(`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) and the GGUF path (vocabulary,
merges, token types, special ids, `tokenizer.ggml.pre`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Meta-Llama-3-8B tokenizer.json, pre_tokenizer.pretokenizers[0].pattern.Regex
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2-7B-Instruct tokenizer.json, pre_tokenizer.pretokenizers[0].pattern.Regex
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(pattern: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                             use_regex=False)])


@dataclass(frozen=True)
class Family:
    gguf_pre: str  # tokenizer.ggml.pre
    specials: tuple[str, ...]  # special added tokens (GGUF token_type 3)
    plain_added: tuple[str, ...]  # non-special added tokens (GGUF token_type 4)
    bos: str | None
    eos: str
    eot: str | None = None
    eom: str | None = None
    add_bos: bool = False
    generation_eos: tuple[str, ...] = ()  # generation_config.json eos_token_id


FAMILIES: dict[str, Family] = {
    "llama3": Family("llama-bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), (),
                     bos="<|begin_of_text|>", eos="<|end_of_text|>", eot="<|eot_id|>", eom="<|eom_id|>",
                     add_bos=True, generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "qwen2": Family("qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<think>", "</think>"),
                    bos=None, eos="<|im_end|>", generation_eos=("<|im_end|>", "<|endoftext|>")),
    "gpt2": Family("gpt-2", ("<|endoftext|>",), (), bos="<|endoftext|>", eos="<|endoftext|>"),
    "smollm": Family("smollm", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), (), bos="<|im_start|>",
                     eos="<|im_end|>"),
}


def reference_pipeline(family: str):
    """`(normalizer or None, pre_tokenizer)` as the family's model tokenizer.json has them."""
    if family == "llama3":
        return None, _split(_LLAMA3)
    if family == "qwen2":
        return normalizers.NFC(), _split(_QWEN2)
    if family == "gpt2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if family == "smollm":
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    raise KeyError(family)


# ------------------------------------------------------------------ the corpus (>= 200 strings)
_MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.", "Le cœur a ses raisons que la raison ne connaît point.",
    "Größenwahn ist keine Lösung, Straße und Fuß.", "¿Dónde está la biblioteca? ¡Ahí está!",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.", "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "مرحبا بالعالم، كيف حالك اليوم؟", "שלום עולם, מה שלומך?", "नमस्ते दुनिया, आप कैसे हैं?",
    "আমি বাংলায় গান গাই।", "สวัสดีชาวโลก ยินดีต้อนรับ", "你好，世界。今天天气很好！", "日本語のテキストとカタカナ、ひらがな。",
    "안녕하세요 세계, 반갑습니다.", "Tiếng Việt có dấu: Người ơi, người ở đừng về.", "Şu çılgın Türk ığdır'a gitti.",
    "Zażółć gęślą jaźń.", "Гей, ґаздо, їжак їсть ябко.", "Habari ya dunia, karibu sana.", "ሰላም ለዓለም",
    "გამარჯობა მსოფლიო", "Բարեւ աշխարհ", "வணக்கம் உலகம்", "Ωmega ≠ omega; ∑∫∂ √2 ≈ 1.414",
    "mixed 中文 and English 和 日本語 together", "Ünïcödé\u00a0nbsp\u200bzwsp — dash… «quotes» “curly” ‘single’",
]
_EMOJI = [
    "👍", "👍🏽 thumbs", "family 👨‍👩‍👧‍👦 emoji", "flags 🇫🇷🇯🇵🇺🇸", "keycap 1️⃣ 2️⃣ #️⃣", "heart ❤️ vs ❤",
    "🎉🎉🎉 party", "🏳️‍🌈 rainbow", "🧑🏿‍💻 coder", "emoji😀inside😃words", "👩‍❤️‍💋‍👨", "🐍 python 🦀 rust",
    "smile :) :-( ;P ^_^ ¯\\_(ツ)_/¯", "🤖🤖 🤖   🤖", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝟙𝟚𝟛",
]
_CODE = [
    "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(x)]  # squares\n    else:\n        return None\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }", "const add = (a, b) => a + b;\nexport default add;",
    "fn main() {\n    println!(\"Hello, {}!\", name);\n}", "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<div class=\"x\"><span>hi</span></div>", "#!/bin/bash\nset -euo pipefail\necho \"$HOME\" | grep -E '^/h'",
    "^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@example\\.com$", "--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n-old\n+new\n",
    "    indented    with    spaces", "x=1;y=2;z=x+y*3/4%5", "arr[0][1]->field.method()?.chain!!",
    "import numpy as np\nnp.zeros((3, 4), dtype=np.float32)", "if __name__ == '__main__':\n    main()",
    "/* comment */ // line comment\n# hash comment", "s = f'{value!r:>10}'", "λx.λy.x y ≡ K",
    "https://example.com/path?q=1&r=two#frag", "user.name+tag@example.co.uk",
]
_WHITESPACE = [
    "a  b", "a   b", "a\tb", "a\t\tb", "a\nb", "a\n\nb", "a\n\n\nb", "a \n b", "a\r\nb\r\n", "   leading",
    "trailing   ", "  both  ", " ", "  ", "    ", "\n", "\n\n", "\t", " \t \n ", "word\u3000ideographic space",
    "x\u00a0\u00a0y", "end with newline\n", "line1\nline2\n\n  line4", "tabs\t\t\tand  spaces  \t mix",
    "\n\n\n\n\n", "a" + " " * 17 + "b",
]
_NUMBERS = [
    "1234567890", "3.14159265", "1,000,000", "12 345 6.78e9", "x12 y345 z6789", "\u0663\u0664\u0665 arabic-indic",
    " \u0663", "①②③ circled", "Ⅻ roman", "0x1F 0b1010 0o777", "2024-12-06T02:26:53Z", "1e-9 -42 +7",
    "phone: +1 (555) 123-4567", "99.9% of 100", "v1.2.3-rc.4", "١٢٣٤٥", "½ ¾ ⅓",
]
_CASES = [
    "I'll we've they're DON'T", "I'LL WE'VE THEY'RE", "it’s curly", "'s 't 're 've 'm 'll 'd",
    "'S 'T 'RE 'VE 'M 'LL 'D", "rock'n'roll", "o'clock", "CamelCaseWordsHere", "snake_case_words_here",
    "ALLCAPS SENTENCE HERE.", "McDonald's O'Neil",
]
_NON_NFC = ["e\u0301te\u0301", "A\u030angstrom", "\u1100\u1161\u11a8 jamo", "ﬁne ligature", "Å vs Å", "n\u0303"]
_MISC = [
    "", "a", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "ab" * 40, "...!!!???", "---===+++",
    "**bold** _italic_ `code` [link](url)", "| a | b |\n|---|---|\n| 1 | 2 |", "∀x∈ℝ: x² ≥ 0",
    "\u202eright-to-left override", "zero\u200dwidth\u200cjoiners", "\ufeffBOM at start", "tab\u000bvertical",
    "control \x01\x02\x7f chars", "surrogate-free 𐍈 gothic", "private \ue000 use",
]


def _specials_text(fam: Family) -> list[str]:
    sp = list(fam.specials) + list(fam.plain_added)
    out = [f"{sp[0]}hello{sp[-1]}", " ".join(sp), "".join(sp), f"text before {sp[0]} and after",
           f"{sp[0]}\n{sp[-1]}\n\n", f"near miss {sp[0][:-1]} and {sp[0][1:]}"]
    out += [f"{s}x {s} {s}\n" for s in sp]
    out += ["<|im_start|>user\nhello<|im_end|>\n", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
            "<think>\nreasoning\n</think>\n\nanswer", "<|endoftext|><|endoftext|>"]
    return out


def reference_corpus(family: str) -> list[str]:
    """At least 200 strings: multilingual, emoji, code, whitespace runs, numbers, case, non-NFC, special tokens
    of ``family``; each base string also with a leading space and with a trailing newline."""
    base = (_MULTILINGUAL + _EMOJI + _CODE + _WHITESPACE + _NUMBERS + _CASES + _NON_NFC + _MISC
            + _specials_text(FAMILIES[family]))
    out = list(base) + [" " + s for s in base] + [s + "\n" for s in base]
    return list(dict.fromkeys(out))


def _training_text() -> list[str]:
    base = _MULTILINGUAL + _EMOJI + _CODE + _WHITESPACE + _NUMBERS + _CASES + _MISC
    extra = ["the of and to in is was for on that with as by at from his her they this have not are but",
             "It's 5 o'clock, isn't it? They'll say we've done 12345 things in 2024 and 678 more in 2025.",
             "numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 100 101 999 1000 2048 4096 65536 123456789"]
    return (base + extra) * 3


# ------------------------------------------------------------------ building
@dataclass(frozen=True)
class Fixture:
    family: str
    reference: Tokenizer
    hf_dir: str
    gguf_path: str
    tokens: list[str]
    token_types: list[int]


def _train(family: str) -> Tokenizer:
    fam = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    normalizer, pre = reference_pipeline(family)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in fam.specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    if fam.plain_added:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in fam.plain_added])
    if fam.add_bos:
        bos = tok.token_to_id(fam.bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{fam.bos} $A", pair=f"{fam.bos} $A {fam.bos} $B",
                                                           special_tokens=[(fam.bos, bos)])
    return tok


def write_gguf(path: str, tokens: list[str], types: list[int], merges: list[str], pre: str | None,
               ids: dict[str, int | None], add_bos: bool = False, chat_template: str | None = None) -> None:
    """A GGUF with only tokenizer metadata (no tensors)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for name, tid in ids.items():
        if tid is not None:
            getattr(w, f"add_{name}_token_id")(tid)
    w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _merges(spec: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]


@lru_cache(maxsize=None)
def _trained(family: str) -> Tokenizer:
    return _train(family)


def build(family: str, root: str, chat_template: str | None = None) -> Fixture:
    """Train (once per process) ``family``'s vocabulary and write its HF directory and GGUF under ``root``."""
    fam = FAMILIES[family]
    tok = _trained(family)
    hf_dir = os.path.join(root, f"{family}-hf")
    os.makedirs(hf_dir, exist_ok=True)
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    config: dict = {"bos_token": fam.bos, "eos_token": fam.eos}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    if fam.generation_eos:
        with open(os.path.join(hf_dir, "generation_config.json"), "w", encoding="utf-8") as fh:
            json.dump({"eos_token_id": [tok.token_to_id(t) for t in fam.generation_eos]}, fh)
    spec = json.loads(tok.to_str())
    n = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(n)]
    added = tok.get_added_tokens_decoder()
    types = [(3 if added[i].special else 4) if i in added else 1 for i in range(n)]
    ids = {"bos": tok.token_to_id(fam.bos) if fam.bos else None, "eos": tok.token_to_id(fam.eos),
           "eot": tok.token_to_id(fam.eot) if fam.eot else None, "eom": tok.token_to_id(fam.eom) if fam.eom else None}
    gguf_path = os.path.join(root, f"{family}.gguf")
    write_gguf(gguf_path, tokens, types, _merges(spec), fam.gguf_pre, ids, fam.add_bos, chat_template)
    return Fixture(family, Tokenizer.from_str(tok.to_str()), hf_dir, gguf_path, tokens, types)


def streamed_detokenize(table, ids: list[int], rng) -> str:
    """Feed ``ids`` to the engine's IncrementalDetokenizer over ``table`` (its token bytes) in random chunks of 1-3
    tokens (``rng``: a random.Random) and join what it releases, the final flush included."""
    from actors.worker.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(table)
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        out.append(detok.add_tokens(ids[i:i + k]))
        i += k
    out.append(detok.flush())
    return "".join(out)
