"""OpenAI Files API on the gateway (own tenant only; another tenant's file id is a 404, as an unknown one).

* ``POST /v1/files`` — multipart form: ``file`` (the bytes, with its filename) and ``purpose`` (``batch`` or
  ``user_data``) → 200 with the file object. The upload is streamed to a spooled temporary file (memory up to
  1 MiB, then disk) while its bytes are counted, and from there into the JetStream object store in chunks: it is
  never held whole in memory. Over the per-file limit: 413 ``file_too_large`` naming the limit; over the tenant's
  byte quota: 413 ``file_quota_exceeded`` naming the quota and what is used.
* ``GET /v1/files?purpose=&limit=&after=&order=`` — own files, newest first by default (``order=asc``: oldest
  first), ``limit`` 1-10000 (default 10000, as OpenAI), ``after`` a file id; OpenAI's list shape.
* ``GET /v1/files/{id}`` — the file object; ``GET /v1/files/{id}/content`` — its bytes;
  ``DELETE /v1/files/{id}`` — ``{"id", "object": "file", "deleted": true}``.
* Over NATS (``as.api.v1.files.<op>``, gateway/nats_api.py): the same operations with JSON bodies
  (:meth:`FilesApi.operate`); a file travels whole in one message, so one larger than NATS's ``max_payload`` is
  refused naming that limit (413): use HTTP for it.

State and limits: actors/job_files.py. docs/batch.md describes the whole Files + Batch path.
"""

from __future__ import annotations

import base64
import logging
import tempfile

from aiohttp import web

from actors import job_files as files, job_store as store
from bus.base import BusError
from bus.kv import KvError
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

CHUNK = 256 * 1024  # bytes read from the request per step
SPOOL_MEMORY = 1024 * 1024  # an upload spills to disk past this many bytes
MAX_LIST = 10_000


def unavailable() -> ApiError:
    """503 when the object store or the bucket does not answer."""
    return ApiError(503, "file storage is unavailable; retry later", type="unavailable", code="files_unavailable",
                    retry_after=1.0)


def not_found(file_id: str) -> ApiError:
    """404 for an unknown (or another tenant's) file id."""
    return ApiError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the file is larger than this server's limit of {limit} bytes per file "
                         f"({files.MAX_BYTES_ENV})", param="file", code="file_too_large")


class FilesApi:
    """Files routes on one gateway. ``tenancy``: gateway.tenancy.Tenancy; ``js``: a bus.jetstream.JetStream."""

    def __init__(self, tenancy, js) -> None:
        self.tenancy, self.js = tenancy, js
        self.kv = self.obj = None
        self.max_bytes, self.quota = files.max_file_bytes(), files.quota_bytes()

    async def open(self) -> None:
        """Bind the jobs bucket and object store (created by the jobs API's open if missing)."""
        self.kv, self.obj = await store.open_stores(self.js)

    def add_routes(self, app: web.Application) -> None:
        """Register the /v1/files routes."""
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list)
        app.router.add_get("/v1/files/{id}", self.get)
        app.router.add_get("/v1/files/{id}/content", self.content)
        app.router.add_delete("/v1/files/{id}", self.delete)

    # -- upload ------------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        """``POST /v1/files`` (see module docstring). Errors: 400 (field named), 401, 413, 503."""
        tenant = self.tenancy.authenticate(request)
        if request.content_length is not None and request.content_length > self.max_bytes + 64 * 1024:
            raise _too_large(self.max_bytes)
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "POST /v1/files takes a multipart/form-data body with 'file' and 'purpose'",
                           param="file")
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY) as spool:
            purpose, filename, size = await self._read_form(request, spool)
            used = await self._used(tenant.id)
            if used + size > self.quota:
                raise ApiError(413, f"the tenant's files would hold {used + size} bytes, over its quota of "
                                    f"{self.quota} bytes ({files.QUOTA_ENV}); delete files first",
                               param="file", code="file_quota_exceeded")
            spool.seek(0)
            rec = files.new_record(tenant.id, files.new_file_id(), filename, purpose, size)
            try:
                await files.store_file(self.kv, self.obj, rec, spool)
            except (BusError, KvError, TimeoutError) as exc:
                log.warning("file %s not stored: %r", rec["id"], exc)
                raise unavailable() from None
        return web.json_response(files.public_file(rec))

    async def _read_form(self, request: web.Request, spool) -> tuple[str, str, int]:
        """``(purpose, filename, size)`` of the multipart form, the file's bytes written to ``spool``."""
        reader = await request.multipart()
        purpose = filename = None
        size = -1
        async for part in reader:
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename, size = part.filename or "upload", await self._spool(part, spool)
        if size < 0:
            raise ApiError(400, "the form has no 'file' part", param="file")
        why = files.purpose_error(purpose)
        if why is not None:
            raise ApiError(400, why, param="purpose")
        return purpose, filename, size

    async def _spool(self, part, spool) -> int:
        size = 0
        while chunk := await part.read_chunk(CHUNK):
            size += len(chunk)
            if size > self.max_bytes:
                raise _too_large(self.max_bytes)
            spool.write(chunk)
        return size

    async def _used(self, tenant_id: str) -> int:
        try:
            return await files.tenant_bytes(self.kv, tenant_id)
        except (KvError, TimeoutError) as exc:
            log.warning("files of %s not counted: %r", tenant_id, exc)
            raise unavailable() from None

    # -- read / list / delete ----------------------------------------------------------------------

    async def own(self, tenant_id: str, file_id: str) -> dict:
        """The tenant's file record; ApiError 404 when unknown (or another tenant's), 503 when unreadable."""
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise not_found(file_id)
        try:
            rec = await files.read_file(self.kv, tenant_id, file_id)
        except (KvError, TimeoutError):
            raise unavailable() from None
        if rec is None:
            raise not_found(file_id)
        return rec

    async def get(self, request: web.Request) -> web.Response:
        """``GET /v1/files/{id}``."""
        return await self._http_op("retrieve", request)

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /v1/files/{id}``."""
        return await self._http_op("delete", request)

    async def list(self, request: web.Request) -> web.Response:
        """``GET /v1/files`` (see module docstring)."""
        return await self._http_op("list", request)

    async def _http_op(self, op: str, request: web.Request) -> web.Response:
        tenant = self.tenancy.authenticate(request)
        args = {**request.query, **({"file_id": request.match_info["id"]} if "id" in request.match_info else {})}
        return web.json_response(await self.operate(op, tenant.id, args))

    async def content(self, request: web.Request) -> web.Response:
        """``GET /v1/files/{id}/content``: the bytes (JSONL files as ``application/jsonl``)."""
        tenant = self.tenancy.authenticate(request)
        rec = await self.own(tenant.id, request.match_info["id"])
        data = await self._bytes(rec)
        jsonl = rec["filename"].endswith(".jsonl") or rec["purpose"] in ("batch", files.OUTPUT_PURPOSE)
        return web.Response(body=data, content_type="application/jsonl" if jsonl else "application/octet-stream")

    async def _bytes(self, rec: dict) -> bytes:
        try:
            return await files.file_bytes(self.obj, rec)
        except KeyError:
            raise not_found(rec["id"]) from None
        except (BusError, TimeoutError):
            raise unavailable() from None

    # -- the operations (HTTP routes above; NATS as.api.v1.files.<op>, gateway/nats_api.py) ----------

    async def operate(self, op: str, tenant_id: str, args, max_payload: int | None = None) -> dict:
        """One Files operation for ``tenant_id``; the JSON answer. ``args``: the HTTP query (+ ``file_id`` from
        the path) or the NATS JSON body.

        ``retrieve`` / ``delete`` / ``content`` take ``file_id``; ``list`` takes ``purpose``, ``limit``, ``after``,
        ``order``; ``create`` (NATS only: HTTP uploads are multipart) takes ``purpose``, ``filename`` and the bytes
        as ``content`` (text) or ``content_b64``. ``content`` answers ``{"id", "object": "file.content",
        "content_b64"}``. ``max_payload``: the NATS connection's payload limit, or None over HTTP: a file whose
        content cannot fit one NATS message is refused (413 naming the limit; fetch it over HTTP).
        ApiError 400 (field named), 404 (unknown or another tenant's id), 413, 503."""
        if op == "list":
            return await self._list(tenant_id, args)
        if op == "create":
            return await self._create_json(tenant_id, args, max_payload)
        rec = await self.own(tenant_id, _file_id(args))
        if op == "retrieve":
            return files.public_file(rec)
        if op == "delete":
            try:
                await files.delete_file(self.kv, self.obj, rec)
            except (BusError, KvError, TimeoutError):
                raise unavailable() from None
            return {"id": rec["id"], "object": "file", "deleted": True}
        if op != "content":
            raise ValueError(f"unknown files operation {op!r}")
        if max_payload is not None and rec["bytes"] * 4 // 3 + 1024 > max_payload:
            raise ApiError(413, f"file {rec['id']} ({rec['bytes']} bytes) does not fit one NATS message (this "
                                f"server's max_payload is {max_payload} bytes); fetch it over HTTP: "
                                f"GET /v1/files/{rec['id']}/content", param="file_id", code="payload_too_large")
        return {"id": rec["id"], "object": "file.content",
                "content_b64": base64.b64encode(await self._bytes(rec)).decode()}

    async def _list(self, tenant_id: str, q) -> dict:
        limit = _int_param(q.get("limit"), "limit", MAX_LIST, MAX_LIST)
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
        try:
            recs = await files.tenant_files(self.kv, tenant_id)
        except (KvError, TimeoutError):
            raise unavailable() from None
        if q.get("purpose"):
            recs = [r for r in recs if r["purpose"] == q["purpose"]]
        if order == "asc":
            recs.reverse()
        return page([files.public_file(r) for r in recs], q.get("after"), limit)

    async def _create_json(self, tenant_id: str, args, max_payload: int | None) -> dict:
        """A file sent whole in one NATS message (``content`` text or ``content_b64``)."""
        why = files.purpose_error(args.get("purpose"))
        if why is not None:
            raise ApiError(400, why, param="purpose")
        data = _content_of(args)
        if len(data) > self.max_bytes:
            raise _too_large(self.max_bytes)
        used = await self._used(tenant_id)
        if used + len(data) > self.quota:
            raise ApiError(413, f"the tenant's files would hold {used + len(data)} bytes, over its quota of "
                                f"{self.quota} bytes ({files.QUOTA_ENV}); delete files first",
                           param="file", code="file_quota_exceeded")
        name = args.get("filename") if isinstance(args.get("filename"), str) and args["filename"] else "upload"
        rec = files.new_record(tenant_id, files.new_file_id(), name, args["purpose"], len(data))
        try:
            await files.store_file(self.kv, self.obj, rec, data)
        except (BusError, KvError, TimeoutError):
            raise unavailable() from None
        return files.public_file(rec)


def _file_id(args) -> str:
    fid = args.get("file_id")
    if not isinstance(fid, str) or not fid:
        raise ApiError(400, "file_id must be a non-empty string", param="file_id")
    return fid


def _content_of(args) -> bytes:
    if isinstance(args.get("content"), str):
        return args["content"].encode()
    if isinstance(args.get("content_b64"), str):
        try:
            return base64.b64decode(args["content_b64"], validate=True)
        except (ValueError, TypeError):
            raise ApiError(400, "content_b64 is not valid base64", param="content_b64") from None
    raise ApiError(400, "the file's bytes go in 'content' (text) or 'content_b64'", param="content")


def _int_param(value: str | None, name: str, default: int, most: int) -> int:
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= most:
        raise ApiError(400, f"{name} must be an integer from 1 to {most}", param=name)
    return n


def page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list object of ``items`` (already ordered) from the one after the id ``after``, ``limit`` long."""
    if after:
        idx = next((i for i, r in enumerate(items) if r["id"] == after), None)
        items = items[idx + 1:] if idx is not None else []
    chunk = items[:limit]
    return {"object": "list", "data": chunk, "first_id": chunk[0]["id"] if chunk else None,
            "last_id": chunk[-1]["id"] if chunk else None, "has_more": len(items) > limit}
