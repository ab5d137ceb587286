"""The jobs actor's work loop: durable jobs from JetStream, run through the normal request path at the
``batch`` priority class, results stored by job id (see actors/job_store.py for the state).

Each job message is processed under an in-progress ack (every ``ACK_WAIT_S / 3`` s) and acknowledged
only after its result is stored, so a crash of this actor (or of nats-server: the stream and the
consumer are file-backed) leads to redelivery, never to a lost job. Re-running a job whose result was
stored is a no-op (its record is terminal). Requests go through gateway.frontend.Frontend (validator →
scheduler → worker) with ``priority: "batch"``, so the scheduler serves interactive traffic first; a
429/503 answer (queue full, no capacity) is retried after its Retry-After until the job's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from actors.aio import cancel_tasks
from actors import job_store as store
from actors.jobs.batch_runner import BatchRunner
from bus import jsonline, streams
from bus.base import BusError
from gateway import pipeline
from gateway.frontend import new_request_id
from gateway.openai_format import ApiError

log = logging.getLogger("actorserve.jobs")

CANCEL_CHECK_S = 0.5
RETRY_STATUSES = (429, 503)  # queue full, no capacity: retried after Retry-After until the job's deadline
FINAL_CODES = ("budget_exhausted",)  # 429s that waiting does not cure within a job's life: the job fails
BUS_RETRY_S = 1.0  # a job whose store calls failed with the bus (timeout, disconnect) runs again after this (s)
BUS_RETRIES = 5  # ... this many times in this process; then it is left to the redelivery (ack wait)


async def _backoff(job_id: str, request_id: str, err: ApiError) -> None:
    """Wait out a retryable answer: its Retry-After, within [0.5, 10] s."""
    log.info("job %s: request %s answered %s %s; retrying", job_id, request_id, err.status, err.code)
    await asyncio.sleep(min(max(err.retry_after or 1.0, 0.5), 10.0))


class JobsService:
    """Consumes ``AS_JOBS`` with at most ``concurrency`` jobs at a time. ``js``: a bus.jetstream.JetStream;
    ``frontend``: a started gateway.frontend.Frontend (its own reply subjects); ``budgets``: a
    gateway.budget_store.BudgetGate (job requests reserve against their tenant's spend budget like the
    gateway's, docs/budgets.md) or None; ``batch_concurrency``: lines of one OpenAI batch in flight at once."""

    def __init__(self, js, frontend, concurrency: int = 4, budgets=None, batch_concurrency: int = 4) -> None:
        self.js, self.fe, self.concurrency, self.budgets = js, frontend, concurrency, budgets
        self.batch_concurrency = batch_concurrency  # lines in flight per OpenAI batch
        self.kv = self.obj = None
        self._sub = None
        self._loop_task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Open the stores, bind the durable consumer (``bus.streams.JOB_RUNNERS``) and start pulling."""
        self.kv, self.obj = await store.open_stores(self.js)
        self._sub = await self.js.pull(streams.JOB_QUEUE, streams.JOB_RUNNERS)
        self._loop_task = asyncio.create_task(self._loop(), name="jobs-loop")

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop pulling; jobs still running are given ``timeout`` seconds, then left unacknowledged
        (another jobs actor, or this one restarted, gets them again)."""
        await cancel_tasks([self._loop_task])
        if self._sub is not None:  # else the bus close waits (5 s) for a fetch reply nobody will read
            await self._sub.stop()
        if self._running:
            _, pending = await asyncio.wait(list(self._running), timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _loop(self) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        while True:
            await slots.acquire()
            try:
                msgs = await self._sub.fetch(1, timeout=1.0)
            except asyncio.CancelledError:
                slots.release()
                raise
            except Exception as exc:
                slots.release()
                log.warning("jobs fetch failed: %r", exc)
                await asyncio.sleep(1.0)
                continue
            if not msgs:
                slots.release()
                continue
            task = asyncio.create_task(self._handle(msgs[0]))
            self._running.add(task)
            task.add_done_callback(lambda t: (self._running.discard(t), slots.release()))

    async def _handle(self, msg) -> None:
        async def progress():
            while True:
                await asyncio.sleep(store.ACK_WAIT_S / 3)
                try:
                    await msg.in_progress()
                except Exception as exc:
                    log.warning("in-progress ack failed: %r", exc)
        ticker = asyncio.create_task(progress())
        try:
            job = orjson.loads(msg.data)
            for attempt in range(1, BUS_RETRIES + 2):
                try:
                    await self.run(job)
                    break
                except (TimeoutError, BusError) as exc:
                    # The bus went away mid-job (nats-server restart): run it again here once the bus is
                    # back (run() is idempotent by job id) rather than wait out the redelivery (ack wait).
                    if attempt > BUS_RETRIES:
                        raise
                    log.warning("job %s: %r; running it again in %.1f s (%d/%d)", job.get("id"), exc,
                                BUS_RETRY_S, attempt, BUS_RETRIES)
                    await asyncio.sleep(BUS_RETRY_S)
        except asyncio.CancelledError:
            raise  # not acked: redelivered
        except Exception:
            log.exception("job message failed; it will be redelivered")
            return
        finally:
            ticker.cancel()
        try:
            await msg.ack()
        except Exception as exc:
            log.warning("ack failed (%r): the job may run again, its stored result makes that a no-op", exc)

    # -- one job ------------------------------------------------------------------------------------

    async def run(self, job: dict) -> None:
        """Run one job message ``{"id", "tenant"}`` to a terminal status (idempotent by job id)."""
        tenant, job_id = job["tenant"], job["id"]
        rec, _ = await store.read_job(self.kv, tenant, job_id)
        if rec is None:
            log.warning("job %s of %s has no record (expired?); dropping", job_id, tenant)
            return
        if rec["status"] in store.TERMINAL:
            return
        if rec.get("kind") == "openai_batch":  # POST /v1/batches: actors/jobs/batch_runner.py
            await BatchRunner(self.kv, self.obj, self._one, self.batch_concurrency).run(rec)
            return
        now = time.time()
        rec = await store.update_job(self.kv, tenant, job_id, lambda r: store.begin(r, now))
        if rec is None or rec["status"] != "in_progress":
            return
        requests = await self._inputs(rec)
        results: list[dict] = []
        counts = {"total": len(requests), "completed": 0, "failed": 0}
        final = "completed"
        for i, req in enumerate(requests):
            status, body = await self._one(rec, req["body"])
            if status == -1:
                final = "cancelled"
                break
            if status == -2:
                final = "expired"
                break
            counts["completed" if status == 200 else "failed"] += 1
            results.append({"id": f"{job_id}-{i}", "custom_id": req.get("custom_id"),
                            "response": {"status_code": status, "body": body} if status == 200 else None,
                            "error": None if status == 200 else {"status_code": status, **(body or {})}})
        await store.update_job(self.kv, tenant, job_id, store.finalizing)
        update: dict = {"request_counts": counts}
        if rec.get("batch"):
            data = b"".join(jsonline.line(r) for r in results)
            await self.obj.put(f"out/{job_id}", data)
            update["output_ref"] = f"out/{job_id}"
        elif results:
            r0 = results[0]
            update["result"] = r0["response"]["body"] if r0["response"] else None
            update["error"] = r0["error"]
            if r0["error"] is not None and final == "completed":
                final = "failed"
        t = time.time()
        await store.update_job(self.kv, tenant, job_id, lambda r: store.finish(r, final, update, t))

    async def _inputs(self, rec: dict) -> list[dict]:
        if rec.get("input_ref"):
            data = orjson.loads(await self.obj.get(rec["input_ref"]))
        else:
            data = rec["input"]
        return data

    async def _one(self, rec: dict, body: dict) -> tuple[int, dict | None]:
        """(status, body) of one request; -1 = job cancelled, -2 = job expired."""
        tenant, job_id, endpoint = rec["tenant"], rec["id"], rec["endpoint"]
        body = {**body, "stream": False, "priority": rec.get("priority", "batch")}
        while True:
            if await self._cancel_requested(tenant, job_id):
                return -1, None
            left_ms = int((rec["expires_at"] - time.time()) * 1000)
            if left_ms <= 0:
                return -2, None
            now = time.time()
            req = pipeline.Request(tenant, endpoint, body, new_request_id(), min(left_ms, 3_600_000),
                                   {"gateway_in": now, "auth_done": now})
            try:
                async with pipeline.admitted(self.fe, req, budgets=self.budgets) as sub:
                    out = await self._attempt(sub, tenant, job_id)
            except ApiError as err:  # not submitted
                if err.status in RETRY_STATUSES and err.code not in FINAL_CODES:
                    await _backoff(job_id, req.request_id, err)
                    continue
                return err.status, err.body()
            if out is None:
                return -1, None
            if out.ok:
                return 200, out.merger.body()
            if out.status in RETRY_STATUSES and time.time() < rec["expires_at"]:
                await _backoff(job_id, req.request_id, out.error)
                continue
            return out.status, out.error.body()

    async def _attempt(self, sub, tenant: str, job_id: str) -> pipeline.Outcome | None:
        """Run one submitted request under the job's cancel watch; None: it failed because the job was
        cancelled meanwhile."""
        watcher = asyncio.create_task(self._watch_cancel(tenant, job_id, sub.request_id, sub.num_choices))
        try:
            out = await pipeline.run(self.fe, sub)
        finally:
            watcher.cancel()
        if not out.ok and watcher.done() and not watcher.cancelled() and watcher.result():
            return None
        return out

    async def _cancel_requested(self, tenant: str, job_id: str) -> bool:
        rec, _ = await store.read_job(self.kv, tenant, job_id)
        return rec is None or rec["status"] in ("cancelling", "cancelled")

    async def _watch_cancel(self, tenant: str, job_id: str, rid: str, num_choices: int) -> bool:
        while True:
            await asyncio.sleep(CANCEL_CHECK_S)
            try:
                requested = await self._cancel_requested(tenant, job_id)
            except (TimeoutError, BusError) as exc:  # the bus is away (restart): keep watching
                log.debug("job %s: cancel check failed: %r", job_id, exc)
                continue
            if requested:
                await self.fe.cancel(rid, "job_cancelled", tenant, num_choices)
                return True
