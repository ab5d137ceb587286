"""OpenAI Batch: the batch object, its input lines checked, its output and error lines written (pure: no I/O).

A batch (``POST /v1/batches``) is a job of the jobs actor (actors/job_store.py: same bucket, stream, statuses
and transitions) whose record carries ``kind: "openai_batch"``, the ``input_file_id`` and the ``endpoint``. The
jobs actor reads the input file and checks it with :func:`parse_input` before any line runs; as OpenAI does, one
bad line fails the whole batch at ``validating`` (``errors.data[i]``: ``code``, ``message``, ``line`` 1-based,
``param``): a line that is not a JSON object, a missing or non-string ``custom_id``, a ``custom_id`` seen before,
a ``method`` other than POST, a ``url`` other than the batch's endpoint, a ``body`` that is not an object. A line
whose body the validator refuses later (a bad field) is not a batch error: it becomes a line of the error file
(:func:`result_line` with the 400 and its error body), keyed by its ``custom_id``.

Output lines follow OpenAI's batch output format: ``{"id": "batch_req_<hex>", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}``; a line that never reached a model (the batch was
cancelled or expired before it ran) is not written. References: OpenAI's Batch API guide and object reference
(platform.openai.com/docs/guides/batch, /docs/api-reference/batch).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from bus import jsonline

__all__ = ["BATCH_ENDPOINTS", "WINDOWS", "BatchLine", "LineError", "parse_input", "new_batch_id", "batch_view",
           "result_line", "MAX_LINES"]

# url of the lines -> the jobs pipeline's endpoint kind ("responses": translated to chat by the jobs actor)
BATCH_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}
WINDOWS = ("24h",)  # completion_window values OpenAI accepts
MAX_LINES = 50_000  # OpenAI's limit on requests per batch
MAX_ERRORS = 20  # errors listed on a failed batch (the first ones, in line order)


@dataclass(frozen=True)
class BatchLine:
    """One input line that passed the checks: ``index`` (0-based), ``custom_id``, ``body`` (the request)."""

    index: int
    custom_id: str
    body: dict


@dataclass(frozen=True)
class LineError:
    """Why a line fails the batch: OpenAI's ``errors.data`` entry (``line`` 1-based)."""

    code: str
    message: str
    line: int
    param: str | None = None

    def as_dict(self) -> dict:
        """The entry as the batch object shows it."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def _check_line(n: int, raw: bytes, url: str, seen: set[str]) -> BatchLine | LineError:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return LineError("invalid_json_line", f"line {n} is not valid JSON: {exc}", n)
    if not isinstance(obj, dict):
        return LineError("invalid_json_line", f"line {n} must be a JSON object", n)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return LineError("missing_required_parameter", f"line {n} needs a custom_id (a non-empty string)", n,
                         "custom_id")
    if cid in seen:
        return LineError("duplicate_custom_id", f"line {n}: the custom_id {cid!r} is used by an earlier line", n,
                         "custom_id")
    if obj.get("method", "POST") != "POST":
        return LineError("invalid_method", f"line {n}: method must be POST, got {obj.get('method')!r}", n, "method")
    if obj.get("url") != url:
        return LineError("mismatched_endpoint", f"line {n}: url {obj.get('url')!r} is not the batch's endpoint "
                                                f"{url}", n, "url")
    if not isinstance(obj.get("body"), dict):
        return LineError("invalid_request", f"line {n}: body must be a JSON object", n, "body")
    seen.add(cid)
    return BatchLine(n - 1, cid, obj["body"])


def parse_input(data: bytes, url: str) -> tuple[list[BatchLine], list[LineError]]:
    """Check every line of an input file (JSONL; blank lines skipped) for a batch whose endpoint is ``url``.

    Returns ``(lines, errors)``: ``errors`` empty when the batch may run, else its first :data:`MAX_ERRORS`
    problems in line order (``lines`` is then not to be run). An empty file, or one over :data:`MAX_LINES`, is one
    error on line 0.
    """
    lines, errors, seen = [], [], set()
    raws = [(n, raw) for n, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]
    if not raws:
        return [], [LineError("empty_file", "the input file holds no request lines", 0, "input_file_id")]
    if len(raws) > MAX_LINES:
        return [], [LineError("too_many_requests", f"a batch holds at most {MAX_LINES} requests, the file has "
                                                   f"{len(raws)}", 0, "input_file_id")]
    for n, raw in raws:
        got = _check_line(n, raw, url, seen)
        (errors if isinstance(got, LineError) else lines).append(got)
    return lines, errors[:MAX_ERRORS]


def new_batch_id() -> str:
    """``batch_<24 hex>``."""
    return "batch_" + uuid.uuid4().hex[:24]


def result_line(custom_id: str, request_id: str, status: int, body: Any) -> bytes:
    """One JSONL line of the output file (status 200) or the error file (any other status: ``body`` is the
    error body ``{"error": {...}}`` the request was answered with)."""
    return jsonline.line({"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": custom_id,
                          "response": {"status_code": status, "request_id": request_id, "body": body},
                          "error": None})


_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


def batch_view(rec: dict) -> dict:
    """OpenAI's batch object of a stored batch record (timestamps in whole epoch seconds, null when not reached)."""
    status = "cancelling" if rec["status"] == "cancelling" else rec["status"]
    out = {"id": rec["id"], "object": "batch", "endpoint": rec["url"], "errors": rec.get("errors"),
           "input_file_id": rec["input_file_id"], "completion_window": rec["completion_window"], "status": status,
           "output_file_id": rec.get("output_file_id"), "error_file_id": rec.get("error_file_id"),
           "request_counts": rec.get("request_counts") or {"total": 0, "completed": 0, "failed": 0},
           "metadata": rec.get("metadata")}
    for key in _TIMES:
        out[key] = int(rec[key]) if rec.get(key) is not None else None
    return out
