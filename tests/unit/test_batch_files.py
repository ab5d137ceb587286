"""OpenAI Batch input lines (pure) and the Files API's limits (one gateway's logic, in-memory stores) — issue [27].

The whole path with the official client, real NATS and etcd is tests/e2e/test_batch_api.py; the kill -9 of the
jobs actor and a worker during a 200-line batch is tests/chaos/test_chaos.py::test_07.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actors import job_batches as batch_lines, job_files as files
from actors.jobs.batch_runner import output_file_id, response_from_chat
from bus.kv import MemoryBuckets
from bus.streams import JOBS
from gateway.files_api import FilesApi
from gateway.http import errors_middleware

URL = "/v1/chat/completions"


def _jsonl(*objs) -> bytes:
    return b"".join((o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs)


def _ok(cid: str, url: str = URL) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", "messages": []}}


def test_parse_input_accepts_good_lines_and_skips_blank_ones():
    lines, errors = batch_lines.parse_input(_jsonl(_ok("a"), b"   ", _ok("b")), URL)
    assert errors == [] and [(x.index, x.custom_id) for x in lines] == [(0, "a"), (2, "b")]


@pytest.mark.parametrize("bad, code, param", [
    (b"{nope", "invalid_json_line", None),
    (b"[1, 2]", "invalid_json_line", None),
    ({**_ok("x"), "custom_id": ""}, "missing_required_parameter", "custom_id"),
    ({k: v for k, v in _ok("x").items() if k != "custom_id"}, "missing_required_parameter", "custom_id"),
    (_ok("a"), "duplicate_custom_id", "custom_id"),
    ({**_ok("x"), "method": "GET"}, "invalid_method", "method"),
    (_ok("x", "/v1/completions"), "mismatched_endpoint", "url"),
    ({**_ok("x"), "body": "text"}, "invalid_request", "body"),
])
def test_one_bad_line_fails_the_batch_naming_it(bad, code, param):
    lines, errors = batch_lines.parse_input(_jsonl(_ok("a"), bad, _ok("c")), URL)
    assert [(e.line, e.code, e.param) for e in errors] == [(2, code, param)]
    assert "line 2" in errors[0].message


def test_empty_and_oversized_inputs():
    assert batch_lines.parse_input(b"\n\n", URL)[1][0].code == "empty_file"
    many = _jsonl(*[_ok(f"c{i}") for i in range(batch_lines.MAX_LINES + 1)])
    assert batch_lines.parse_input(many, URL)[1][0].code == "too_many_requests"


def test_batch_view_and_output_ids():
    rec = {"id": "batch_1", "url": URL, "input_file_id": "file-1", "completion_window": "24h", "status": "failed",
           "created_at": 10.7, "failed_at": 12.2, "errors": {"object": "list", "data": []}}
    view = batch_lines.batch_view(rec)
    assert view["created_at"] == 10 and view["failed_at"] == 12 and view["completed_at"] is None
    assert view["object"] == "batch" and view["endpoint"] == URL and view["request_counts"]["total"] == 0
    assert output_file_id("batch_1", "output") == output_file_id("batch_1", "output") != output_file_id(
        "batch_1", "error")  # a rerun writes the same files
    line = json.loads(batch_lines.result_line("c1", "chatcmpl-1", 400, {"error": {"param": "temperature"}}))
    assert line["custom_id"] == "c1" and line["response"]["status_code"] == 400 and line["error"] is None


def test_a_responses_line_is_answered_as_a_response_object():
    from gateway import responses_format as rf

    req = rf.parse_request({"model": "m", "input": "hi", "max_output_tokens": 3})
    chat = {"id": "chatcmpl-x", "created": 5, "model": "m@1", "choices": [
        {"message": {"role": "assistant", "content": "Hello"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    resp = response_from_chat(req, chat)
    assert resp["object"] == "response" and resp["status"] == "incomplete"
    assert resp["output"][0]["content"][0]["text"] == "Hello" and resp["usage"]["output_tokens"] == 3


# -- the Files API's limits, on in-memory stores ----------------------------------------------------------------

class _Objects:
    """An in-memory stand-in for bus.jetstream.ObjectStore (put / get / delete by name)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def put(self, name, data) -> None:
        self.data[name] = data if isinstance(data, bytes) else data.read()

    async def get(self, name) -> bytes:
        return self.data[name]

    async def delete(self, name) -> None:
        del self.data[name]


class _Tenant:
    id = "acme"


class _Tenancy:
    def authenticate(self, request):
        return _Tenant()


async def _client(monkeypatch, max_bytes: int, quota: int):
    monkeypatch.setenv(files.MAX_BYTES_ENV, str(max_bytes))
    monkeypatch.setenv(files.QUOTA_ENV, str(quota))
    api = FilesApi(_Tenancy(), None)
    api.kv, api.obj = await MemoryBuckets().bucket(JOBS), _Objects()
    app = web.Application(middlewares=[errors_middleware])
    api.add_routes(app)
    return api, TestClient(TestServer(app))


def _form(data: bytes, purpose: str = "batch") -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
    return form


async def test_a_file_over_the_limit_is_413_naming_it(monkeypatch):
    api, client = await _client(monkeypatch, max_bytes=1000, quota=10_000)
    async with client:
        ok = await client.post("/v1/files", data=_form(b"x" * 1000))
        assert ok.status == 200 and (await ok.json())["bytes"] == 1000
        r = await client.post("/v1/files", data=_form(b"x" * 1001))
        err = (await r.json())["error"]
        assert r.status == 413 and err["code"] == "file_too_large" and "1000 bytes" in err["message"]
        assert err["param"] == "file" and files.MAX_BYTES_ENV in err["message"]
        assert len(api.obj.data) == 1  # nothing of the refused upload was stored


async def test_the_tenant_quota_is_413_naming_it_and_deleting_frees_it(monkeypatch):
    api, client = await _client(monkeypatch, max_bytes=1000, quota=2500)
    async with client:
        ids = [(await (await client.post("/v1/files", data=_form(b"y" * 1000))).json())["id"] for _ in range(2)]
        r = await client.post("/v1/files", data=_form(b"z" * 600))
        err = (await r.json())["error"]
        assert r.status == 413 and err["code"] == "file_quota_exceeded" and "2500" in err["message"]
        assert (await (await client.delete(f"/v1/files/{ids[0]}")).json())["deleted"] is True
        assert (await client.post("/v1/files", data=_form(b"z" * 600))).status == 200
        assert (await client.get(f"/v1/files/{ids[0]}")).status == 404
        assert await (await client.get(f"/v1/files/{ids[1]}/content")).read() == b"y" * 1000


async def test_upload_refusals_name_the_field(monkeypatch):
    _, client = await _client(monkeypatch, max_bytes=1000, quota=2500)
    async with client:
        r = await client.post("/v1/files", data=_form(b"{}", purpose="assistants"))
        assert r.status == 400 and (await r.json())["error"]["param"] == "purpose"
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        r = await client.post("/v1/files", data=form)
        assert r.status == 400 and (await r.json())["error"]["param"] == "file"
        r = await client.post("/v1/files", json={"purpose": "batch"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "file"
        r = await client.get("/v1/files?limit=0")
        assert r.status == 400 and (await r.json())["error"]["param"] == "limit"


def test_limits_from_the_environment_are_checked(monkeypatch):
    monkeypatch.setenv(files.MAX_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=files.MAX_BYTES_ENV):
        files.max_file_bytes()
