"""Usage metering from completion records (``as.int.done.<name>.<version>``).

Completion records are captured by the JetStream stream ``AS_DONE`` (file storage, 7 days, capped), so a
record published while no gateway runs is metered later. Gateways share one durable pull consumer
(``meter``): each record is applied by one replica, then acknowledged (at-least-once: a gateway that
dies between applying and acking can make one record count twice; never zero times).

Applying a record: the tenant's token windows are charged (``QuotaStore.charge_tokens``: prompt +
generated tokens) and the tenant's record ``u.<tenant>`` in KV bucket ``as_usage``
(``{"name@version": {"requests", "prompt_tokens", "completion_tokens", "by_status"}}``) grows.
One request fanned out into ``n`` choices
produces ``n`` records (ids ``<id>-<i>``): it counts as one request and its prompt once.
Streamed, non-streamed and abandoned requests all end in exactly such a record.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time


from bus.messages import CompletionRecord

log = logging.getLogger(__name__)

STREAM = "AS_DONE"
CONSUMER = "meter"
BUCKET = "as_usage"
_CHILD = re.compile(r"^(.+)-(\d+)$")


def is_primary(request_id: str) -> bool:
    """True for a request's own record or its first choice's (``<id>-0``): count requests/prompt once."""
    m = _CHILD.match(request_id)
    return m is None or m.group(2) == "0"


class UsageMeter:
    """Consumes ``AS_DONE`` and keeps per-tenant, per-version usage in KV ``as_usage``.

    ``js``: nats-py JetStreamContext; ``quotas``: a QuotaStore (token charges) or None.
    """

    def __init__(self, js, quotas=None) -> None:
        self.js, self.quotas = js, quotas
        self.kv = None
        self._task: asyncio.Task | None = None
        self._sub = None
        self._locks: dict[str, asyncio.Lock] = {}

    async def open(self, consume: bool = True) -> None:
        """Create / bind the stream, the consumer and the bucket; start consuming when ``consume``."""
        from nats.js.api import KeyValueConfig, StorageType, StreamConfig, ConsumerConfig, AckPolicy

        try:
            await self.js.stream_info(STREAM)
        except Exception:
            await self.js.add_stream(StreamConfig(name=STREAM, subjects=["as.int.done.>"], storage=StorageType.FILE,
                                                  max_age=7 * 86400, max_bytes=64 * 1024 * 1024))
        try:
            self.kv = await self.js.key_value(BUCKET)
        except Exception:
            self.kv = await self.js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1,
                                                                    max_bytes=16 * 1024 * 1024,
                                                                    storage=StorageType.FILE))
        if consume:
            self._sub = await self.js.pull_subscribe(
                "as.int.done.>", durable=CONSUMER, stream=STREAM,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=10000))
            self._task = asyncio.create_task(self._consume(), name="usage-meter")

    async def close(self) -> None:
        """Stop consuming (unacknowledged records are redelivered to another gateway)."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    async def _consume(self) -> None:
        import nats.errors
        while True:
            try:
                msgs = await self._sub.fetch(100, timeout=1.0)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("usage fetch failed: %r", exc)
                await asyncio.sleep(1.0)
                continue
            for m in msgs:
                try:
                    await self.apply(CompletionRecord.decode(m.data))
                except ValueError as exc:
                    log.warning("undecodable completion record: %s", exc)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("metering a record failed (%r); it will be redelivered", exc)
                    continue
                try:
                    await m.ack()
                except Exception as exc:
                    log.warning("ack failed: %r", exc)

    async def apply(self, rec: CompletionRecord) -> None:
        """Meter one completion record (token charge + usage counters)."""
        from gateway.quotas import kv_cas

        if not rec.tenant:
            return
        primary = is_primary(rec.request_id)
        prompt = int(rec.prompt_tokens or 0) if primary else 0
        completion = int(rec.completion_tokens or 0)
        if self.quotas is not None:
            await self.quotas.charge_tokens(rec.tenant, prompt + completion, now=rec.ts or time.time())
        model = f"{rec.name}@{rec.version}"

        def change(v: dict):
            cur = v.setdefault(model, {})
            cur["requests"] = int(cur.get("requests", 0)) + (1 if primary else 0)
            cur["prompt_tokens"] = int(cur.get("prompt_tokens", 0)) + prompt
            cur["completion_tokens"] = int(cur.get("completion_tokens", 0)) + completion
            st = cur.setdefault("by_status", {})
            st[rec.status] = int(st.get(rec.status, 0)) + (1 if primary else 0)
            return v, None
        key = f"u.{rec.tenant}"
        await kv_cas(self.kv, key, change, self._locks.setdefault(key, asyncio.Lock()))

    async def usage(self, tenant_id: str) -> list[dict]:
        """Usage rows of one tenant: ``[{"model": "name@version", "requests", "prompt_tokens",
        "completion_tokens", "total_tokens", "by_status"}]`` sorted by model."""
        from gateway.quotas import kv_read

        rows = []
        for model, v in sorted((await kv_read(self.kv, f"u.{tenant_id}")).items()):
            rows.append({"model": model, "requests": v.get("requests", 0),
                         "prompt_tokens": v.get("prompt_tokens", 0), "completion_tokens": v.get("completion_tokens", 0),
                         "total_tokens": v.get("prompt_tokens", 0) + v.get("completion_tokens", 0),
                         "by_status": v.get("by_status", {})})
        return rows
