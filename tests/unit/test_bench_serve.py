"""``actorserve bench serve`` (bench/serve_*.py): statistics, the token check, the peer's configuration, the
JSON shape and table, and the load generator against a small fake SSE server on loopback."""

from __future__ import annotations

import argparse
import json

import pytest
from aiohttp import web

from bench import serve_bench as sb
from bench import serve_client as sc
from bench import serve_peer as sp
from bench import serve_report as sr


def _result(sent: float, chunks: list[float], tokens: int, prompt: int = 40) -> sc.Result:
    r = sc.Result(sent, chunks=list(chunks), usage={"completion_tokens": tokens, "prompt_tokens": prompt})
    r.http_status, r.done = 200, chunks[-1] if chunks else sent
    return r


def test_pct_interpolates_like_numpy_linear():
    assert sc.pct([], 0.5) is None
    assert sc.pct([5.0], 0.99) == 5.0
    assert sc.pct([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert sc.pct(list(range(101)), 0.99) == pytest.approx(99.0)


def test_level_stats_figures_and_token_check():
    # two requests, 4 tokens each, one chunk per token: TTFT 0.1 and 0.3 s, gaps 0.05 s
    a = _result(0.0, [0.1, 0.15, 0.2, 0.25], 4)
    b = _result(0.0, [0.3, 0.35, 0.4, 0.45], 4, prompt=44)
    st = sc.level_stats([a, b], wall_s=0.5, max_tokens=4)
    assert st["ok"] == 2 and st["completion_tokens"] == 8 and st["tok_s"] == pytest.approx(16.0)
    assert st["ttft_p50_ms"] == pytest.approx(200.0) and st["ttft_p99_ms"] == pytest.approx(298.0)
    assert st["itl_p50_ms"] == pytest.approx(50.0) and st["tpot_mean_ms"] == pytest.approx(50.0)
    assert st["token_check"] and st["chunk_check"] and st["prompt_tokens_max"] == 44
    # one request one token short: the check fails and the count shows it
    short = sc.level_stats([a, _result(0.0, [0.3, 0.35, 0.4], 3)], 0.5, max_tokens=4)
    assert not short["token_check"] and short["completion_tokens_min"] == 3
    # a failed request fails the check even if every ok one is right
    bad = sc.Result(0.0, http_status=503, error="HTTP 503: cold start")
    failed = sc.level_stats([a, bad], 0.5, max_tokens=4)
    assert failed["ok"] == 1 and not failed["token_check"] and failed["errors"] == ["HTTP 503: cold start"]
    # more text chunks than tokens cannot be
    assert not sc.level_stats([_result(0.0, [0.1, 0.2, 0.3], 2)], 0.5, 2)["chunk_check"]
    with pytest.raises(ValueError, match="wall_s"):
        sc.level_stats([a], 0.0, 4)


def test_parse_and_absorb_events():
    r = sc.Result(0.0)
    for line, now in ((b": keep-alive\n", 0.1), (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n', 0.2),
                      (b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n', 0.3),
                      (b'data: {"choices":[],"usage":{"completion_tokens":1,"prompt_tokens":9}}\n', 0.4),
                      (b"data: [DONE]\n", 0.5)):
        obj = sc.parse_event(line)
        if obj is not None:
            sc.absorb(r, obj, now)
    assert r.chunks == [0.3] and r.completion_tokens == 1
    sc.absorb(r, {"error": {"message": "boom"}}, 0.6)
    assert "boom" in r.error
    with pytest.raises(ValueError):
        sc.parse_event("data: {not json")


def test_request_bodies_are_the_same_for_both_sides_and_distinct_per_request():
    s = sc.Sampling(max_tokens=128, seed=7)
    ours, peer = sc.request_body("m", 8, 3, s), sc.request_body("other", 8, 3, s)
    assert {k: v for k, v in ours.items() if k != "model"} == {k: v for k, v in peer.items() if k != "model"}
    assert ours["ignore_eos"] is True and ours["temperature"] == 0.8 and ours["seed"] == 10
    assert ours["stream"] is True and ours["stream_options"] == {"include_usage": True}
    prompts = {sc.request_body("m", n, i, s)["messages"][0]["content"] for n in (1, 8) for i in range(8)}
    assert len(prompts) == 16  # unique markers: no shared prefix cache hits between requests


def test_peer_config_gives_every_slot_prompt_plus_max_tokens():
    cfg = sp.peer_config(64, prompt_tokens_max=70, max_tokens=128)
    assert cfg["parallel"] == 64 and cfg["ctx_per_slot"] >= 70 + 128 and cfg["ctx_per_slot"] % 256 == 0
    assert cfg["ctx_size"] == 64 * cfg["ctx_per_slot"] and cfg["threads"] == 2
    argv = sp.llama_server_argv("/bin/llama-server", "/m.gguf", 8123, cfg)
    assert argv[argv.index("--parallel") + 1] == "64" and argv[argv.index("-c") + 1] == str(cfg["ctx_size"])
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("-t") + 1] == "2"
    assert sp.peer_config(1, 400, 128)["ctx_per_slot"] == 768
    with pytest.raises(ValueError, match="max_streams"):
        sp.peer_config(0, 10, 128)


def test_cpu_info_and_llama_server_lookup(tmp_path, monkeypatch):
    info = sp.cpu_info("model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16 sse\n")
    assert info["model"] == "AMD EPYC 9R14" and info["flags"] == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--llama-server"):
        sp.find_llama_server(None)
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(exe))
    assert sp.find_llama_server(None) == str(exe)


def _stats(tok_s: float, ttft_p99: float) -> dict:
    return {"tok_s": tok_s, "ttft_p50_ms": ttft_p99 / 2, "ttft_p99_ms": ttft_p99, "itl_p50_ms": 10.0,
            "itl_p99_ms": 20.0, "tpot_mean_ms": 11.0, "completion_tokens": 1024, "prompt_tokens": 600, "ok": 8, "requests": 8,
            "token_check": True}


def test_json_shape_targets_and_table(tmp_path):
    streams = {"1": sr.level_entry(_stats(100.0, 50.0), _stats(80.0, 40.0), 128),
               "32": sr.level_entry(_stats(600.0, 300.0), _stats(150.0, 900.0), 128),
               "64": sr.level_entry(_stats(700.0, 600.0), None, 128)}
    for n, e in streams.items():
        for key in ("ours_tok_s", "peer_tok_s", "ours_ttft_p99_ms", "peer_ttft_p99_ms"):
            assert key in e, (n, key)
    assert streams["1"]["tok_s_ratio"] == 1.25 and streams["32"]["ttft_p99_ratio"] == pytest.approx(0.333)
    assert streams["1"]["same_prompt_tokens"] and not streams["64"]["same_prompt_tokens"]
    assert streams["1"]["same_tokens"] and not streams["64"]["same_tokens"] and streams["64"]["tok_s_ratio"] is None
    t = sr.targets(streams)
    assert [x["met"] for x in t] == [True, True, True]
    assert [x["met"] for x in sr.targets({"1": sr.level_entry(_stats(90.0, 1.0), _stats(80.0, 1.0), 128)})] == \
        [False, None, None]
    report = {"streams": streams, "targets": t, "cpu": {"model": "x", "cpus": 2}, "max_tokens": 128}
    text = sr.table(report)
    assert "1.25" in text and "not run" not in text and "-> met" in text
    json.dumps(report)  # serialisable as written
    png = tmp_path / "serve.png"
    sr.plot(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_requests_per_level_and_option_checks():
    assert sb.requests_for(1, None) == 8 and sb.requests_for(32, None) == 64 and sb.requests_for(8, 20) == 20
    with pytest.raises(ValueError, match="requests-per-level"):
        sb.requests_for(32, 16)
    p = argparse.ArgumentParser()
    sb.add_arguments(p)
    a = p.parse_args(["--streams", "8,1,8", "--sides", "peer", "--peer-url", "http://127.0.0.1:1"])
    assert a.streams == (1, 8) and a.sides == ("peer",)
    with pytest.raises(SystemExit):
        p.parse_args(["--streams", "0"])
    with pytest.raises(SystemExit):
        p.parse_args(["--llama-server", "x", "--peer-url", "y"])


def test_started_actors_from_the_up_log():
    log = ("x INFO supervisor[1] actorserve.supervisor: started worker-0 (pid 5)\n"
           "x INFO supervisor[1] actorserve.supervisor: worker-0 ready 3 s after its start\n"
           "x INFO supervisor[1] actorserve.supervisor: started worker-1 (pid 9)\n")
    assert sb.started_actors(log) == ["worker-0", "worker-1"]


def _fake_openai(tokens_sent: int):
    """A streamed chat server: one chunk per token, ``tokens_sent`` tokens whatever max_tokens asks."""
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens_sent):
            await resp.write(f'data: {{"choices":[{{"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode())
        usage = {"completion_tokens": tokens_sent, "prompt_tokens": len(body["messages"][0]["content"])}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.parametrize("tokens_sent, ok", [(6, True), (5, False)])
async def test_run_level_against_a_fake_server(tokens_sent, ok):
    runner = web.AppRunner(_fake_openai(tokens_sent))
    await runner.setup()
    port = sp.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        s = sc.Sampling(max_tokens=6)
        bodies = [sc.request_body("m", 4, i, s) for i in range(8)]
        results, wall = await sc.run_level(f"http://127.0.0.1:{port}/v1/chat/completions", "k", bodies, 4, 30.0)
    finally:
        await runner.cleanup()
    st = sc.level_stats(results, wall, 6)
    assert st["requests"] == 8 and st["ok"] == 8 and st["chunks_per_request_max"] == tokens_sent
    assert st["token_check"] is ok and st["tok_s"] > 0


def test_cli_registers_bench_serve():
    from control.ops.cli import build_parser

    a = build_parser().parse_args(["bench", "serve", "--streams", "1,32", "--max-tokens", "16", "--json", "x.json"])
    assert a.func is sb.main and a.streams == (1, 32) and a.max_tokens == 16 and a.json == "x.json"
