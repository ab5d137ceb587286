"""OpenAI Batch API on the gateway, on the durable jobs (own tenant only; another tenant's batch id is a 404).

* ``POST /v1/batches`` — ``{"input_file_id", "endpoint", "completion_window": "24h", "metadata"?}`` → 200 with the
  batch object (status ``validating``). ``endpoint``: ``/v1/chat/completions``, ``/v1/completions`` or
  ``/v1/responses``; the input file must be the tenant's, with purpose ``batch``. The batch is a job
  (actors/job_store.py): its record is written and its job message published (JetStream, de-duplicated by id)
  before the answer, so an accepted batch is never lost; the jobs actor checks the lines (one bad line fails the
  batch, naming it), runs them at the ``batch`` priority class under the tenant's quotas and budget, and writes
  the output and error files.
* ``GET /v1/batches/{id}``, ``GET /v1/batches?limit=&after=`` (newest first), ``POST /v1/batches/{id}/cancel``
  (``cancelling``: no new line starts; ``cancelled`` with the counts and the partial output once the running
  lines end; a batch not started yet is ``cancelled`` at once).

``metadata``: at most 16 string pairs (keys ≤ 64, values ≤ 512 characters), as OpenAI. The ``/v1/jobs`` API stays
as it is (gateway/jobs_api.py). Over NATS (``as.api.v1.batches.<op>``, gateway/nats_api.py) the same operations
take JSON bodies (:meth:`BatchesApi.operate`). docs/batch.md describes the whole path.
"""

from __future__ import annotations

import logging
import time

import orjson
from aiohttp import web

from actors import job_batches as batch_lines, job_store as store
from bus import subjects
from bus.kv import KvError
from gateway.files_api import FilesApi, page
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

MAX_LIST = 100


def _unavailable() -> ApiError:
    return ApiError(503, "the batch queue is unavailable; retry later", type="unavailable", code="jobs_unavailable",
                    retry_after=1.0)


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")


def _check_metadata(meta) -> dict | None:
    if meta is None:
        return None
    ok = isinstance(meta, dict) and len(meta) <= 16 and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in meta.items())
    if not ok:
        raise ApiError(400, "metadata must be an object of at most 16 string pairs (keys up to 64 characters, "
                            "values up to 512)", param="metadata")
    return meta


class BatchesApi:
    """Batch routes on one gateway. ``files``: the gateway's FilesApi (its stores and ownership check)."""

    def __init__(self, tenancy, js, files_api: FilesApi) -> None:
        self.tenancy, self.js, self.files = tenancy, js, files_api

    def add_routes(self, app: web.Application) -> None:
        """Register the /v1/batches routes."""
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{id}", self.get)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    async def create(self, request: web.Request) -> web.Response:
        """``POST /v1/batches`` (see module docstring). Errors: 400 (field named), 401, 404 (input file), 503."""
        tenant = self.tenancy.authenticate(request)
        return web.json_response(await self.operate("create", tenant.id, await _json_body(request)))

    async def new_record(self, tenant_id: str, body: dict) -> dict:
        """The batch's job record from a create body (checked; the input file must be the tenant's)."""
        endpoint = body.get("endpoint")
        if endpoint not in batch_lines.BATCH_ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(batch_lines.BATCH_ENDPOINTS)}, got {endpoint!r}",
                           param="endpoint")
        if body.get("completion_window") not in batch_lines.WINDOWS:
            raise ApiError(400, f"completion_window must be '24h', got {body.get('completion_window')!r}",
                           param="completion_window")
        meta = _check_metadata(body.get("metadata"))
        fid = body.get("input_file_id")
        if not isinstance(fid, str):
            raise ApiError(400, "input_file_id must be the id of an uploaded file", param="input_file_id")
        try:
            frec = await self.files.own(tenant_id, fid)
        except ApiError as err:
            if err.status == 404:
                raise ApiError(404, err.message, param="input_file_id", code="file_not_found") from None
            raise
        if frec["purpose"] != "batch":
            raise ApiError(400, f"file {fid} has purpose {frec['purpose']!r}; a batch's input file must have "
                                "purpose 'batch'", param="input_file_id")
        now = time.time()
        return {"id": batch_lines.new_batch_id(), "object": "job", "kind": "openai_batch", "tenant": tenant_id,
                "url": endpoint, "endpoint": batch_lines.BATCH_ENDPOINTS[endpoint], "batch": True,
                "input_file_id": fid, "completion_window": body["completion_window"], "metadata": meta,
                "status": "validating", "created_at": now, "expires_at": now + 24 * 3600, "priority": "batch",
                "request_counts": {"total": 0, "completed": 0, "failed": 0}, "errors": None}

    async def submit(self, rec: dict) -> None:
        """Write the record and queue its job message (both before any answer); 503 when either fails."""
        tenant = rec["tenant"]
        try:
            await self.files.kv.create(store.job_key(tenant, rec["id"]), rec)
            await self.js.publish(subjects.jobs_submit(tenant), orjson.dumps({"id": rec["id"], "tenant": tenant}),
                                  msg_id=rec["id"], timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - any store failure is a 503 the client may retry
            log.warning("batch %s not queued: %r", rec["id"], exc)
            try:
                await self.files.kv.delete(store.job_key(tenant, rec["id"]))
            except Exception:  # noqa: BLE001 - best effort: an orphan record without a job expires with the TTL
                pass
            raise _unavailable() from None

    async def own(self, tenant_id: str, batch_id: str) -> dict:
        """The tenant's batch record; ApiError 404 when unknown or another tenant's."""
        if not batch_id.startswith("batch_") or not batch_id[6:].isalnum():
            raise _not_found(batch_id)
        try:
            rec, _ = await store.read_job(self.files.kv, tenant_id, batch_id)
        except (KvError, TimeoutError):
            raise _unavailable() from None
        if rec is None or rec.get("kind") != "openai_batch":
            raise _not_found(batch_id)
        return rec

    async def get(self, request: web.Request) -> web.Response:
        """``GET /v1/batches/{id}``."""
        return await self._http_op("retrieve", request, {"batch_id": request.match_info["id"]})

    async def cancel(self, request: web.Request) -> web.Response:
        """``POST /v1/batches/{id}/cancel`` (idempotent); returns the batch."""
        return await self._http_op("cancel", request, {"batch_id": request.match_info["id"]})

    async def list(self, request: web.Request) -> web.Response:
        """``GET /v1/batches?limit=N&after=ID``: own batches, newest first."""
        return await self._http_op("list", request, dict(request.query))

    async def _http_op(self, op: str, request: web.Request, args: dict) -> web.Response:
        tenant = self.tenancy.authenticate(request)
        return web.json_response(await self.operate(op, tenant.id, args))

    # -- the operations (HTTP routes above; NATS as.api.v1.batches.<op>, gateway/nats_api.py) --------

    async def operate(self, op: str, tenant_id: str, args) -> dict:
        """One Batch operation for ``tenant_id``; the JSON answer (the batch object, or a list page).
        ``create``: the create body; ``retrieve`` / ``cancel``: ``batch_id``; ``list``: ``limit``, ``after``.
        ApiError 400 (field named), 404 (unknown or another tenant's id), 503."""
        if op == "create":
            rec = await self.new_record(tenant_id, args)
            await self.submit(rec)
            return batch_lines.batch_view(rec)
        if op == "list":
            return await self._list(tenant_id, args)
        bid = args.get("batch_id")
        if not isinstance(bid, str) or not bid:
            raise ApiError(400, "batch_id must be a non-empty string", param="batch_id")
        rec = await self.own(tenant_id, bid)
        if op == "retrieve":
            return batch_lines.batch_view(rec)
        if op != "cancel":
            raise ValueError(f"unknown batches operation {op!r}")
        now = time.time()
        try:
            new = await store.update_job(self.files.kv, tenant_id, rec["id"], lambda r: store.cancel(r, now))
        except (KvError, TimeoutError):
            raise _unavailable() from None
        return batch_lines.batch_view(new or rec)

    async def _list(self, tenant_id: str, args) -> dict:
        raw = args.get("limit", 20)
        try:
            limit = int(raw) if not isinstance(raw, bool) else 0
        except (TypeError, ValueError):
            limit = 0
        if not 1 <= limit <= MAX_LIST:
            raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIST}", param="limit")
        try:
            entries = await self.files.kv.values(store.job_key(tenant_id, "*"))  # jobs and batches
        except (KvError, TimeoutError):
            raise _unavailable() from None
        recs = sorted((e.value for e in entries if e.value and e.value.get("kind") == "openai_batch"),
                      key=lambda r: (-r["created_at"], r["id"]))
        return page([batch_lines.batch_view(r) for r in recs], args.get("after"), limit)


async def _json_body(request: web.Request) -> dict:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") \
            from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


__all__ = ["BatchesApi"]
