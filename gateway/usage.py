"""Usage metering from completion records (``as.int.done.<name>.<version>``).

Completion records are captured by the JetStream stream ``AS_DONE`` (file storage, 7 days, capped), so a
record published while no gateway runs is metered later. Gateways share one durable pull consumer
(``meter``): each record is applied by one replica, then acknowledged (at-least-once: a gateway that
dies between applying and acking can make one record count twice; never zero times).

Applying a record: the tenant's token windows are charged (``QuotaStore.charge_tokens``: prompt +
generated tokens) and the tenant's record ``u.<tenant>`` in KV bucket ``as_usage``
(``{"name@version": {"requests", "prompt_tokens", "completion_tokens", "by_status", "cost_pico"}}``) grows;
``cost_pico`` is the record's cost at the version's prices (pico-USD), settled against the tenant's spend
budget first when it has one (gateway/budget_store.py, docs/budgets.md).
One request fanned out into ``n`` choices
produces ``n`` records (``choice_index`` 0..n-1): it counts as one request and its prompt once.
Streamed, non-streamed and abandoned requests all end in exactly such a record.

Batching (issue [25] item 2, decision 0052): after a fetch that brought records the meter waits until
``min_interval_s`` (0.2 s) has passed since that fetch began before pulling again, so under load one pull, one
usage and one quota write per tenant cover every record of the interval (usage and quota counters lag by at most
that much more; each record is still acknowledged only once applied). ``on_records`` hooks see every record
applied here (the gateway's request metrics, gateway/metrics.py: each record counted by the one gateway that
meters it, without a subscription of their own).
"""

from __future__ import annotations

import asyncio
import logging
import time

from actors.aio import cancel_tasks
from bus import streams
from bus.base import BusError
from bus.messages import CompletionRecord

log = logging.getLogger(__name__)

STREAM = streams.USAGE_STREAM
CONSUMER = streams.USAGE_CONSUMER
BUCKET = streams.USAGE_BUCKET


def is_primary(rec: CompletionRecord) -> bool:
    """True for an unsplit request's record or its first choice's (``choice_index`` 0): count requests and
    the prompt once."""
    return rec.choice_index == 0


def charged_tokens(rec: CompletionRecord) -> int:
    """Tokens a record charges to the tenant's token quotas: generated tokens, plus the prompt once per
    request (on its primary record)."""
    return (int(rec.prompt_tokens or 0) if is_primary(rec) else 0) + int(rec.completion_tokens or 0)


def apply_record(usage: dict | None, rec: CompletionRecord, cost_pico: int = 0) -> dict:
    """The tenant's usage value (``{"name@version": {"requests", "prompt_tokens", "completion_tokens",
    "by_status", "cost_pico"}}``; None = none yet) after one completion record costing ``cost_pico``
    pico-USD. Pure: returns a new dict."""
    primary = is_primary(rec)
    model = f"{rec.name}@{rec.version}"
    cur = dict((usage or {}).get(model, {}))
    by_status = dict(cur.get("by_status", {}))
    by_status[rec.status] = int(by_status.get(rec.status, 0)) + (1 if primary else 0)
    cur.update(requests=int(cur.get("requests", 0)) + (1 if primary else 0),
               prompt_tokens=int(cur.get("prompt_tokens", 0)) + (int(rec.prompt_tokens or 0) if primary else 0),
               completion_tokens=int(cur.get("completion_tokens", 0)) + int(rec.completion_tokens or 0),
               by_status=by_status)
    if cost_pico or "cost_pico" in cur:  # unpriced versions keep no cost field
        cur["cost_pico"] = int(cur.get("cost_pico", 0)) + int(cost_pico)
    return {**(usage or {}), model: cur}


def usage_rows(usage: dict | None) -> list[dict]:
    """API rows of a usage value: ``[{"model", "requests", "prompt_tokens", "completion_tokens",
    "total_tokens", "by_status", "cost_usd"}]`` sorted by model (cost since metering began, USD)."""
    return [{"model": model, "requests": v.get("requests", 0), "prompt_tokens": v.get("prompt_tokens", 0),
             "completion_tokens": v.get("completion_tokens", 0),
             "total_tokens": v.get("prompt_tokens", 0) + v.get("completion_tokens", 0),
             "by_status": v.get("by_status", {}), "cost_usd": int(v.get("cost_pico", 0)) / 1e12}
            for model, v in sorted((usage or {}).items())]


class UsageMeter:
    """Consumes ``AS_DONE`` and keeps per-tenant, per-version usage in KV ``as_usage``.

    ``js``: a ``bus.jetstream.JetStream`` (a ``bus.kv.MemoryBuckets`` will do with ``consume=False``);
    ``quotas``: a QuotaStore (token charges) or None; ``budgets``: a gateway.budget_store.BudgetGate (cost and
    budget settlement) or None (no cost).
    """

    def __init__(self, js, quotas=None, budgets=None, min_interval_s: float = 0.2) -> None:
        self.js, self.quotas, self.budgets = js, quotas, budgets
        self.min_interval_s = min_interval_s  # least time between the starts of two fetches that brought records (s)
        self.on_records: list = []  # hooks ``f(records: list[CompletionRecord])``, called after records are applied
        self.kv = None
        self._task: asyncio.Task | None = None
        self._sub = None

    async def open(self, consume: bool = True) -> None:
        """Bind the bucket; with ``consume``, also the stream and the durable consumer, and start metering."""
        self.kv = await self.js.bucket(streams.USAGE)
        if consume:
            await self.js.ensure_stream(streams.DONE)
            self._sub = await self.js.pull(streams.DONE, streams.METER)
            self._task = asyncio.create_task(self._consume(), name="usage-meter")

    async def close(self) -> None:
        """Stop consuming (unacknowledged records are redelivered to another gateway)."""
        await cancel_tasks([self._task])
        if self._sub is not None:
            await self._sub.stop()

    async def _consume(self) -> None:
        while True:
            t_fetch = time.monotonic()
            try:
                msgs = await self._sub.fetch(100, timeout=1.0)
            except Exception as exc:  # BusError, or anything else: the meter must keep running
                log.warning("usage fetch failed: %r", exc)
                await asyncio.sleep(1.0)
                continue
            await self._meter_batch(msgs)
            if msgs:  # records keep coming: let the next interval's gather in the stream, then take them at once
                await asyncio.sleep(max(0.0, t_fetch + self.min_interval_s - time.monotonic()))

    async def _meter_batch(self, msgs: list) -> None:
        """Apply one fetch's records per tenant, then acknowledge each tenant's (a tenant whose records failed
        to apply is not acknowledged: redelivered after the ack wait); hooks see the records applied."""
        by_tenant: dict[str, list] = {}  # one fetch's records per tenant, metered together (decision 0029)
        for m in msgs:
            try:
                rec = CompletionRecord.decode(m.data)
            except ValueError as exc:
                log.warning("undecodable completion record: %s", exc)
                await self._ack(m)
                continue
            by_tenant.setdefault(rec.tenant, []).append((rec, m))
        for pairs in by_tenant.values():
            try:
                await self.apply_many([rec for rec, _ in pairs])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("metering %d record(s) failed (%r); they will be redelivered", len(pairs), exc)
                continue
            for _, m in pairs:
                await self._ack(m)
            self._tell([rec for rec, _ in pairs])

    def _tell(self, records: list[CompletionRecord]) -> None:
        """Give applied records to the ``on_records`` hooks (a failing hook is logged, never raised)."""
        for hook in self.on_records:
            try:
                hook(records)
            except Exception:
                log.exception("usage record hook failed")

    @staticmethod
    async def _ack(m) -> None:
        try:
            await m.ack()
        except BusError as exc:
            log.warning("ack failed: %r", exc)

    async def apply(self, rec: CompletionRecord) -> None:
        """Meter one completion record: budget settlement and cost (``BudgetGate.settle``), token charge
        (``charged_tokens``) and usage (``apply_record``)."""
        await self.apply_many([rec])

    async def apply_many(self, recs: list[CompletionRecord]) -> None:
        """Meter records of one tenant as :meth:`apply` does one by one, with one compare-and-swap of the
        usage record and of each token window for the lot (``QuotaStore.charge_many``) instead of one per
        record: under load one fetch brings tens of records, and each KV update is a JetStream read and write
        (decision 0029). Budget settlement stays per record (``BudgetGate.settle``: its own idempotency)."""
        recs = [r for r in recs if r.tenant]
        if not recs:
            return
        tenant = recs[0].tenant
        if any(r.tenant != tenant for r in recs):
            raise ValueError("apply_many: records of one tenant only")
        costs = [await self.budgets.settle(r) if self.budgets is not None else 0 for r in recs]
        if self.quotas is not None:
            await self.quotas.charge_many(tenant, [(charged_tokens(r), r.ts or time.time()) for r in recs])

        def add_all(v):
            for r, cost in zip(recs, costs):
                v = apply_record(v, r, cost)
            return v
        await self.kv.update(f"u.{tenant}", add_all)

    async def usage(self, tenant_id: str) -> list[dict]:
        """Usage rows of one tenant (``usage_rows``)."""
        e = await self.kv.get(f"u.{tenant_id}")
        return usage_rows(e.value if e is not None else None)
