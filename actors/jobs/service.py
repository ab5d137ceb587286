"""The jobs actor's work loop: durable jobs from JetStream, run through the normal request path at the
``batch`` priority class, results stored by job id (see actors/jobs/store.py for the state).

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

from actors.jobs import store

log = logging.getLogger("actorserve.jobs")

CANCEL_CHECK_S = 0.5


class JobsService:
    """Consumes ``AS_JOBS`` with at most ``concurrency`` jobs at a time. ``js``: JetStreamContext;
    ``frontend``: a started gateway.frontend.Frontend (its own reply subjects)."""

    def __init__(self, js, frontend, concurrency: int = 4) -> None:
        self.js, self.fe, self.concurrency = js, frontend, concurrency
        self.kv = self.obj = None
        self._sub = None
        self._loop_task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Open the stores, bind the durable consumer and start pulling."""
        from nats.js.api import AckPolicy, ConsumerConfig

        self.kv, self.obj = await store.open_stores(self.js)
        self._sub = await self.js.pull_subscribe(
            "as.jobs.submit.*", durable=store.CONSUMER, stream=store.STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=store.ACK_WAIT_S, max_deliver=-1))
        self._loop_task = asyncio.create_task(self._loop(), name="jobs-loop")

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop pulling; jobs still running are given ``timeout`` seconds, then left unacknowledged
        (another jobs actor, or this one restarted, gets them again)."""
        if self._loop_task:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._running:
            _, pending = await asyncio.wait(list(self._running), timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _loop(self) -> None:
        import nats.errors
        slots = asyncio.Semaphore(self.concurrency)
        while True:
            await slots.acquire()
            try:
                msgs = await self._sub.fetch(1, timeout=1.0)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                slots.release()
                continue
            except asyncio.CancelledError:
                slots.release()
                raise
            except Exception as exc:
                slots.release()
                log.warning("jobs fetch failed: %r", exc)
                await asyncio.sleep(1.0)
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
            await self.run(job)
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
        now = time.time()

        def begin(r: dict):
            if r["status"] in store.TERMINAL:
                return None
            if r["status"] == "cancelling":
                return {**r, "status": "cancelled", "cancelled_at": now}
            if now > r.get("expires_at", now + 1):
                return {**r, "status": "expired", "expired_at": now}
            return {**r, "status": "in_progress", "in_progress_at": r.get("in_progress_at") or now,
                    "attempts": int(r.get("attempts", 0)) + 1}
        rec = await store.update_job(self.kv, tenant, job_id, begin)
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
        await store.update_job(self.kv, tenant, job_id, lambda r: {**r, "status": "finalizing"}
                               if r["status"] == "in_progress" else None)
        update: dict = {"request_counts": counts}
        if rec.get("batch"):
            data = b"".join(orjson.dumps(r) + b"\n" for r in results)
            await self.obj.put(f"out/{job_id}", data)
            update["output_ref"] = f"out/{job_id}"
        elif results:
            r0 = results[0]
            update["result"] = r0["response"]["body"] if r0["response"] else None
            update["error"] = r0["error"]
            if r0["error"] is not None and final == "completed":
                final = "failed"
        t = time.time()
        await store.update_job(self.kv, tenant, job_id, lambda r: None if r["status"] in store.TERMINAL else {
            **r, **update, "status": final, f"{final}_at": t})

    async def _inputs(self, rec: dict) -> list[dict]:
        if rec.get("input_ref"):
            res = await self.obj.get(rec["input_ref"])
            data = orjson.loads(res.data)
        else:
            data = rec["input"]
        return data

    async def _one(self, rec: dict, body: dict) -> tuple[int, dict | None]:
        """(status, body) of one request; -1 = job cancelled, -2 = job expired."""
        from gateway.frontend import new_request_id
        from gateway.merge import ChoiceMerger
        from gateway.openai_format import ApiError

        tenant, job_id, endpoint = rec["tenant"], rec["id"], rec["endpoint"]
        body = {**body, "stream": False, "priority": rec.get("priority", "batch")}
        while True:
            if await self._cancel_requested(tenant, job_id):
                return -1, None
            left_ms = int((rec["expires_at"] - time.time()) * 1000)
            if left_ms <= 0:
                return -2, None
            rid = new_request_id()
            try:
                sub = await self.fe.submit(tenant=tenant, endpoint=endpoint, body=body, request_id=rid,
                                           deadline_ms=min(left_ms, 3_600_000),
                                           marks={"gateway_in": time.time(), "auth_done": time.time()})
            except ApiError as err:
                if err.status in (429, 503):
                    log.info("job %s: %s %s; retrying", job_id, err.status, err.code)
                    await asyncio.sleep(min(max(err.retry_after or 1.0, 0.5), 10.0))
                    continue
                return err.status, err.body()
            merger = ChoiceMerger(sub.endpoint, sub.request_id, sub.model, body, sub.marks, sub.num_choices)
            watcher = asyncio.create_task(self._watch_cancel(tenant, job_id, rid, sub.num_choices))
            error = None
            try:
                async for chunk in self.fe.stream(sub):
                    if chunk.error:
                        error = ApiError.from_chunk_error(chunk.error)
                        break
                    merger.add(chunk)
            except Exception as exc:  # StreamError: deadline, lost worker ...
                error = self.fe.resolve_error(exc) if hasattr(exc, "error") else ApiError(500, str(exc))
            finally:
                watcher.cancel()
                self.fe.table.close(rid)
            if error is None:
                return 200, merger.body()
            if watcher.done() and not watcher.cancelled() and watcher.result():
                return -1, None
            if error.status in (429, 503) and time.time() < rec["expires_at"]:
                log.info("job %s: request %s ended with %s %s; retrying", job_id, rid, error.status, error.code)
                await asyncio.sleep(min(max(error.retry_after or 1.0, 0.5), 10.0))
                continue
            return error.status, error.body()

    async def _cancel_requested(self, tenant: str, job_id: str) -> bool:
        rec, _ = await store.read_job(self.kv, tenant, job_id)
        return rec is None or rec["status"] in ("cancelling", "cancelled")

    async def _watch_cancel(self, tenant: str, job_id: str, rid: str, num_choices: int) -> bool:
        while True:
            await asyncio.sleep(CANCEL_CHECK_S)
            if await self._cancel_requested(tenant, job_id):
                await self.fe.cancel(rid, "job_cancelled", tenant, num_choices)
                return True
