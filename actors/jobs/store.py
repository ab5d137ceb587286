"""Durable job state shared by the gateway (jobs API) and the jobs actor. JetStream only:

* stream ``AS_JOBS`` (subjects ``as.jobs.submit.<tenant>``, file storage, work-queue retention, 2-minute
  duplicate window): one message per accepted job, published with ``Nats-Msg-Id = job id`` so a retried
  submission is stored once. The jobs actor consumes it with the durable pull consumer ``jobs``
  (explicit ack, ack wait ``ACK_WAIT_S``, in-progress acks while a job runs): a job whose actor dies
  is redelivered, never lost.
* KV bucket ``as_jobs`` (file, TTL ``RESULT_TTL_S``): ``j.<tenant>.<job id>`` → the job record (status,
  timestamps, counts, single-request result). Every write is a compare-and-swap, so the actor and a
  DELETE racing on one job cannot both win; results are written by job id (idempotent).
* object store ``as_job_data`` (file): inputs larger than ``INLINE_MAX`` bytes (``in/<job id>``) and batch
  outputs as JSONL (``out/<job id>``).

Statuses are OpenAI Batch's: validating → in_progress → finalizing → completed | failed | expired,
and cancelling → cancelled.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid

import orjson

STREAM = "AS_JOBS"
CONSUMER = "jobs"
BUCKET = "as_jobs"
OBJECTS = "as_job_data"
ACK_WAIT_S = 10.0
RESULT_TTL_S = 7 * 86400
INLINE_MAX = 256 * 1024
DEFAULT_DEADLINE_MS = 24 * 3600 * 1000
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
TERMINAL = ("completed", "failed", "expired", "cancelled")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "chat": "chat",
             "completions": "completions"}


def submit_subject(tenant: str) -> str:
    """``as.jobs.submit.<tenant>`` (extension of ARCHITECTURE.md's subjects for the jobs stream)."""
    from bus.subjects import _token
    return f"as.jobs.submit.{_token(tenant, 'tenant')}"


def new_job_id(tenant: str = "", idempotency_key: str | None = None) -> str:
    """``job_<24 hex>``: random, or derived from (tenant, Idempotency-Key) so a retry maps to one job."""
    if idempotency_key is None:
        return "job_" + uuid.uuid4().hex[:24]
    return "job_" + hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()[:24]


def job_key(tenant: str, job_id: str) -> str:
    """KV key of a job record (scoped by tenant: another tenant's id is simply not found)."""
    return f"j.{tenant}.{job_id}"


async def open_stores(js) -> tuple[object, object]:
    """Create or bind the stream, the KV bucket and the object store; return ``(kv, objects)``."""
    from nats.js.api import KeyValueConfig, ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig

    try:
        await js.stream_info(STREAM)
    except Exception:
        await js.add_stream(StreamConfig(name=STREAM, subjects=["as.jobs.submit.*"], storage=StorageType.FILE,
                                         retention=RetentionPolicy.WORK_QUEUE, duplicate_window=120,
                                         max_bytes=64 * 1024 * 1024))
    try:
        kv = await js.key_value(BUCKET)
    except Exception:
        kv = await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1, ttl=RESULT_TTL_S,
                                                      storage=StorageType.FILE, max_bytes=128 * 1024 * 1024))
    try:
        obj = await js.object_store(OBJECTS)
    except Exception:
        obj = await js.create_object_store(OBJECTS, ObjectStoreConfig(bucket=OBJECTS, storage=StorageType.FILE,
                                                                      ttl=RESULT_TTL_S,
                                                                      max_bytes=192 * 1024 * 1024))
    return kv, obj


async def read_job(kv, tenant: str, job_id: str) -> tuple[dict | None, int]:
    """``(record, revision)`` or ``(None, 0)``."""
    from nats.js.errors import KeyDeletedError, KeyNotFoundError
    try:
        e = await kv.get(job_key(tenant, job_id))
    except (KeyNotFoundError, KeyDeletedError):
        return None, 0
    return (orjson.loads(e.value), e.revision) if e.value else (None, 0)


async def update_job(kv, tenant: str, job_id: str, change, attempts: int = 50) -> dict | None:
    """CAS-update a job record: ``change(record) -> record | None`` (None = leave as is). Returns the
    record as stored (or as found when unchanged / missing: None)."""
    from nats.js.errors import APIError, KeyWrongLastSequenceError
    for _ in range(attempts):
        rec, rev = await read_job(kv, tenant, job_id)
        if rec is None:
            return None
        new = change(dict(rec))
        if new is None:
            return rec
        new["updated_at"] = time.time()
        try:
            await kv.update(job_key(tenant, job_id), orjson.dumps(new), last=rev)
            return new
        except (KeyWrongLastSequenceError, APIError):
            await asyncio.sleep(0)
    raise TimeoutError(f"job {job_id}: too many concurrent updates")


def public_view(rec: dict) -> dict:
    """The job object returned by the API (internal fields dropped)."""
    return {k: v for k, v in rec.items() if k not in ("tenant", "body_hash", "input_ref")}
