"""The jobs actor's runner of OpenAI batches (records of ``kind: "openai_batch"``, see actors/job_batches.py).

One batch, start to end, idempotent (a redelivered batch runs again from its record; its output is written once):

1. read the input file and check every line (:func:`batch_lines.parse_input`); a bad line fails the batch at
   ``validating`` with ``errors`` naming the lines — nothing runs;
2. ``in_progress`` with ``request_counts.total``; lines run ``concurrency`` at a time through the jobs actor's
   request path (``run_line``: validator → scheduler → worker at the ``batch`` priority class, quotas and budget
   as the gateway's; 429 / 503 retried until the batch expires). ``request_counts`` are written every
   ``PROGRESS_S`` seconds while lines finish;
3. a cancel (``cancelling``) stops new lines from starting; lines running are cancelled by the request path;
   lines that never ran are not written. An expiry (24 h) writes each line that did not run to the error file
   with code ``batch_expired``, as OpenAI does;
4. ``finalizing``: the output file (status 200 lines) and the error file (every other status) are stored as
   files of purpose ``batch_output`` with ids derived from the batch id (so a batch run twice after a crash writes
   the same two files, never a second pair), then the terminal status with their ids.

Every line is in exactly one of the two files once the batch ends, or in neither when the batch was cancelled
before it ran. A crash of the jobs actor mid-batch (kill -9) redelivers the job message and the batch runs again
from the start; its files are written only at the end, so no line is written twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from actors.aio import cancel_tasks
from actors import job_batches as batch_lines, job_files as files, job_store as store
from bus import jsonline
from gateway import responses_format as rf
from gateway.openai_format import ApiError

log = logging.getLogger("actorserve.jobs")

PROGRESS_S = 1.0  # request_counts written at most this often while lines finish
CANCELLED, EXPIRED = -1, -2  # run_line's answers for a line stopped by the batch's cancel or expiry

# (record, request body) -> (HTTP status or CANCELLED / EXPIRED, response or error body)
RunLine = Callable[[dict, dict], Awaitable[tuple[int, dict | None]]]


def output_file_id(batch_id: str, which: str) -> str:
    """The id of a batch's ``output`` or ``error`` file: derived from the batch id, so a rerun overwrites."""
    return "file-" + hashlib.sha256(f"{batch_id}\0{which}".encode()).hexdigest()[:24]


def response_from_chat(req: dict, chat: dict) -> dict:
    """The Responses API ``response`` object of a ``/v1/responses`` line, from the chat completion it ran as
    (``req``: gateway.responses_format.parse_request's output)."""
    items, finish = rf.output_from_chat(chat)
    status, incomplete = rf.status_of(finish)
    rec = {"id": "resp_" + uuid.uuid4().hex[:24], "created_at": chat.get("created") or rf.now_s(),
           "status": status, "model": chat.get("model"), "request": rf.public_request(req), "output": items,
           "usage": rf.usage(chat.get("usage")), "error": None, "incomplete_details": incomplete,
           "completed_at": rf.now_s()}
    return rf.response_object(rec)


class BatchRunner:
    """Runs one batch record to its end. ``kv``, ``obj``: the jobs bucket and object store; ``run_line``: the
    jobs service's one-request path (:data:`RunLine`); ``concurrency``: lines in flight per batch."""

    def __init__(self, kv, obj, run_line: RunLine, concurrency: int = 4) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.kv, self.obj, self.run_line, self.concurrency = kv, obj, run_line, concurrency

    async def run(self, rec: dict) -> None:
        """Run ``rec`` (a batch record, not terminal) to a terminal status."""
        lines, errors = await self._lines(rec)
        if errors:
            await self._fail(rec, errors)
            return
        now = time.time()
        counts = {"total": len(lines), "completed": 0, "failed": 0}
        rec = await store.update_job(self.kv, rec["tenant"], rec["id"],
                                     lambda r: store.begin({**r, "request_counts": counts}, now))
        if rec is None or rec["status"] != "in_progress":
            return
        results = await self._run_lines(rec, lines, counts)
        await self._finish(rec, lines, results, counts)

    async def _lines(self, rec: dict) -> tuple[list[batch_lines.BatchLine], list[batch_lines.LineError]]:
        frec = await files.read_file(self.kv, rec["tenant"], rec["input_file_id"])
        try:
            data = await files.file_bytes(self.obj, frec) if frec is not None else None
        except KeyError:
            data = None
        if data is None:
            return [], [batch_lines.LineError("file_not_found", f"the input file {rec['input_file_id']} no longer "
                                                                "exists", 0, "input_file_id")]
        return batch_lines.parse_input(data, rec["url"])

    async def _fail(self, rec: dict, errors: list[batch_lines.LineError]) -> None:
        update = {"errors": {"object": "list", "data": [e.as_dict() for e in errors]}}
        now = time.time()
        await store.update_job(self.kv, rec["tenant"], rec["id"], lambda r: store.finish(r, "failed", update, now))

    async def _run_lines(self, rec: dict, lines: list, counts: dict) -> dict[int, tuple[int, dict | None]]:
        results: dict[int, tuple[int, dict | None]] = {}
        slots = asyncio.Semaphore(self.concurrency)
        stop = asyncio.Event()  # set by a cancel or the expiry: no new line starts

        async def one(line: batch_lines.BatchLine) -> None:
            async with slots:
                if stop.is_set():
                    return
                status, body = await self._line(rec, line)
                if status in (CANCELLED, EXPIRED):
                    stop.set()
                    if status == EXPIRED:
                        results[line.index] = (status, None)
                    return
                results[line.index] = (status, body)
                counts["completed" if status == 200 else "failed"] += 1

        progress = asyncio.create_task(self._progress(rec, counts, stop))
        try:
            await asyncio.gather(*(one(line) for line in lines))
        finally:
            await cancel_tasks([progress])
        if stop.is_set():  # lines that never started after an expiry are expired too
            for line in lines:
                if line.index not in results and time.time() > rec["expires_at"]:
                    results[line.index] = (EXPIRED, None)
        return results

    async def _line(self, rec: dict, line: batch_lines.BatchLine) -> tuple[int, dict | None]:
        if rec["endpoint"] != "responses":
            return await self.run_line(rec, line.body)
        try:
            req = rf.parse_request(line.body)
            if req.get("previous_response_id") or req.get("background") or req.get("stream"):
                raise ApiError(400, "a batch line of /v1/responses cannot use previous_response_id, background or "
                                    "stream", param="previous_response_id")
        except ApiError as err:
            return err.status, err.body()
        status, body = await self.run_line({**rec, "endpoint": "chat"}, rf.chat_body(req, []))
        return (status, response_from_chat(req, body)) if status == 200 else (status, body)

    async def _progress(self, rec: dict, counts: dict, stop: asyncio.Event) -> None:
        """Write ``request_counts`` every PROGRESS_S s; watch for a cancel and the expiry (sets ``stop``)."""
        last = None
        while True:
            await asyncio.sleep(PROGRESS_S)
            try:
                cur, _ = await store.read_job(self.kv, rec["tenant"], rec["id"])
                if cur is None or cur["status"] in ("cancelling", "cancelled") or time.time() > rec["expires_at"]:
                    stop.set()
                if dict(counts) != last:
                    last = dict(counts)
                    await store.update_job(self.kv, rec["tenant"], rec["id"], lambda r: _with_counts(r, last))
            except Exception as exc:  # noqa: BLE001 - progress is advisory: the end writes the counts
                log.debug("batch %s: progress not written: %r", rec["id"], exc)

    async def _finish(self, rec: dict, lines: list, results: dict, counts: dict) -> None:
        bid, tenant = rec["id"], rec["tenant"]
        begun = time.time()
        await store.update_job(self.kv, tenant, bid, lambda r: _finalizing(r, begun))
        out, err = bytearray(), bytearray()
        for line in lines:
            if line.index not in results:
                continue  # cancelled before it ran
            status, body = results[line.index]
            if status == EXPIRED:
                err += _expired_line(line.custom_id)
            else:
                (out if status == 200 else err).extend(batch_lines.result_line(
                    line.custom_id, _request_id(body, bid, line.index), status, body))
        update = {"request_counts": dict(counts), "output_file_id": None, "error_file_id": None}
        if out:
            update["output_file_id"] = await self._store(tenant, bid, "output", bytes(out))
        if err:
            update["error_file_id"] = await self._store(tenant, bid, "error", bytes(err))
        final = "expired" if any(s == EXPIRED for s, _ in results.values()) else "completed"
        now = time.time()
        await store.update_job(self.kv, tenant, bid, lambda r: store.finish(r, final, update, now))

    async def _store(self, tenant: str, bid: str, which: str, data: bytes) -> str:
        fid = output_file_id(bid, which)
        rec = files.new_record(tenant, fid, f"{bid}_{which}.jsonl", files.OUTPUT_PURPOSE, len(data))
        await files.store_file(self.kv, self.obj, rec, data)
        return fid


def _finalizing(rec: dict, now: float) -> dict | None:
    new = store.finalizing(rec)
    return {**new, "finalizing_at": now} if new is not None else None


def _with_counts(rec: dict, counts: dict) -> dict | None:
    return {**rec, "request_counts": counts} if rec["status"] == "in_progress" else None


def _request_id(body: dict | None, bid: str, index: int) -> str:
    rid = (body or {}).get("id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) else f"{bid}-{index}"


def _expired_line(custom_id: str) -> bytes:
    return jsonline.line({"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": custom_id, "response": None,
                          "error": {"code": "batch_expired",
                                    "message": "This request could not be executed before the completion window "
                                               "expired."}})
