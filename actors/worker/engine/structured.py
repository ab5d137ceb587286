"""Constrained (structured) decoding for ``LLMEngine`` with llguidance (Moskal et al., guidance-ai/llguidance).

* ``Structured``: one per engine.  Builds the llguidance ``LLTokenizer`` from the engine's own token table
  (lazily, on the first grammar: engines that never see a grammar pay nothing), keeps a bounded LRU cache of
  compiled grammars and computes the allowed-token masks of a step's constrained rows on llguidance's
  ``LLExecutor`` in a background thread, so they overlap the forward pass (llguidance drops the GIL).
* ``GrammarState``: one per constrained request: an ``LLMatcher`` advanced by every sampled token.

Grammar text (``SamplingParams.grammar``) is whatever ``llguidance.LLMatcher`` accepts: a JSON
"TopLevelGrammar" (``{"grammars": [{"json_schema": {...}}]}`` / ``[{"lark_grammar": "..."}]``) or Lark text.

Reuse of compiled grammars: ``LLMatcher(tokenizer, grammar)`` compiles the grammar (parse, lexer setup);
``LLMatcher.deep_copy()`` clones a matcher sharing the compiled grammar (measured ~5 us against ~0.5-1 ms for
a small JSON schema and far more for big ones).  The cache keeps one pristine matcher per grammar text and
hands out deep copies.

Special tokens (GGUF token_type 3, which the detokenizer table maps to b"") are given to llguidance as
b"\\xff" + name (llguidance's convention), so Lark grammars may name them (``<|im_end|>``) and they never
match text.  Token ids in ``[len(token table), V)`` (vocabulary padding of the logits) are always masked out.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

CACHE_SIZE = 64  # compiled grammars kept (LRU)
_CONTROL = 3  # GGUF token_type of control tokens


def special_token_names(gguf_path: str, reader=None) -> dict[int, str]:
    """{id: name} of the control tokens (GGUF ``tokenizer.ggml.token_type`` == 3) of a GGUF file (or of its
    open ``gguf.GGUFReader`` ``reader``)."""
    import gguf

    reader = reader if reader is not None else gguf.GGUFReader(gguf_path)
    types = reader.fields.get("tokenizer.ggml.token_type")
    if types is None:
        return {}
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {i: bytes(tokens.parts[tokens.data[i]]).decode("utf-8", "replace")
            for i, t in enumerate(types.contents()) if t == _CONTROL}


class _Vocab:
    """The ``TokenizerWrapper`` duck type llguidance wants: token bytes, eos/bos ids and an encoder.

    The encoder (used by llguidance only for prompt-side helpers such as ``tokenize_str``, never by
    the matcher's masks) is llguidance's own greedy tokenizer over the same table, bound after creation.
    """

    def __init__(self, tokens: list[bytes], eos: int, special: list[int]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id, self.special_token_ids = tokens, eos, None, special
        self.lltok = None

    def __call__(self, s: bytes | str) -> list[int]:
        return self.lltok.greedy_tokenize(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)


def build_tokenizer(token_bytes: list[bytes], special: dict[int, str], eos_ids: tuple[int, ...]):
    """``llguidance.LLTokenizer`` over ``token_bytes`` (id -> raw bytes, b"" for control tokens) with
    control tokens named b"\\xff<name>" and EOS = ``eos_ids`` (the first is the primary one)."""
    import llguidance

    tokens = list(token_bytes)
    for i, name in special.items():
        if i < len(tokens):
            tokens[i] = b"\xff" + name.encode("utf-8")
    for i, t in enumerate(tokens):  # a nameless empty token would be invalid for the trie
        if t == b"":
            tokens[i] = b"\xff<|unnamed_%d|>" % i
    vocab = _Vocab(tokens, eos_ids[0], sorted(i for i, t in enumerate(tokens) if t.startswith(b"\xff")))
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=len(tokens), eos_token=list(eos_ids))
    vocab.lltok = tok
    return tok


class GrammarState:
    """Matcher state of one constrained request (not thread-safe; the engine thread owns it except while
    its mask is being computed in ``MaskJob``)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def consume(self, token: int) -> bool:
        """Advance by the sampled ``token``; False when the token was not allowed (matcher in error)."""
        return bool(self.matcher.consume_token(int(token)))

    def is_accepting(self) -> bool:
        """True when the output so far is a complete sentence of the grammar (EOS allowed)."""
        return bool(self.matcher.is_accepting())

    def is_stopped(self) -> bool:
        """True when no further token (other than EOS) can continue the output, or the matcher erred."""
        return bool(self.matcher.is_stopped())


class MaskJob:
    """Masks of one step's constrained rows, computed in a background thread (started at construction).

    ``rows``: row indices into the step's sampling logits [S, V]; ``states``: their GrammarStates.
    ``bitmask``: int32 [len(rows), ceil(n_tok/32)], bit j of word w = token 32*w + j allowed.
    """

    def __init__(self, executor, rows: list[int], states: list[GrammarState], n_tok: int) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        self.rows, self.n_tok = rows, n_tok
        self.bitmask = torch.zeros(len(rows), (n_tok + 31) // 32, dtype=torch.int32)
        pairs = [(s.matcher, k) for k, s in enumerate(states)]
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fill_next_token_bitmask_par(executor, pairs, self.bitmask)
            except BaseException as e:  # re-raised in the engine thread by apply()
                self._error = e

        self._thread = threading.Thread(target=run, name="grammar-mask", daemon=True)
        self._thread.start()

    def allowed(self) -> torch.Tensor:
        """Wait for the masks; bool [len(rows), n_tok] (True = allowed)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        shifts = torch.arange(8, dtype=torch.uint8)
        bits = (self.bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # little-endian words
        return bits.reshape(len(self.rows), -1)[:, : self.n_tok].bool()

    def apply(self, logits: torch.Tensor) -> None:
        """Join, then set disallowed entries of the constrained rows of ``logits`` [S, V] to -inf in place
        (ids >= n_tok, i.e. vocabulary padding, are always disallowed)."""
        allowed = self.allowed()
        v = logits.shape[-1]
        if v > self.n_tok:
            allowed = torch.cat([allowed, allowed.new_zeros(len(self.rows), v - self.n_tok)], dim=1)
        allowed = allowed[:, :v].to(logits.device)
        with torch.inference_mode():  # the model's logits are inference tensors
            for k, row in enumerate(self.rows):
                logits[row].masked_fill_(~allowed[k], float("-inf"))


class Structured:
    """Per-engine grammar support (see module docstring).

    ``token_bytes``: id -> bytes (``detokenizer.load_token_bytes``); ``eos_ids``: EOS/EOT ids;
    ``gguf_path``: read once, lazily, for the names of control tokens, unless ``special_names`` ({id: name},
    ``special_token_names``) gives them.
    """

    def __init__(self, gguf_path: str, token_bytes: list[bytes], eos_ids: tuple[int, ...],
                 cache_size: int = CACHE_SIZE, num_threads: int | None = None,
                 special_names: dict[int, str] | None = None) -> None:
        self._path, self._token_bytes, self._eos_ids = gguf_path, token_bytes, eos_ids
        self._special_names = special_names
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size, self._num_threads = cache_size, num_threads
        self._tokenizer = self._executor = None
        self.cache_hits = self.cache_misses = 0
        self.compile_ms_total = 0.0  # grammar compilation (ms), misses only
        self.mask_ms_total = 0.0  # mask time not hidden by the forward (ms): join wait + apply
        self.num_constrained_steps = 0  # steps with >= 1 constrained sampling row

    @property
    def tokenizer(self):
        """The ``llguidance.LLTokenizer`` (built on first use, ~0.1 s plus one GGUF header read)."""
        if self._tokenizer is None:
            import llguidance

            names = self._special_names if self._special_names is not None else special_token_names(self._path)
            self._tokenizer = build_tokenizer(self._token_bytes, names, self._eos_ids)
            self._executor = llguidance.LLExecutor(self._num_threads)
        return self._tokenizer

    def new_state(self, grammar: str) -> GrammarState:
        """Fresh matcher state for ``grammar`` (cached compile); ValueError with llguidance's message
        when the grammar is invalid."""
        proto = self._cache.get(grammar)
        if proto is not None:
            self._cache.move_to_end(grammar)
            self.cache_hits += 1
            return GrammarState(proto.deep_copy())
        import llguidance

        tokenizer = self.tokenizer  # built on first use: not counted as compile time
        t0 = time.perf_counter()
        proto = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.compile_ms_total += (time.perf_counter() - t0) * 1e3
        self.cache_misses += 1
        if proto.is_error():
            raise ValueError(f"invalid grammar: {proto.get_error()}")
        self._cache[grammar] = proto
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return GrammarState(proto.deep_copy())

    def start_masks(self, rows: list[int], states: list[GrammarState]) -> MaskJob | None:
        """Start computing the masks of ``rows`` (constrained rows of the next sampling logits); None
        when there are none.  Call before the forward pass, ``finish_masks`` after it."""
        if not rows:
            return None
        self.num_constrained_steps += 1
        return MaskJob(self._executor, rows, states, len(self._token_bytes))

    def finish_masks(self, job: MaskJob | None, logits: torch.Tensor) -> None:
        """Join ``job`` and mask its rows of ``logits`` [S, V] in place; adds the time to ``mask_ms_total``."""
        if job is None:
            return
        t0 = time.perf_counter()
        job.apply(logits)
        self.mask_ms_total += (time.perf_counter() - t0) * 1e3

    def stats(self) -> dict:
        """Counters for ``EngineStats.extra``."""
        return {
            "num_constrained_steps": self.num_constrained_steps,
            "grammar_compile_ms_total": round(self.compile_ms_total, 3),
            "grammar_cache_hits": self.cache_hits,
            "grammar_cache_misses": self.cache_misses,
            "mask_ms_total": round(self.mask_ms_total, 3),
        }
