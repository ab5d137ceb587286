"""OpenAI Files and Batch APIs through the official ``openai`` client, unchanged, against the session stack (issue [27]).

files.create -> batches.create -> poll batches.retrieve -> files.content(output_file_id): one result per line with
its custom_id; bodies the validator refuses go to the error file by custom_id; an unparseable line or a duplicate
custom_id fails the batch at validating, naming the line; cancel stops new lines and reports counts; lists page;
another tenant cannot read, list, delete or batch the files. docs/batch.md.
"""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from tests.e2e.test_openai_api import MODEL
from tests.e2e.test_responses_api import client
from tests.e2e.test_tenants import new_tenant

CHAT = "/v1/chat/completions"


def _line(i: int, body: dict | None = None, url: str = CHAT, custom_id: str | None = None) -> dict:
    body = body or {"model": MODEL, "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4,
                    "temperature": 0}
    return {"custom_id": custom_id or f"req-{i}", "method": "POST", "url": url, "body": body}


def _upload(c: openai.OpenAI, lines: list, name: str = "in.jsonl"):
    data = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines).encode()
    return c.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def _wait(c: openai.OpenAI, batch_id: str, timeout_s: float = 240.0, until=("completed", "failed", "expired",
                                                                             "cancelled")):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b = c.batches.retrieve(batch_id)
        if b.status in until:
            return b
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {b.status} after {timeout_s} s")


def _jsonl(c: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(ln) for ln in c.files.content(file_id).text.splitlines() if ln.strip()]


def test_a_batch_of_fifty_with_two_refused_bodies(stack):
    c = client(stack)
    lines = [_line(i) for i in range(50)]
    lines[7]["body"]["temperature"] = 7  # refused by the validator (temperature must be <= 2)
    lines[31]["body"]["max_tokens"] = -1
    f = _upload(c, lines)
    assert f.purpose == "batch" and f.bytes > 0 and f.id.startswith("file-") and f.filename == "in.jsonl"
    b = c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"run": "fifty"})
    assert b.status == "validating" and b.metadata == {"run": "fifty"} and b.endpoint == CHAT
    b = _wait(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (50, 48, 2)
    out, err = _jsonl(c, b.output_file_id), _jsonl(c, b.error_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(50) if i not in (7, 31))
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["object"] == "chat.completion"
               for r in out)
    assert sorted(r["custom_id"] for r in err) == ["req-31", "req-7"]
    bad = {r["custom_id"]: r["response"] for r in err}
    assert bad["req-7"]["status_code"] == 400 and bad["req-7"]["body"]["error"]["param"] == "temperature"
    assert b.completed_at and b.in_progress_at and b.finalizing_at and b.output_file_id != b.error_file_id
    assert c.files.retrieve(b.output_file_id).purpose == "batch_output"


def test_completions_and_responses_endpoints(stack):
    c = client(stack)
    comp = [_line(i, {"model": MODEL, "prompt": f"Count: {i},", "max_tokens": 3}, "/v1/completions")
            for i in range(3)]
    resp = [_line(i, {"model": MODEL, "input": f"Say {i}.", "max_output_tokens": 4}, "/v1/responses")
            for i in range(3)]
    for url, lines, obj in (("/v1/completions", comp, "text_completion"), ("/v1/responses", resp, "response")):
        b = _wait(c, c.batches.create(input_file_id=_upload(c, lines).id, endpoint=url, completion_window="24h").id)
        assert b.status == "completed" and b.request_counts.completed == 3, b
        assert {r["response"]["body"]["object"] for r in _jsonl(c, b.output_file_id)} == {obj}


@pytest.mark.parametrize("lines, line_no, code", [
    ([_line(0), "{not json", _line(2)], 2, "invalid_json_line"),
    ([_line(0), _line(1, custom_id="req-0")], 2, "duplicate_custom_id"),
    ([_line(0), {**_line(1), "custom_id": None}], 2, "missing_required_parameter"),
    ([_line(0), _line(1, url="/v1/completions")], 2, "mismatched_endpoint"),
])
def test_a_bad_line_fails_the_whole_batch_naming_it(stack, lines, line_no, code):
    c = client(stack)
    b = _wait(c, c.batches.create(input_file_id=_upload(c, lines).id, endpoint=CHAT, completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None, b
    assert [(e.line, e.code) for e in b.errors.data] == [(line_no, code)]
    assert f"line {line_no}" in b.errors.data[0].message


def test_cancel_stops_new_lines_and_reports_counts(stack):
    c = client(stack)
    lines = [_line(i, {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                       "max_tokens": 64, "temperature": 0}) for i in range(40)]
    b = c.batches.create(input_file_id=_upload(c, lines).id, endpoint=CHAT, completion_window="24h")
    _wait(c, b.id, until=("in_progress",), timeout_s=60)
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _wait(c, b.id, timeout_s=120)
    assert done.status == "cancelled" and done.cancelled_at, done
    n = done.request_counts.completed + done.request_counts.failed
    assert done.request_counts.total == 40 and n < 40
    written = _jsonl(c, done.output_file_id) if done.output_file_id else []
    assert len(written) == done.request_counts.completed


def test_lists_page_and_other_tenants_see_nothing(stack):
    c = client(stack)
    ids = [_upload(c, [_line(i)], name=f"p{i}.jsonl").id for i in range(3)]
    first = c.files.list(purpose="batch", limit=2)
    assert len(first.data) == 2 and first.has_more and first.data[0].id == ids[-1]
    second = c.files.list(purpose="batch", limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    batches = [c.batches.create(input_file_id=i, endpoint=CHAT, completion_window="24h").id for i in ids[:2]]
    page = c.batches.list(limit=1)
    assert page.data[0].id == batches[-1] and page.has_more
    assert c.batches.list(limit=1, after=page.data[0].id).data[0].id == batches[0]
    _, _, key = new_tenant(stack, models=(MODEL,))
    other = client(stack, key)
    for call in (lambda: other.files.retrieve(ids[0]), lambda: other.files.content(ids[0]),
                 lambda: other.files.delete(ids[0]), lambda: other.batches.retrieve(batches[0]),
                 lambda: other.batches.cancel(batches[0])):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=ids[2], endpoint=CHAT, completion_window="24h")
    assert ids[0] not in [f.id for f in other.files.list().data] and not other.batches.list().data
    assert c.files.delete(ids[2]).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(ids[2])


def test_upload_refusals_name_the_field(stack):
    c = client(stack)
    with pytest.raises(openai.BadRequestError) as ei:
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert ei.value.param == "purpose"
    with pytest.raises(openai.BadRequestError) as ei:
        c.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")
    assert ei.value.param == "endpoint"
    with pytest.raises(openai.NotFoundError) as ei:
        c.batches.create(input_file_id="file-0123456789abcdef01234567", endpoint=CHAT, completion_window="24h")
    assert ei.value.param == "input_file_id"
    user = c.files.create(file=("notes.txt", io.BytesIO(b"hello")), purpose="user_data")
    assert c.files.content(user.id).content == b"hello"
    with pytest.raises(openai.BadRequestError) as ei:
        c.batches.create(input_file_id=user.id, endpoint=CHAT, completion_window="24h")
    assert ei.value.param == "input_file_id"


def test_files_and_batches_over_the_nats_api(stack):
    """The NATS API's as.api.v1.files.<op> / as.api.v1.batches.<op>: the same operations as HTTP, as the dev
    tenant's NATS user; a file too large for one NATS message is refused naming max_payload."""
    import base64

    from bus import subjects
    from tests.e2e.test_nats_api import ask

    def op(kind: str, name: str, body: dict) -> dict:
        [reply] = ask(stack, f"{kind}.{name}", body)
        return reply

    lines = [_line(i) for i in range(3)]
    text = "".join(json.dumps(x) + "\n" for x in lines)
    f = op(subjects.API_FILES, "create", {"purpose": "batch", "filename": "n.jsonl", "content": text})
    assert f["object"] == "file" and f["bytes"] == len(text.encode()) and f["filename"] == "n.jsonl"
    assert op(subjects.API_FILES, "retrieve", {"file_id": f["id"]})["id"] == f["id"]
    assert f["id"] in [x["id"] for x in op(subjects.API_FILES, "list", {"purpose": "batch"})["data"]]
    b = op(subjects.API_BATCHES, "create", {"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"})
    assert b["object"] == "batch" and b["status"] == "validating"
    deadline = time.monotonic() + 120
    while (cur := op(subjects.API_BATCHES, "retrieve", {"batch_id": b["id"]}))["status"] != "completed":
        assert time.monotonic() < deadline and cur["status"] in ("validating", "in_progress", "finalizing"), cur
        time.sleep(0.3)
    out = op(subjects.API_FILES, "content", {"file_id": cur["output_file_id"]})
    got = [json.loads(x)["custom_id"] for x in base64.b64decode(out["content_b64"]).decode().splitlines()]
    assert sorted(got) == ["req-0", "req-1", "req-2"]
    assert op(subjects.API_BATCHES, "list", {"limit": 1})["data"][0]["id"] == b["id"]
    err = op(subjects.API_BATCHES, "retrieve", {"batch_id": "batch_0123456789abcdef01234567"})["error"]
    assert err["status"] == 404 if "status" in err else err["code"] == "batch_not_found"
    big = client(stack).files.create(file=("big.bin", io.BytesIO(b"\0" * (9 * 1024 * 1024))), purpose="user_data")
    refused = op(subjects.API_FILES, "content", {"file_id": big.id})["error"]
    assert refused["code"] == "payload_too_large" and "max_payload" in refused["message"]
    assert op(subjects.API_FILES, "delete", {"file_id": big.id})["deleted"] is True
