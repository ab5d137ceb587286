"""A tiny reasoning model whose greedy output is forced by its weights (issue [21] item 4 tests).

``build(folder)`` writes a Hugging Face directory (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json, chat_template.jinja) of a 2-layer Llama whose next token depends
on the current token only, through a chain of forced successors:

    "\\n" -> <think> -> w -> a -> i -> t -> </think> -> "\\n\\n" -> o -> k -> <|im_end|>

How: every layer's output projections (``o_proj``, ``down_proj``) are zero, so the residual stream at the
last position is the current token's embedding; the untied head's row of each successor is that
token's embedding direction, scaled (its logit is ~64 where the other chain rows give |N(0, 8)| and
the rest ~N(0, 0.4)). The forced sequence is checked against transformers' own greedy decoding
(tests/unit/test_reasoning.py), never against the engine.

The vocabulary is bench/tiny_model.py's byte-level BPE plus a ``"\\n\\n"`` merge and ``<think>`` /
``</think>`` as added, non-special tokens (as in Qwen3 and DeepSeek-R1: they decode to text). The chat
template ``TEMPLATE`` is ChatML whose generation prompt opens the thinking (``<think>``, as DeepSeek-R1 and
Qwen3-Thinking-2507 do) or, with ``enable_thinking`` false, writes the closed empty block Qwen3 writes
(``<think>\\n\\n</think>\\n\\n``) instead of that preamble: the output then starts at ``o``. ``QWEN3_TEMPLATE``
is Qwen3's hybrid generation prompt (``<|im_start|>assistant\\n``, the closed block when ``enable_thinking`` is
false): the model then opens the thinking itself (``\\n`` -> ``<think>``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
            "{% else %}<think>{% endif %}{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")
CHAIN = ("Ċ", "<think>", "w", "a", "i", "t", "</think>", "ĊĊ", "o", "k", "<|im_end|>")  # vocabulary spellings
REASONING, ANSWER = "wait", "ok"
REASONING_TOKENS = 5  # w a i t </think> (the prompt holds <think>)


def write_tokenizer(folder: Path) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json + chat_template.jinja in ``folder``; returns {spelling: id}."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from bench.tiny_model import MERGES, SPECIAL_TOKENS, tiny_vocab

    tokens = tiny_vocab()[0] + ["ĊĊ"]
    merges = [tuple(m.split(" ")) for m in MERGES] + [("Ċ", "Ċ")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return tok.get_vocab(with_added_tokens=True)


def hf_model(vocab: dict[str, int], seed: int = 0):
    """The transformers Llama (float32, eval) with the forced chain (module docstring)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=max(vocab.values()) + 1, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=vocab["<|im_end|>"],
                                   pad_token_id=0, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        emb = torch.randn(model.model.embed_tokens.weight.shape, generator=g)
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.randn(model.lm_head.weight.shape, generator=g) * 0.05
        ids = [vocab[t] for t in CHAIN]
        for cur, nxt in zip(ids, ids[1:]):
            head[nxt] = 8.0 * emb[cur] / emb[cur].norm()
        model.lm_head.weight.copy_(head)
    return model


def build(folder: str | Path, seed: int = 0) -> dict:
    """Save the model directory under ``folder``/reasoner: {"model", "dir", "vocab"}."""
    out = Path(folder) / "reasoner"
    vocab = write_tokenizer(out)
    model = hf_model(vocab, seed)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    return {"model": model, "dir": str(out), "vocab": vocab}
