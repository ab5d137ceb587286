"""HTTP jobs API (own tenant only; another tenant's job id is a 404, indistinguishable from unknown).

* ``POST /v1/jobs`` — JSON ``{"endpoint": "/v1/chat/completions" | "/v1/completions", "body": {...},
  "deadline_ms"?, "priority"?}`` → 202 with the job object; or a batch: ``Content-Type:
  application/jsonl`` with one OpenAI batch line per request (``{"custom_id", "method": "POST",
  "url": "/v1/chat/completions", "body": {...}}``), optional query ``deadline_ms``.
  ``Idempotency-Key``: the same key and input give the same job (202 replayed); a different input 409.
* ``GET /v1/jobs/{id}`` — the job (status, timestamps, ``request_counts``; ``result`` / ``error`` of a
  single job once completed / failed).
* ``GET /v1/jobs/{id}/results`` — a batch's output as JSONL (``{"id", "custom_id", "response", "error"}``).
* ``GET /v1/jobs?limit=N&after=ID`` — own jobs, newest first, ``has_more`` / ``last_id`` paging.
* ``DELETE /v1/jobs/{id}`` — cancel: a job not started yet is ``cancelled`` at once, a running one goes
  ``cancelling`` and the jobs actor stops it (its current request is cancelled), then ``cancelled``.

The accepted job is durable before the 202 is sent (KV record written, stream publish acknowledged).
"""

from __future__ import annotations

import hashlib
import logging
import time

import orjson
from aiohttp import web

from actors import job_store as store
from bus import jsonline, subjects
from bus.kv import KvConflict, KvError
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

MAX_BATCH_LINES = 10_000


def _unavailable() -> ApiError:
    return ApiError(503, "the job queue is unavailable; retry later", type="unavailable", code="jobs_unavailable",
                    retry_after=1.0)


def _not_found(job_id: str) -> ApiError:
    return ApiError(404, f"No job found with id '{job_id}'.", param="id", code="job_not_found")


class JobsApi:
    """Jobs routes on one gateway. ``tenancy``: gateway.tenancy.Tenancy; ``js``: a bus.jetstream.JetStream."""

    def __init__(self, tenancy, js) -> None:
        self.tenancy, self.js = tenancy, js
        self.kv = self.obj = None

    async def open(self) -> None:
        """Create / bind the jobs stream, bucket and object store."""
        self.kv, self.obj = await store.open_stores(self.js)

    def add_routes(self, app: web.Application) -> None:
        """Register the /v1/jobs routes."""
        app.router.add_post("/v1/jobs", self.create)
        app.router.add_get("/v1/jobs", self.list)
        app.router.add_get("/v1/jobs/{id}", self.get)
        app.router.add_get("/v1/jobs/{id}/results", self.results)
        app.router.add_delete("/v1/jobs/{id}", self.cancel)

    # -- create ------------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        """``POST /v1/jobs`` (see module docstring). Errors: 400, 401, 404 (model), 409, 503."""
        tenant = self.tenancy.authenticate(request)
        raw = await request.read()
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype in ("application/jsonl", "application/x-ndjson", "application/x-jsonlines"):
            endpoint, inputs, deadline_ms, priority = self._parse_batch(raw, request.query)
            batch = True
        else:
            endpoint, inputs, deadline_ms, priority = self._parse_single(raw)
            batch = False
        for i, req in enumerate(inputs):
            try:
                self.tenancy.cache.check_model(tenant, req["body"].get("model"))
            except ApiError as err:
                if batch:
                    raise ApiError(400, f"line {i + 1}: {err.message}", param="model") from None
                raise
        if tenant.priority == "batch" or priority not in ("interactive", "batch"):
            priority = "batch"
        idem = request.headers.get("Idempotency-Key")
        job_id = store.new_job_id(tenant.id, idem) if idem else store.new_job_id()
        data = orjson.dumps(inputs)
        body_hash = hashlib.sha256(orjson.dumps({"e": endpoint, "i": inputs, "b": batch, "d": deadline_ms,
                                                 "p": priority},
                                                option=orjson.OPT_SORT_KEYS)).hexdigest()
        now = time.time()
        rec = {"id": job_id, "object": "job", "tenant": tenant.id, "endpoint": endpoint, "batch": batch,
               "status": "validating", "created_at": now, "expires_at": now + deadline_ms / 1e3,
               "priority": priority, "request_counts": {"total": len(inputs), "completed": 0, "failed": 0},
               "result": None, "error": None, "body_hash": body_hash}
        if len(data) > store.INLINE_MAX:
            await self.obj.put(f"in/{job_id}", data)
            rec["input_ref"] = f"in/{job_id}"
        else:
            rec["input"] = inputs
        try:
            await self.kv.create(store.job_key(tenant.id, job_id), rec)
        except KvConflict:
            old, _ = await store.read_job(self.kv, tenant.id, job_id)
            if old is None or old.get("body_hash") != body_hash:
                raise ApiError(409, "Idempotency-Key was already used with a different job input",
                               param="Idempotency-Key", code="idempotency_key_conflict") from None
            return web.json_response(self._view(old), status=202, headers={"Idempotent-Replayed": "true"})
        except KvError as exc:
            log.warning("job %s not stored: %r", job_id, exc)
            raise _unavailable() from None
        try:
            await self.js.publish(subjects.jobs_submit(tenant.id), orjson.dumps({"id": job_id, "tenant": tenant.id}),
                                  msg_id=job_id, timeout=5.0)
        except Exception as exc:
            log.warning("job %s not queued: %r", job_id, exc)
            try:
                await self.kv.delete(store.job_key(tenant.id, job_id))
            except Exception:
                pass
            raise _unavailable() from None
        return web.json_response(self._view(rec), status=202)

    @staticmethod
    def _deadline(value) -> int:
        if value is None:
            return store.DEFAULT_DEADLINE_MS
        try:
            ms = int(value)
        except (TypeError, ValueError):
            ms = -1
        if isinstance(value, bool) or not 0 < ms <= 7 * 86400 * 1000:
            raise ApiError(400, "deadline_ms must be an integer between 1 and 604800000", param="deadline_ms")
        return ms

    def _parse_single(self, raw: bytes):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") \
                from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the request body must be a JSON object")
        endpoint = store.ENDPOINTS.get(obj.get("endpoint"))
        if endpoint is None:
            raise ApiError(400, "endpoint must be /v1/chat/completions or /v1/completions", param="endpoint")
        body = obj.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise ApiError(400, "body must be a request object with a model", param="body")
        return endpoint, [{"body": body}], self._deadline(obj.get("deadline_ms")), obj.get("priority", "batch")

    def _parse_batch(self, raw: bytes, query):
        inputs, endpoint = [], None
        lines = [ln for ln in raw.splitlines() if ln.strip()]
        if not lines or len(lines) > MAX_BATCH_LINES:
            raise ApiError(400, f"a batch needs 1 to {MAX_BATCH_LINES} JSONL lines")
        for i, ln in enumerate(lines, 1):
            try:
                obj = orjson.loads(ln)
            except orjson.JSONDecodeError as exc:
                raise ApiError(400, f"line {i}: invalid JSON: {exc}", code="invalid_json") from None
            ep = store.ENDPOINTS.get(obj.get("url")) if isinstance(obj, dict) else None
            if ep is None or not isinstance(obj.get("body"), dict) or not isinstance(obj["body"].get("model"), str):
                raise ApiError(400, f"line {i}: needs url /v1/chat/completions or /v1/completions and a body "
                                    "with a model", param="url")
            if endpoint not in (None, ep):
                raise ApiError(400, f"line {i}: all lines of a batch must use the same url", param="url")
            endpoint = ep
            inputs.append({"custom_id": obj.get("custom_id"), "body": obj["body"]})
        return endpoint, inputs, self._deadline(query.get("deadline_ms")), query.get("priority", "batch")

    @staticmethod
    def _view(rec: dict) -> dict:
        return {k: v for k, v in store.public_view(rec).items() if k not in ("input",)}

    # -- read / list / cancel ----------------------------------------------------------------------

    async def _own(self, request: web.Request) -> tuple[object, dict, str]:
        tenant = self.tenancy.authenticate(request)
        job_id = request.match_info["id"]
        if not job_id.startswith("job_") or not job_id[4:].isalnum():
            raise _not_found(job_id)
        rec, _ = await store.read_job(self.kv, tenant.id, job_id)
        if rec is None:
            raise _not_found(job_id)
        return tenant, rec, job_id

    async def get(self, request: web.Request) -> web.Response:
        """``GET /v1/jobs/{id}``: the caller's job or 404."""
        _, rec, _ = await self._own(request)
        return web.json_response(self._view(rec))

    async def results(self, request: web.Request) -> web.Response:
        """``GET /v1/jobs/{id}/results``: JSONL output of a finished batch (a single job: its result line)."""
        _, rec, job_id = await self._own(request)
        if rec["status"] not in store.TERMINAL:
            raise ApiError(409, f"job {job_id} is {rec['status']}; results come when it is finished",
                           code="job_not_finished")
        if rec.get("output_ref"):
            data = await self.obj.get(rec["output_ref"])
        else:
            data = jsonline.line({"id": job_id, "custom_id": None, "response": None if rec.get("error") else
                                  {"status_code": 200, "body": rec.get("result")}, "error": rec.get("error")})
        return web.Response(body=data, content_type="application/jsonl")

    async def list(self, request: web.Request) -> web.Response:
        """``GET /v1/jobs?limit=N&after=ID``: own jobs, newest first."""
        tenant = self.tenancy.authenticate(request)
        try:
            limit = max(1, min(100, int(request.query.get("limit", "20"))))
        except ValueError:
            raise ApiError(400, "limit must be an integer", param="limit") from None
        recs = [e.value for e in await self.kv.values(store.job_key(tenant.id, "*"))  # server-filtered
                if e.value and e.value.get("kind") != "openai_batch"]  # batches are listed by /v1/batches
        recs.sort(key=lambda r: (-r["created_at"], r["id"]))
        after = request.query.get("after")
        if after:
            idx = next((i for i, r in enumerate(recs) if r["id"] == after), None)
            recs = recs[idx + 1:] if idx is not None else []
        page = recs[:limit]
        return web.json_response({"object": "list", "data": [self._view(r) for r in page],
                                  "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None, "has_more": len(recs) > limit})

    async def cancel(self, request: web.Request) -> web.Response:
        """``DELETE /v1/jobs/{id}``: cancel (idempotent); returns the job."""
        tenant, _, job_id = await self._own(request)
        now = time.time()
        rec = await store.update_job(self.kv, tenant.id, job_id, lambda r: store.cancel(r, now))
        if rec is None:
            raise _not_found(job_id)
        return web.json_response(self._view(rec))
