"""SSE framing: every chunk stays one line for clients that split like ``str.splitlines`` (httpx)."""

import asyncio

import httpx
import orjson
import pytest

from gateway import sse

# Characters str.splitlines (and so httpx.Response.aiter_lines) treats as line ends.
SPLITLINES_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def chunk(content: str) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}


@pytest.mark.parametrize("ch", list(SPLITLINES_BREAKS), ids=[f"U+{ord(c):04X}" for c in SPLITLINES_BREAKS])
def test_payload_is_one_line_and_round_trips(ch):
    obj = chunk(f"a{ch}b")
    payload = sse.json_payload(obj)
    assert payload.decode().splitlines() == [payload.decode()]
    assert orjson.loads(payload) == obj


def test_raw_orjson_would_split():
    """The bug this module fixes: orjson writes U+2028 raw, which splitlines breaks at."""
    assert len(orjson.dumps(chunk("a\u2028b")).decode().splitlines()) == 2


def test_httpx_reads_every_event_whole():
    """Through httpx's own line decoder, as the chaos harness and many users read streams."""
    texts = ["plain", "nel\x85", "ls\u2028", "ps\u2029", "ctl\x1c\x1d\x1e", "multi\nline", "é漢字"]
    body = b"".join(sse.data_event(sse.json_payload(chunk(t))) for t in texts) + sse.DONE

    async def read() -> list[str]:
        transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://127.0.0.1/") as r:
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    lines = asyncio.run(read())
    assert lines[-1] == "data: [DONE]"
    got = [orjson.loads(line[6:])["choices"][0]["delta"]["content"] for line in lines[:-1]]
    assert got == texts


def test_payload_keeps_non_breaking_unicode_raw():
    """Only the three line-break characters are escaped; other text stays UTF-8."""
    assert "漢字".encode() in sse.json_payload(chunk("漢字"))
