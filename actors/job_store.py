"""Durable job state shared by the gateway (jobs API) and the jobs actor. JetStream only:

* stream ``AS_JOBS`` (subjects ``as.jobs.submit.<tenant>``, file storage, work-queue retention, 2-minute
  duplicate window): one message per accepted job, published with ``Nats-Msg-Id = job id`` so a retried
  submission is stored once. The jobs actor consumes it with the durable pull consumer ``jobs``
  (explicit ack, ack wait ``ACK_WAIT_S``, in-progress acks while a job runs): a job whose actor dies
  is redelivered, never lost. Names and configs: bus/streams.py.
* KV bucket ``as_jobs`` (file, TTL ``RESULT_TTL_S``): ``j.<tenant>.<job id>`` → the job record (status,
  timestamps, counts, single-request result). Every write is a compare-and-swap, so the actor and a
  DELETE racing on one job cannot both win; results are written by job id (idempotent).
* object store ``as_job_data`` (file): inputs larger than ``INLINE_MAX`` bytes (``in/<job id>``) and batch
  outputs as JSONL (``out/<job id>``).

Statuses are OpenAI Batch's: validating → in_progress → finalizing → completed | failed | expired,
and cancelling → cancelled. The transitions are the pure functions ``begin``, ``cancel``, ``finalizing``
and ``finish`` (record in, new record or None = no change out).
"""

from __future__ import annotations

import hashlib
import time
import uuid

from bus import streams, subjects

STREAM = streams.JOBS_STREAM
CONSUMER = streams.JOBS_CONSUMER
BUCKET = streams.JOBS_BUCKET
OBJECTS = streams.JOBS_OBJECTS
ACK_WAIT_S = streams.JOB_RUNNERS.ack_wait_s
RESULT_TTL_S = streams.JOBS_TTL_S
INLINE_MAX = 256 * 1024
DEFAULT_DEADLINE_MS = 24 * 3600 * 1000
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
TERMINAL = ("completed", "failed", "expired", "cancelled")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "chat": "chat",
             "completions": "completions"}


def submit_subject(tenant: str) -> str:
    """``as.jobs.submit.<tenant>`` (``bus.subjects.jobs_submit``)."""
    return subjects.jobs_submit(tenant)


def new_job_id(tenant: str = "", idempotency_key: str | None = None) -> str:
    """``job_<24 hex>``: random, or derived from (tenant, Idempotency-Key) so a retry maps to one job."""
    if idempotency_key is None:
        return "job_" + uuid.uuid4().hex[:24]
    return "job_" + hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()[:24]


def job_key(tenant: str, job_id: str) -> str:
    """KV key of a job record (scoped by tenant: another tenant's id is simply not found)."""
    return f"j.{tenant}.{job_id}"


async def open_stores(js) -> tuple[object, object]:
    """Create or bind the stream, the KV bucket and the object store; return ``(kv, objects)``.
    ``js``: a ``bus.jetstream.JetStream``."""
    await js.ensure_stream(streams.JOB_QUEUE)
    return await js.bucket(streams.JOBS), await js.objects(streams.JOB_DATA)


async def read_job(kv, tenant: str, job_id: str) -> tuple[dict | None, int]:
    """``(record, revision)`` or ``(None, 0)``. ``kv``: a ``bus.kv.KeyValue``."""
    e = await kv.get(job_key(tenant, job_id))
    return (e.value, e.revision) if e is not None and e.value else (None, 0)


async def update_job(kv, tenant: str, job_id: str, change) -> dict | None:
    """Compare-and-swap a job record: ``change(record) -> record | None`` (None = leave as is); a
    written record gets ``updated_at``. Returns the record as stored (as found when unchanged; None
    when missing: a missing job is never created). TimeoutError after too many lost races."""
    def stamped(rec: dict | None) -> dict | None:
        new = change(dict(rec)) if rec is not None else None
        return {**new, "updated_at": time.time()} if new is not None else None
    return (await kv.update(job_key(tenant, job_id), stamped)).value


# -- transitions (pure; ``now`` in epoch seconds) -------------------------------------------------

def begin(rec: dict, now: float) -> dict | None:
    """A jobs actor starts (or restarts) the job: ``in_progress`` (attempts + 1), or ``cancelled`` /
    ``expired`` when that is due instead; None for a terminal job."""
    if rec["status"] in TERMINAL:
        return None
    if rec["status"] == "cancelling":
        return {**rec, "status": "cancelled", "cancelled_at": now}
    if now > rec.get("expires_at", now + 1):
        return {**rec, "status": "expired", "expired_at": now}
    return {**rec, "status": "in_progress", "in_progress_at": rec.get("in_progress_at") or now,
            "attempts": int(rec.get("attempts", 0)) + 1}


def cancel(rec: dict, now: float) -> dict | None:
    """``DELETE /v1/jobs/{id}``: a job not started is ``cancelled`` at once, a running one ``cancelling``
    (the jobs actor stops it); None (no change) for a job already ending."""
    if rec["status"] == "validating":
        return {**rec, "status": "cancelled", "cancelled_at": now}
    if rec["status"] in ("in_progress", "finalizing"):
        return {**rec, "status": "cancelling", "cancelling_at": now}
    return None


def finalizing(rec: dict) -> dict | None:
    """All requests ran: ``in_progress`` -> ``finalizing``; None otherwise (cancelling wins)."""
    return {**rec, "status": "finalizing"} if rec["status"] == "in_progress" else None


def finish(rec: dict, final: str, update: dict, now: float) -> dict | None:
    """The terminal status ``final`` (with ``<final>_at`` and the ``update`` fields: counts, result,
    output reference); None when the job already is terminal. A job cancelled while its last request
    was finishing (``cancelling``) ends ``cancelled`` with what it produced, as OpenAI Batch keeps the
    partial results of a cancelled batch: the DELETE answered "cancelling", so "completed" would
    contradict it."""
    if final not in TERMINAL:
        raise ValueError(f"final status must be one of {', '.join(TERMINAL)}, got {final!r}")
    if rec["status"] in TERMINAL:
        return None
    final = "cancelled" if rec["status"] == "cancelling" else final
    return {**rec, **update, "status": final, f"{final}_at": now}


def public_view(rec: dict) -> dict:
    """The job object returned by the API (internal fields dropped)."""
    return {k: v for k, v in rec.items() if k not in ("tenant", "body_hash", "input_ref")}
