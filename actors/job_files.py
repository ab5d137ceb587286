"""OpenAI Files on JetStream: file records in the jobs bucket, contents in the jobs object store (state, no HTTP).

Shared by the gateway's Files API (gateway/files_api.py) and the jobs actor (which reads a batch's input file and
writes its output and error files). Layout, beside the job records of actors/job_store.py:

* KV bucket ``as_jobs`` (TTL 7 days): ``f.<tenant>.<file id>`` -> the file record (OpenAI's file object plus the
  tenant and the object's name). Scoped by tenant: another tenant's id is not found, as an unknown one.
* object store ``as_job_data`` (TTL 7 days): ``files/<tenant>/<file id>`` -> the bytes, put in chunks by nats-py
  from a spooled file (an upload is never held whole in memory).

A file lives ``FILE_TTL_S`` (the stores' TTL): ``expires_at`` says when. Limits (environment, read by the gateway):
``ACTORSERVE_FILE_MAX_BYTES`` per file (default 64 MiB; OpenAI allows 200 MB for batch input, our object store
holds 192 MiB in all, job data included) and ``ACTORSERVE_FILE_QUOTA_BYTES`` per tenant (default 128 MiB).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, BinaryIO

from bus import streams

__all__ = ["PURPOSES", "OUTPUT_PURPOSE", "FILE_TTL_S", "new_file_id", "file_key", "object_name", "new_record",
           "public_file", "read_file", "tenant_files", "tenant_bytes", "store_file", "file_bytes", "delete_file",
           "max_file_bytes", "quota_bytes"]

PURPOSES = ("batch", "user_data")  # what a client may upload (OpenAI's purposes this platform can use)
OUTPUT_PURPOSE = "batch_output"  # the purpose of a batch's output and error files (written by the jobs actor)
FILE_TTL_S = streams.JOBS_TTL_S
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_QUOTA_BYTES = 128 * 1024 * 1024
MAX_BYTES_ENV = "ACTORSERVE_FILE_MAX_BYTES"
QUOTA_ENV = "ACTORSERVE_FILE_QUOTA_BYTES"


def _env_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {raw!r}")
    return value


def max_file_bytes() -> int:
    """Bytes one file may hold (``ACTORSERVE_FILE_MAX_BYTES``, default 64 MiB). ValueError naming the variable."""
    return _env_bytes(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)


def quota_bytes() -> int:
    """Bytes one tenant's files may hold together (``ACTORSERVE_FILE_QUOTA_BYTES``, default 128 MiB)."""
    return _env_bytes(QUOTA_ENV, DEFAULT_QUOTA_BYTES)


def new_file_id() -> str:
    """``file-<24 hex>`` (OpenAI's ids look like ``file-abc123``)."""
    return "file-" + uuid.uuid4().hex[:24]


def file_key(tenant: str, file_id: str) -> str:
    """KV key of a file record in ``as_jobs``."""
    return f"f.{tenant}.{file_id}"


def object_name(tenant: str, file_id: str) -> str:
    """Name of a file's bytes in the ``as_job_data`` object store."""
    return f"files/{tenant}/{file_id}"


def new_record(tenant: str, file_id: str, filename: str, purpose: str, size: int, now: float | None = None) -> dict:
    """The stored record of a file of ``size`` bytes (OpenAI's file object + ``tenant``, ``object_name`` and
    ``created_s``, the creation time in epoch seconds with its fraction: lists are ordered by it)."""
    now = time.time() if now is None else now
    return {"id": file_id, "object": "file", "bytes": size, "created_at": int(now), "filename": filename,
            "purpose": purpose, "expires_at": int(now + FILE_TTL_S), "status": "processed", "status_details": None,
            "tenant": tenant, "object_name": object_name(tenant, file_id), "created_s": now}


def public_file(rec: dict) -> dict:
    """OpenAI's file object of a stored record (internal fields dropped)."""
    return {k: v for k, v in rec.items() if k not in ("tenant", "object_name", "created_s")}


async def read_file(kv, tenant: str, file_id: str) -> dict | None:
    """The tenant's file record, or None (unknown, expired, deleted, or another tenant's). ``kv``: bus.kv.KeyValue."""
    e = await kv.get(file_key(tenant, file_id))
    return e.value if e is not None and e.value else None


async def tenant_files(kv, tenant: str) -> list[dict]:
    """Every file record of ``tenant`` (a server-filtered read of ``f.<tenant>.*``), newest first."""
    recs = [e.value for e in await kv.values(file_key(tenant, "*")) if e.value]
    return sorted(recs, key=lambda r: (-r.get("created_s", r["created_at"]), r["id"]))


async def tenant_bytes(kv, tenant: str) -> int:
    """Bytes the tenant's files hold together."""
    return sum(int(r.get("bytes", 0)) for r in await tenant_files(kv, tenant))


async def store_file(kv, obj, rec: dict, data: bytes | BinaryIO) -> dict:
    """Put ``data`` (bytes, or a binary file positioned at its start) under the record's object name, then
    write the record (so a record always has its bytes). ``obj``: bus.jetstream.ObjectStore. Returns ``rec``.
    Raises BusError / KvError from the stores."""
    await obj.put(rec["object_name"], data)
    await kv.put(file_key(rec["tenant"], rec["id"]), rec)
    return rec


async def file_bytes(obj, rec: dict) -> bytes:
    """A file's contents. KeyError when its bytes are gone (expired before the record)."""
    return await obj.get(rec["object_name"])


async def delete_file(kv, obj, rec: dict) -> None:
    """Delete a file: its record first (it stops being listed and found), then its bytes."""
    await kv.delete(file_key(rec["tenant"], rec["id"]))
    try:
        await obj.delete(rec["object_name"])
    except KeyError:
        pass


def purpose_error(purpose: Any) -> str | None:
    """Why ``purpose`` cannot be uploaded, or None when it can."""
    if purpose in PURPOSES:
        return None
    return f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}"
