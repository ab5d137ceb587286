"""Bounded loopback client mix for the chaos tests, and the classification of every outcome.

:class:`ChaosClient` sends interactive requests (streaming and non-streaming chat completions, plus
streaming and non-streaming text completions) round-robin over the gateways at a fixed rate for a fixed
time, and submits async jobs through ``POST /v1/jobs``. Each request waits at most its deadline + 5 s
(``deadline_ms`` is sent with it); one without a final answer by then is *hung*. Outcomes:

* ``completed`` -- 200 and a complete answer (non-streaming: a choice with a finish_reason; streaming:
  a final chunk with a finish_reason and ``data: [DONE]``, no error event);
* ``retryable`` -- 429 or 5xx with ``Retry-After``; an in-stream error event with ``retryable: true``
  (the gateway's extension field; without it, a code or type that says *try again*:
  :data:`RETRYABLE_CODES` / :data:`RETRYABLE_TYPES`); a connection refused or cut by a gateway that the
  current fault killed (the client then uses the other gateway);
* ``failed`` -- anything else (a 4xx, a 5xx without Retry-After, an unknown error, a transport error
  on a gateway that was not killed, a truncated stream);
* ``hung`` -- no final answer within deadline + 5 s.

Everything is loopback-only and bounded: ``rate_per_s * duration_s`` requests at most per phase.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx
import orjson

# In-stream error codes / types the platform sends with retryable=True (gateway/inflight.py,
# gateway/frontend.py, actors/scheduler, actors/validator, actors/worker): the fallback when an SSE error
# event lacks the ``retryable`` extension field.
RETRYABLE_CODES = frozenset({
    "bus_disconnected", "deadline_exceeded", "deadline_unmeetable", "engine_error", "journal_unavailable",
    "queue_full", "tenant_queue_full", "stream_gap", "stream_overflow", "upstream_timeout", "worker_lost",
    "no_validator", "no_scheduler", "no_worker", "scheduler_unavailable", "worker_draining", "draining",
})
RETRYABLE_TYPES = frozenset({"unavailable", "timeout", "overloaded"})

KINDS = ("chat-stream", "chat", "completion-stream", "completion")


@dataclass
class Outcome:
    """One interactive request: what was sent where, and how it ended."""

    kind: str
    gateway: int
    sent_at: float  # time.monotonic()
    outcome: str = "hung"  # completed | retryable | failed | hung
    status: int = 0  # HTTP status (0: none)
    detail: str = ""  # error code, exception name, ...
    seconds: float = 0.0

    def as_dict(self) -> dict:
        """Plain-dict form (for the JSON report)."""
        return asdict(self)


@dataclass
class JobRecord:
    """One async job submission and its fate."""

    gateway: int
    id: str | None = None  # set when the submission was accepted (202)
    submit: str = "pending"  # accepted | retryable | failed
    status: str = ""  # last job status seen (completed, failed, ...; "missing" after a 404)
    detail: str = ""

    def as_dict(self) -> dict:
        """Plain-dict form (for the JSON report)."""
        return asdict(self)


@dataclass
class PhaseResult:
    """Everything one fault phase produced."""

    name: str
    requests: list[Outcome] = field(default_factory=list)
    jobs: list[JobRecord] = field(default_factory=list)
    fault_at: float | None = None
    fault_note: str = ""
    recovered_s: float | None = None  # from the fault until the stack was steady again

    def counts(self) -> dict[str, int]:
        """The table row: requests sent / completed / retryable / failed / hung, and how many were in
        flight when the fault hit; jobs submitted / completed / failed / lost (lost: accepted but neither
        completed nor failed, or gone) / refused at submission."""
        c = {"sent": len(self.requests)}
        for o in ("completed", "retryable", "failed", "hung"):
            c[o] = sum(r.outcome == o for r in self.requests)
        accepted = [j for j in self.jobs if j.submit == "accepted"]
        c["jobs_submitted"] = len(accepted)
        c["jobs_completed"] = sum(j.status == "completed" for j in accepted)
        c["jobs_failed"] = sum(j.status == "failed" for j in accepted)
        c["jobs_lost"] = c["jobs_submitted"] - c["jobs_completed"] - c["jobs_failed"]
        c["jobs_refused"] = sum(j.submit != "accepted" for j in self.jobs)
        fa = self.fault_at
        c["in_flight_at_fault"] = 0 if fa is None else sum(r.sent_at <= fa < r.sent_at + r.seconds
                                                          for r in self.requests)
        return c

    def as_dict(self) -> dict:
        """Counts plus every request and job (for the JSON report)."""
        return {"name": self.name, "fault_note": self.fault_note, "recovered_s": self.recovered_s,
                "counts": self.counts(), "requests": [r.as_dict() for r in self.requests],
                "jobs": [j.as_dict() for j in self.jobs]}


def _check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"chaos load refuses non-loopback target {url}")


class ChaosClient:
    """Load against ``gateway_urls`` (loopback only) with API key ``key``.

    ``killed`` is the set of gateway indexes the current fault took down: a transport error on one of
    them counts as a retryable failure (and the client then prefers the other gateways for a while);
    on any other gateway it is a non-retryable failure. ``transport``: an httpx transport (unit tests).
    A request waits at most its deadline + ``grace_s``. ``allow_remote``: accept non-loopback gateway
    URLs (the cluster test's network-namespace hosts, tests/cluster/).
    """

    def __init__(self, gateway_urls: list[str], key: str, model: str, *, deadline_ms: int = 10_000,
                 max_tokens: int = 8, grace_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None, allow_remote: bool = False) -> None:
        for u in gateway_urls if not allow_remote else ():
            _check_loopback(u)
        self.urls, self.model = list(gateway_urls), model
        self.headers = {"Authorization": f"Bearer {key}"}
        self.deadline_ms, self.max_tokens, self.grace_s = deadline_ms, max_tokens, grace_s
        self.killed: set[int] = set()
        self.in_flight = 0  # interactive requests sent and not ended yet
        self._down_until: dict[int, float] = {}
        self._rr = itertools.count()
        # No keep-alive: every request opens its own loopback connection, so a restarted gateway never
        # meets a stale pooled socket, and "connection refused" is what a dead gateway looks like.
        self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=0),
                                       timeout=httpx.Timeout(deadline_ms / 1e3 + 10, connect=2.0),
                                       transport=transport)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()

    @property
    def wait_s(self) -> float:
        """How long a client waits for a final answer: the deadline + ``grace_s`` (5 s)."""
        return self.deadline_ms / 1e3 + self.grace_s

    def pick_gateway(self) -> int:
        """Round-robin over the gateways not marked down (a refused gateway is skipped for 3 s)."""
        now = time.monotonic()
        n = len(self.urls)
        for _ in range(n):
            g = next(self._rr) % n
            if self._down_until.get(g, 0.0) <= now:
                return g
        return next(self._rr) % n

    def _transport_error(self, out: Outcome, exc: BaseException) -> None:
        out.detail = type(exc).__name__
        if out.gateway in self.killed:
            out.outcome = "retryable"
            self._down_until[out.gateway] = time.monotonic() + 3.0
        else:
            out.outcome = "failed"
            out.detail += f": {exc}"[:200]

    # -- interactive requests -----------------------------------------------------------------------

    def _body(self, kind: str, i: int) -> tuple[str, dict]:
        body: dict = {"model": self.model, "max_tokens": self.max_tokens, "ignore_eos": True,
                      "deadline_ms": self.deadline_ms, "stream": kind.endswith("-stream")}
        if kind.startswith("chat"):
            body["messages"] = [{"role": "user", "content": f"chaos request {i}"}]
            return "/v1/chat/completions", body
        body["prompt"] = f"chaos request {i}"
        return "/v1/completions", body

    async def one(self, kind: str, i: int) -> Outcome:
        """Send one request of ``kind`` and classify how it ended (never waits past deadline + 5 s)."""
        g = self.pick_gateway()
        out = Outcome(kind=kind, gateway=g, sent_at=time.monotonic())
        path, body = self._body(kind, i)
        self.in_flight += 1
        try:
            async with asyncio.timeout(self.wait_s):
                if body["stream"]:
                    await self._stream(out, self.urls[g] + path, body)
                else:
                    await self._plain(out, self.urls[g] + path, body)
        except (TimeoutError, httpx.ReadTimeout, httpx.PoolTimeout):
            out.outcome, out.detail = "hung", out.detail or "no final answer within deadline + 5 s"
        except httpx.TransportError as e:  # refused, reset, connect timeout, incomplete body
            self._transport_error(out, e)
        except Exception as e:  # noqa: BLE001 - anything unexpected is a (non-retryable) failure
            out.outcome, out.detail = "failed", f"{type(e).__name__}: {e}"[:200]
        finally:
            self.in_flight -= 1
        out.seconds = round(time.monotonic() - out.sent_at, 3)
        return out

    def _http_error(self, out: Outcome, r: httpx.Response, text: str) -> None:
        out.status = r.status_code
        try:
            err = orjson.loads(text).get("error") or {}
        except (orjson.JSONDecodeError, AttributeError):
            err = {}
        out.detail = str(err.get("code") or err.get("type") or text[:80])
        retryable = (r.status_code == 429 or r.status_code >= 500) and "Retry-After" in r.headers
        out.outcome = "retryable" if retryable else "failed"

    async def _plain(self, out: Outcome, url: str, body: dict) -> None:
        r = await self._http.post(url, json=body, headers=self.headers)
        text = r.text
        if r.status_code != 200:
            return self._http_error(out, r, text)
        out.status = 200
        data = orjson.loads(text)
        choices = data.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            out.outcome = "completed"
        else:
            out.outcome, out.detail = "failed", f"incomplete body: {text[:120]}"

    async def _stream(self, out: Outcome, url: str, body: dict) -> None:
        async with self._http.stream("POST", url, json=body, headers=self.headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                return self._http_error(out, r, text)
            out.status = 200
            finished = done = False
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
                    out.detail = f"in-stream {err.get('code') or err.get('type')}"
                    if "retryable" in err:  # the gateway's extension field (status, retryable, retry_after)
                        retry = bool(err["retryable"])
                    else:  # a gateway without it: judge by the code / type
                        retry = err.get("code") in RETRYABLE_CODES or err.get("type") in RETRYABLE_TYPES
                    out.outcome = "retryable" if retry else "failed"
                    return
                if any(c.get("finish_reason") for c in event.get("choices") or []):
                    finished = True
            if finished and done:
                out.outcome = "completed"
            else:
                out.outcome, out.detail = "failed", f"stream ended early (finish={finished}, done={done})"

    async def steady(self, duration_s: float, rate_per_s: float, *, offset: int = 0) -> list[Outcome]:
        """Send ``rate_per_s`` requests a second (kinds in turn) for ``duration_s``; return every outcome
        once each has ended (at most deadline + 5 s after the last was sent)."""
        tasks: list[asyncio.Task] = []
        t0 = time.monotonic()
        n = int(duration_s * rate_per_s)
        for i in range(n):
            delay = t0 + i / rate_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(KINDS[i % len(KINDS)], offset + i)))
        return list(await asyncio.gather(*tasks))

    # -- async jobs ------------------------------------------------------------------------------------

    async def submit_job(self, i: int, max_tokens: int = 8, deadline_ms: int = 120_000) -> JobRecord:
        """``POST /v1/jobs`` (a chat completion) on the next gateway; the record says whether it was
        accepted (202, with the job id) or refused (retryable or not)."""
        g = self.pick_gateway()
        job = JobRecord(gateway=g)
        body = {"endpoint": "/v1/chat/completions", "deadline_ms": deadline_ms,
                "body": {"model": self.model, "max_tokens": max_tokens, "ignore_eos": True,
                         "messages": [{"role": "user", "content": f"chaos job {i}"}]}}
        try:
            async with asyncio.timeout(15):
                r = await self._http.post(self.urls[g] + "/v1/jobs", json=body, headers=self.headers)
        except TimeoutError:
            job.submit, job.detail = "failed", "no answer to POST /v1/jobs within 15 s"
            return job
        except httpx.TransportError as e:
            job.submit = "retryable" if g in self.killed else "failed"
            job.detail = type(e).__name__
            if g in self.killed:
                self._down_until[g] = time.monotonic() + 3.0
            return job
        if r.status_code == 202:
            job.submit, job.id, job.status = "accepted", r.json()["id"], r.json().get("status", "")
        else:
            retry = (r.status_code == 429 or r.status_code >= 500) and "Retry-After" in r.headers
            job.submit, job.detail = ("retryable" if retry else "failed"), f"{r.status_code} {r.text[:120]}"
        return job

    async def wait_jobs(self, jobs: list[JobRecord], timeout_s: float) -> None:
        """Poll every accepted job (any live gateway) until each is terminal or ``timeout_s`` passes;
        a job the API no longer knows (404) is marked ``missing``."""
        t_end = time.monotonic() + timeout_s
        pending = [j for j in jobs if j.submit == "accepted"]
        terminal = ("completed", "failed", "expired", "cancelled")
        while pending and time.monotonic() < t_end:
            for j in list(pending):
                g = self.pick_gateway()
                try:
                    r = await self._http.get(f"{self.urls[g]}/v1/jobs/{j.id}", headers=self.headers, timeout=5)
                except httpx.TransportError:
                    continue
                if r.status_code == 404:
                    j.status, j.detail = "missing", "404 from GET /v1/jobs/{id}"
                    pending.remove(j)
                elif r.status_code == 200:
                    data = r.json()
                    j.status = data.get("status", "")
                    if j.status in terminal:
                        if j.status != "completed":
                            j.detail = str(data.get("error"))[:200]
                        pending.remove(j)
            if pending:
                await asyncio.sleep(0.5)
