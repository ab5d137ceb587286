"""A migrated sequence's state (actors/worker/migration_state.py) and what the receiver re-derives from it:
the resume payload survives the wire, the detokenizer / stop-string replay continues a stream exactly where
an uninterrupted one would be (compared with the uninterrupted stream, at every split point), and a saved
sampler RNG position draws what the uninterrupted generator draws."""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, replay
from actors.worker.engine.sampler import generator_state, make_generator, set_generator_state
from actors.worker.migration import MigrationConfig, parse_notice
from actors.worker.migration_state import ResumeState, resume_of
from bus.messages import GenerateRequest, SamplingParams

# token id -> bytes: "é" (c3 a9) and "😀" (f0 9f 98 80) split across tokens, and text for a stop string "END"
TABLE = [b"a", b"b", b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98", b"\x80", b" ", b"E", b"N", b"D", b"x"]


def stream(tokens: list[int], stops=()) -> list[str]:
    """Per-token text an uninterrupted engine emits (one token per step, as engine._on_token feeds them)."""
    detok, stop = IncrementalDetokenizer(TABLE), StopStringMatcher(stops)
    return [stop.feed(detok.add_tokens([t])) for t in tokens]


def test_resume_state_round_trips_through_a_generate_request():
    g = make_generator(7)
    torch.rand(3, generator=g)
    st = ResumeState("w1", (5, 6, 7), seq=4, rng_state=generator_state(g), t_in=100.5, t_first=101.25,
                     echo_pending=False, migrations=2, t_handoff=102.0)
    req = GenerateRequest("r", "t", "m", "1", "_INBOX.t.r", (1, 2), SamplingParams(max_tokens=9), resume=st.to_json())
    back = resume_of(GenerateRequest.decode(req.encode()).resume)
    assert back == st
    assert resume_of(None) is None
    plain = GenerateRequest.decode(GenerateRequest("r", "t", "m", "1", "x", (1,), SamplingParams()).encode())
    assert plain.resume is None  # an ordinary request carries none


@pytest.mark.parametrize("bad", [
    None, {"v": 2, "from_worker": "w"}, {"v": 1}, {"v": 1, "from_worker": "w", "output_ids": [-1]},
    {"v": 1, "from_worker": "w", "rng": "not base64!"}, {"v": 1, "from_worker": "w", "seq": -1},
])
def test_malformed_resume_payloads_are_refused(bad):
    with pytest.raises(ValueError):
        ResumeState.from_json(bad)


def test_generate_request_refuses_a_non_object_resume():
    with pytest.raises(ValueError):
        GenerateRequest("r", "t", "m", "1", "x", (1,), SamplingParams(), resume=[1, 2])


@pytest.mark.parametrize("stops", [(), ("END",), ("b ",)])
def test_detokenizer_replay_continues_the_uninterrupted_text_at_every_split(stops):
    tokens = [0, 2, 3, 1, 4, 5, 6, 7, 8, 9, 0, 11, 8, 9, 10, 1, 1]
    reference = stream(tokens, stops)
    for k in range(len(tokens) + 1):
        sent = reference[:k]  # what the first worker emitted before it gave the sequence up
        detok, stop = IncrementalDetokenizer(TABLE), StopStringMatcher(stops)
        assert replay(detok, stop, tokens[:k]) == sent  # re-derived, not re-sent
        after = [stop.feed(detok.add_tokens([t])) for t in tokens[k:]]
        assert "".join(sent + after) == "".join(reference), k
        assert after == reference[k:], k


def test_a_restored_generator_draws_what_the_uninterrupted_one_draws():
    ref = make_generator(1234)
    reference = [torch.rand(1, generator=ref).item() for _ in range(40)]
    for k in (0, 1, 17, 39):
        g = make_generator(1234)
        head = [torch.rand(1, generator=g).item() for _ in range(k)]
        moved = set_generator_state(make_generator(None), generator_state(g))  # another worker, another seed
        assert head + [torch.rand(1, generator=moved).item() for _ in range(40 - k)] == reference


def test_preemption_notice_records_are_validated():
    assert parse_notice({"deadline": 1700000000.5, "reason": "spot"}) == (1700000000.5, "spot")
    assert parse_notice({"deadline": 5})[1] == "preemption notice"
    for bad in (None, {}, {"deadline": "soon"}, {"deadline": True}, {"deadline": -1}):
        with pytest.raises(ValueError):
            parse_notice(bad)
    with pytest.raises(ValueError):
        MigrationConfig(retry_s=0)


def test_workers_cli_parses_preempt_and_list():
    from control.ops.cli import build_parser

    a = build_parser().parse_args(["workers", "preempt", "worker-0", "--in-s", "30", "--etcd", "http://e:2379"])
    assert a.worker_id == "worker-0" and a.in_s == 30.0 and a.etcd == "http://e:2379" and callable(a.func)
    assert build_parser().parse_args(["workers", "preempt", "w"]).in_s == 120.0  # a cloud's 2-minute warning
    assert build_parser().parse_args(["workers", "list", "--json"]).json
    with pytest.raises(SystemExit):
        build_parser().parse_args(["workers", "preempt", "w", "--in-s", "-1"])


def test_tool_call_parser_replay_continues_the_uninterrupted_deltas():
    """Live.resume replays the tool-call parser through the resumed tokens' text; what it emits after the
    split equals what the uninterrupted parser emitted there (call ids are random: compared without them)."""
    from actors.text.tool_calls import make_parser, parse_step
    from actors.worker.live import Live

    out = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> done'
    deltas = [out[i:i + 3] for i in range(0, len(out), 3)]  # one text delta per token

    def emitted(parser, pieces):
        res = [parse_step(parser, d, False) for d in pieces]
        return [(t, [{k: v for k, v in c.items() if k != "id"} for c in calls]) for t, calls in res]

    reference = emitted(make_parser("hermes"), deltas)
    assert any(calls for _, calls in reference) and "tool_call" not in "".join(t for t, _ in reference)
    for k in range(len(deltas) + 1):
        st = ResumeState("w1", tuple(range(k)), seq=k, t_in=1.0, t_first=2.0, echo_pending=False)
        req = GenerateRequest("r", "t", "m", "1", "x", (1,), SamplingParams(), resume=st.to_json())
        lv = Live(req, 5.0, tools=make_parser("hermes"))
        lv.resume(req, deltas[:k])
        assert (lv.seq, lv.num_generated, lv.echo_pending, lv.t_in, lv.t_first) == (k, k, False, 1.0, 2.0)
        assert emitted(lv.tools, deltas[k:]) == reference[k:], k
