"""The cluster test's load generator: run inside the load namespace as
``python -m tests.cluster.loadgen PLAN.json OUT.json`` (tests/cluster/stack.py starts it).

It sends ``rate_per_s`` requests a second for ``duration_s`` (streamed chat completions mostly, some
non-streamed chat and streamed text completions; ``temperature`` 1 so that two model runs of one request
give two different texts), round-robin over every gateway address, each with its own ``Idempotency-Key``.
A request that does not complete is retried with the same key and body on the next gateway (at most
``attempts`` attempts, 0.2 s then 0.4 s apart); a gateway that refused or cut a connection is skipped
for 3 s. Async jobs go to ``POST /v1/jobs`` at ``job_times_s``, each with an ``Idempotency-Key``, retried
on 429 / 5xx / transport errors (at most ``job_attempts``, after the answer's ``Retry-After``, at most 2 s),
so a lost 202 never makes a second job.

Every attempt is recorded raw (gateway, times, HTTP status, first content token time, error code and
whether the error said ``retryable``, a digest of the text); tests/cluster/report.py classifies them
once the fault's times are known. An attempt waits at most its deadline + ``grace_s``. The plan names
the gateways' base URLs (https ones are verified against the plan's ``ca``); nothing else is contacted. Prints ``started <monotonic t0>`` when the load
begins (CLOCK_MONOTONIC is one clock for every namespace of this machine).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass

import httpx
import orjson

from tests.chaos.load import RETRYABLE_CODES, RETRYABLE_TYPES, ChaosClient, JobRecord

KINDS = ("chat-stream", "chat-stream", "chat", "completion-stream")


@dataclass
class Attempt:
    """One HTTP attempt of one logical request (raw facts; see tests/cluster/report.py)."""

    key: str  # the Idempotency-Key
    n: int  # logical request number
    attempt: int  # 1, 2, ...
    kind: str
    gateway: int
    sent_at: float
    ended_at: float = 0.0
    first_token_at: float | None = None
    raw: str = "timeout"  # ok | http_error | stream_error | transport | timeout | incomplete | error
    status: int = 0
    retryable: bool = False  # the error said so (Retry-After, in-stream retryable, known code)
    detail: str = ""
    digest: str = ""  # sha256 of the text of a complete answer
    replayed: bool = False  # Idempotent-Replayed: true

    def as_dict(self) -> dict:
        """Plain-dict form (JSON)."""
        return asdict(self)


def text_of(event_or_body: dict, stream: bool) -> str:
    """The generated text in a response body (or one SSE chunk) of a chat or text completion."""
    out = []
    for c in event_or_body.get("choices") or []:
        if stream:
            out.append(((c.get("delta") or {}).get("content") or "") if "delta" in c else (c.get("text") or ""))
        else:
            out.append(((c.get("message") or {}).get("content") or "") if "message" in c else (c.get("text") or ""))
    return "".join(out)


def digest(text: str) -> str:
    """Short sha256 hex of ``text``."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class ClusterClient(ChaosClient):
    """tests/chaos/load.py's client pointed at the namespace hosts' gateways, with idempotency keys,
    retries and raw attempt records."""

    def __init__(self, plan: dict) -> None:
        transport = None
        if plan.get("ca"):  # https gateways: verify against the cluster's CA; no keep-alive (as ChaosClient)
            import ssl
            transport = httpx.AsyncHTTPTransport(verify=ssl.create_default_context(cafile=plan["ca"]),
                                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=0))
        super().__init__(plan["urls"], plan["key"], plan["model"], deadline_ms=plan["deadline_ms"],
                         max_tokens=plan["max_tokens"], grace_s=plan.get("grace_s", 5.0), allow_remote=True,
                         transport=transport)
        self.plan = plan
        self.killed = set(range(len(self.urls)))  # ChaosClient: any refused gateway is skipped for 3 s
        self.attempts: list[Attempt] = []
        self.jobs: list[JobRecord] = []

    def body(self, kind: str, n: int) -> tuple[str, dict]:
        """Path and body of logical request ``n`` (sampled: two runs differ)."""
        path, body = self._body(kind, n)
        body["temperature"] = 1.0
        return path, body

    def _mark_down(self, g: int) -> None:
        self._down_until[g] = time.monotonic() + 3.0

    async def attempt(self, a: Attempt, path: str, body: dict) -> None:
        """Send one attempt and record how it ended (never waits past deadline + grace)."""
        headers = {**self.headers, "Idempotency-Key": a.key}
        url = self.urls[a.gateway] + path
        try:
            async with asyncio.timeout(self.wait_s):
                if body["stream"]:
                    await self._attempt_stream(a, url, body, headers)
                else:
                    await self._attempt_plain(a, url, body, headers)
        except (TimeoutError, httpx.ReadTimeout, httpx.PoolTimeout):
            a.raw, a.detail = "timeout", a.detail or "no final answer within deadline + grace"
            self._mark_down(a.gateway)
        except httpx.TransportError as e:
            a.raw, a.detail = "transport", f"{type(e).__name__}: {e}"[:160]
            self._mark_down(a.gateway)
        except Exception as e:  # noqa: BLE001 - recorded, classified as a failure
            a.raw, a.detail = "error", f"{type(e).__name__}: {e}"[:160]
        a.ended_at = time.monotonic()

    def _http_error(self, a: Attempt, r: httpx.Response, text: str) -> None:  # type: ignore[override]
        a.raw, a.status = "http_error", r.status_code
        try:
            err = orjson.loads(text).get("error") or {}
        except (orjson.JSONDecodeError, AttributeError):
            err = {}
        a.detail = str(err.get("code") or err.get("type") or text[:80])
        a.retryable = (r.status_code == 429 or r.status_code >= 500) and "Retry-After" in r.headers

    async def _attempt_plain(self, a: Attempt, url: str, body: dict, headers: dict) -> None:
        r = await self._http.post(url, json=body, headers=headers)
        text = r.text
        if r.status_code != 200:
            return self._http_error(a, r, text)
        a.status, a.replayed = 200, r.headers.get("Idempotent-Replayed") == "true"
        data = orjson.loads(text)
        choices = data.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            a.raw, a.digest = "ok", digest(text_of(data, False))
        else:
            a.raw, a.detail = "incomplete", f"incomplete body: {text[:120]}"

    async def _attempt_stream(self, a: Attempt, url: str, body: dict, headers: dict) -> None:
        async with self._http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return self._http_error(a, r, (await r.aread()).decode("utf-8", "replace"))
            a.status, a.replayed = 200, r.headers.get("Idempotent-Replayed") == "true"
            finished = done = False
            parts: list[str] = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                event = orjson.loads(payload)
                if "error" in event:
                    err = event["error"] or {}
                    a.raw, a.detail = "stream_error", f"in-stream {err.get('code') or err.get('type')}"
                    a.retryable = (bool(err["retryable"]) if "retryable" in err else
                                   err.get("code") in RETRYABLE_CODES or err.get("type") in RETRYABLE_TYPES)
                    return
                piece = text_of(event, True)
                if piece and a.first_token_at is None:
                    a.first_token_at = time.monotonic()
                parts.append(piece)
                if any(c.get("finish_reason") for c in event.get("choices") or []):
                    finished = True
            if finished and done:
                a.raw, a.digest = "ok", digest("".join(parts))
            else:
                a.raw, a.detail = "incomplete", f"stream ended early (finish={finished}, done={done})"

    async def request(self, kind: str, n: int) -> None:
        """Logical request ``n``: attempts with one Idempotency-Key until one completes (at most
        ``plan["attempts"]``)."""
        key = f"cl-{uuid.uuid4().hex}"
        path, body = self.body(kind, n)
        for i in range(1, self.plan.get("attempts", 3) + 1):
            a = Attempt(key=key, n=n, attempt=i, kind=kind, gateway=self.pick_gateway(), sent_at=time.monotonic())
            self.attempts.append(a)
            self.in_flight += 1
            try:
                await self.attempt(a, path, body)
            finally:
                self.in_flight -= 1
            if a.raw == "ok" or (a.raw == "http_error" and not a.retryable and a.status != 503):
                return
            await asyncio.sleep(min(1.0, 0.2 * i))

    async def job(self, i: int) -> None:
        """Submit async job ``i`` (retried with one Idempotency-Key on refusals and transport errors)."""
        key = f"cl-job-{uuid.uuid4().hex}"
        body = {"endpoint": "/v1/chat/completions", "deadline_ms": 120_000,
                "body": {"model": self.model, "max_tokens": self.plan.get("job_max_tokens", 32), "ignore_eos": True,
                         "messages": [{"role": "user", "content": f"cluster job {i}"}]}}
        for _ in range(self.plan.get("job_attempts", 8)):
            g = self.pick_gateway()
            rec = JobRecord(gateway=g)
            self.jobs.append(rec)
            try:
                async with asyncio.timeout(15):
                    r = await self._http.post(self.urls[g] + "/v1/jobs", json=body,
                                              headers={**self.headers, "Idempotency-Key": key})
            except (TimeoutError, httpx.TransportError) as e:
                rec.submit, rec.detail = "retryable", type(e).__name__
                self._mark_down(g)
                await asyncio.sleep(0.3)
                continue
            if r.status_code in (200, 202):
                rec.submit, rec.id, rec.status = "accepted", r.json()["id"], r.json().get("status", "")
                return
            rec.submit, rec.detail = "retryable" if r.status_code >= 500 or r.status_code == 429 else "failed", \
                f"{r.status_code} {r.text[:120]}"
            if rec.submit == "failed":
                return
            try:
                pause = min(2.0, float(r.headers.get("Retry-After") or 1.0))
            except ValueError:
                pause = 1.0
            await asyncio.sleep(pause)

    async def run(self) -> float:
        """The whole plan; returns t0 (monotonic, when the first request went out)."""
        p = self.plan
        t0 = time.monotonic()
        print(f"started {t0}", flush=True)
        tasks: list[asyncio.Task] = []

        async def jobs() -> None:
            for i, at in enumerate(p.get("job_times_s", ())):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                tasks.append(asyncio.create_task(self.job(p.get("offset", 0) + i)))
        jobs_task = asyncio.create_task(jobs())
        n = int(p["duration_s"] * p["rate_per_s"])
        for i in range(n):
            delay = t0 + i / p["rate_per_s"] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.request(KINDS[i % len(KINDS)], p.get("offset", 0) + i)))
        await jobs_task
        await asyncio.gather(*tasks)
        return t0


async def _main(plan_path: str, out_path: str) -> None:
    plan = json.loads(open(plan_path).read())
    client = ClusterClient(plan)
    try:
        t0 = await client.run()
    finally:
        await client.aclose()
    out = {"t0": t0, "attempts": [a.as_dict() for a in client.attempts],
           "jobs": [j.as_dict() for j in client.jobs]}
    with open(out_path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2]))
