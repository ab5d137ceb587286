"""Per-tenant quotas shared by every gateway replica, in a NATS JetStream key-value bucket.

Why JetStream KV and not etcd (docs/decisions/0008-tenancy.md): a compare-and-swap on a KV key is
one round trip to nats-server with no Raft fsync on the request path, etcd holds only slow-changing
state (docs/architecture.md), and the same bucket family also serves idempotency records and usage.

Keys in bucket ``as_quota`` (values JSON):

* ``rpm.<tenant>``: ``{"b": {"<epoch second>": requests}}`` — admitted requests per 1-second bucket;
* ``tpm.<tenant>``: ``{"b": {"<epoch second>": tokens}}`` — tokens charged per 1-second bucket;
* ``day.<tenant>.<YYYYMMDD>``: ``{"t": tokens}`` — tokens charged in one UTC day;
* ``conc.<tenant>``: ``{"s": {"<request id>": expires_at}}`` — concurrency slots.

Windows are sliding 60-second windows at 1-second resolution: a request is admitted only if the
buckets of the last 60 seconds (the current one included) hold fewer than ``rpm`` requests, and the
count is incremented in the same compare-and-swap, so no interleaving of replicas can admit more
than ``rpm`` requests in any 60-second window. Token quotas are checked before a request (refused
once the window or the day is used up) and charged afterwards from completion records
(``gateway/usage.py``) by tokens actually processed: prompt + generated tokens, the same for
streamed, non-streamed and abandoned requests. Concurrency slots carry an expiry (``SLOT_TTL_S``)
that the owning gateway extends every ``SLOT_TTL_S / 3`` s; a dead gateway's slots lapse by
themselves (a lease). Time is wall-clock seconds (replicas on one host or NTP-synchronised hosts).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from actors.aio import cancel_tasks
from bus import streams
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

BUCKET = streams.QUOTA_BUCKET
WINDOW_S = 60
SLOT_TTL_S = 15.0


# -- rules (pure: values in, values out; ``now`` in epoch seconds) -----------------------------------

def day(ts: float) -> str:
    """UTC day of epoch second ``ts`` as ``YYYYMMDD`` (the key suffix of daily token counts)."""
    return time.strftime("%Y%m%d", time.gmtime(ts))


def window_sum(buckets: dict[str, int], now: float) -> tuple[int, dict[str, int], float | None]:
    """(sum over the last 60 s, pruned buckets, epoch second of the oldest bucket still counted)."""
    lo = int(now) - WINDOW_S + 1
    kept = {k: int(v) for k, v in buckets.items() if int(k) >= lo}
    oldest = min((int(k) for k in kept), default=None)
    return sum(kept.values()), kept, oldest


def window_add(value: dict | None, amount: int, now: float) -> dict:
    """A window value (``{"b": {second: count}}``) pruned to the last 60 s with ``amount`` added at ``now``."""
    _, kept, _ = window_sum((value or {}).get("b", {}), now)
    k = str(int(now))
    kept[k] = kept.get(k, 0) + int(amount)
    return {"b": kept}


def rpm_take(value: dict | None, rpm: int, now: float) -> dict | None:
    """The rpm window with one more request, or None (refused) when ``rpm`` requests are already counted."""
    used, _, _ = window_sum((value or {}).get("b", {}), now)
    return None if used >= rpm else window_add(value, 1, now)


def day_add(value: dict | None, tokens: int) -> dict:
    """A daily count (``{"t": tokens}``) grown by ``tokens``."""
    return {"t": int((value or {}).get("t", 0)) + int(tokens)}


def slot_take(value: dict | None, request_id: str, limit: int, now: float) -> dict | None:
    """Slots (``{"s": {request id: expires_at}}``) without lapsed ones plus ``request_id`` (lease
    ``SLOT_TTL_S``), or None (refused) when ``limit`` live slots are taken."""
    slots = {rid: exp for rid, exp in (value or {}).get("s", {}).items() if exp > now}
    if len(slots) >= limit:
        return None
    return {"s": {**slots, request_id: now + SLOT_TTL_S}}


def slot_release(value: dict | None, request_id: str) -> dict | None:
    """Slots without ``request_id``; None (no write) when it holds none."""
    slots = (value or {}).get("s", {})
    if request_id not in slots:
        return None
    return {"s": {r: e for r, e in slots.items() if r != request_id}}


def slot_refresh(value: dict | None, mine: set[str], now: float) -> dict:
    """Slots with the leases of ``mine`` (this gateway's requests) extended to ``now + SLOT_TTL_S`` and
    other lapsed ones dropped."""
    slots = {r: e for r, e in (value or {}).get("s", {}).items() if e > now or r in mine}
    return {"s": {**slots, **{r: now + SLOT_TTL_S for r in mine}}}


def _reset_s(oldest: float | None, now: float) -> float:
    """Seconds until the oldest counted bucket leaves the window (0 if nothing is counted)."""
    return 0.0 if oldest is None else max(0.0, oldest + WINDOW_S - now)


def _fmt_reset(seconds: float) -> str:
    """OpenAI-style reset duration (``"1m3s"``, ``"12s"``, ``"0s"``)."""
    s = int(math.ceil(seconds))
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


@dataclass
class Admission:
    """A request admitted by :meth:`QuotaStore.admit`; ``headers`` are the x-ratelimit-* values."""

    tenant: str
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)
    slot: bool = False  # holds a concurrency slot (release it with QuotaStore.release)


class QuotaStore:
    """Quota checks and charges on the ``as_quota`` KV bucket (bus.kv).

    ``js``: what opens buckets (``bus.jetstream.JetStream``, or ``bus.kv.MemoryBuckets`` in tests).
    ``await open()`` creates / binds the bucket. Every call is bounded by ``timeout`` seconds per KV
    operation; a store that cannot be reached fails open (the request is admitted and a warning
    logged): quotas protect fairness, not safety.
    """

    def __init__(self, js, *, timeout: float = 2.0) -> None:
        self.js = js
        self.timeout = timeout
        self.kv = None
        self._slots: dict[str, set[str]] = {}  # tenant -> request ids holding a slot on this gateway
        self._refresher: asyncio.Task | None = None

    async def open(self) -> None:
        """Create or bind the bucket (``bus.streams.QUOTAS``) and start the slot-refresh task."""
        self.kv = await self.js.bucket(streams.QUOTAS, self.timeout)
        self._refresher = asyncio.create_task(self._refresh_slots(), name="quota-slot-refresh")

    async def close(self) -> None:
        """Stop refreshing slots (they then lapse within SLOT_TTL_S)."""
        await cancel_tasks([self._refresher])

    async def _read(self, key: str) -> dict:
        e = await self.kv.get(key)
        return e.value if e is not None and isinstance(e.value, dict) else {}

    # -- admission ------------------------------------------------------------------------------

    async def admit(self, tenant, request_id: str, now: float | None = None) -> Admission:
        """Admit one request of ``tenant`` (a control.state.tenants.Tenant) or raise ApiError 429.

        Order: token windows (read-only), concurrency slot, then the rpm window (CAS). The 429 carries
        Retry-After (s) and the x-ratelimit-* headers of the exhausted quota."""
        now = time.time() if now is None else now
        adm = Admission(tenant.id, request_id)
        rpm, tpm = tenant.quota("rpm"), tenant.quota("tpm")
        conc, daily = tenant.quota("concurrency"), tenant.quota("daily_tokens")
        try:
            if tpm is not None:
                used, _, oldest = window_sum((await self._read(f"tpm.{tenant.id}")).get("b", {}), now)
                adm.headers.update(_headers("tokens", tpm, max(0, tpm - used), _reset_s(oldest, now)))
                if used >= tpm:
                    raise _too_many("tokens per minute", tenant.id, tpm, _reset_s(oldest, now), adm.headers)
            if daily is not None:
                used = int((await self._read(f"day.{tenant.id}.{day(now)}")).get("t", 0))
                if used >= daily:
                    until = 86400 - (now % 86400)
                    raise _too_many("tokens per day", tenant.id, daily, until, adm.headers)
            if conc is not None:
                if not await self._take_slot(tenant.id, request_id, conc, now):
                    raise _too_many("concurrent requests", tenant.id, conc, 1.0, adm.headers)
                adm.slot = True
            if rpm is not None:
                res = await self.kv.update(f"rpm.{tenant.id}", lambda v: rpm_take(v, rpm, now))
                ok, (used, _, oldest) = res.changed, window_sum((res.value or {}).get("b", {}), now)
                reset = _reset_s(oldest, now)
                adm.headers.update(_headers("requests", rpm, max(0, rpm - used), reset))
                if not ok:
                    if adm.slot:
                        await self.release(adm)
                    raise _too_many("requests per minute", tenant.id, rpm, reset, adm.headers)
        except ApiError:
            raise
        except Exception as exc:  # store unreachable: fail open, loudly
            log.warning("quota store unavailable for %s (%r); admitting", tenant.id, exc)
        return adm

    async def _take_slot(self, tenant_id: str, request_id: str, limit: int, now: float) -> bool:
        ok = (await self.kv.update(f"conc.{tenant_id}", lambda v: slot_take(v, request_id, limit, now))).changed
        if ok:
            self._slots.setdefault(tenant_id, set()).add(request_id)
        return ok

    async def release(self, adm: Admission) -> None:
        """Give back the concurrency slot of an admitted request (idempotent; errors are logged)."""
        if not adm.slot:
            return
        adm.slot = False
        self._slots.get(adm.tenant, set()).discard(adm.request_id)
        try:
            await self.kv.update(f"conc.{adm.tenant}", lambda v: slot_release(v, adm.request_id))
        except Exception as exc:
            log.warning("slot release of %s failed (%r); it lapses in %.0f s", adm.request_id, exc, SLOT_TTL_S)

    async def _refresh_slots(self) -> None:
        while True:
            await asyncio.sleep(SLOT_TTL_S / 3)
            for tenant_id, rids in list(self._slots.items()):
                if not rids:
                    continue
                mine, now = set(rids), time.time()
                try:
                    await self.kv.update(f"conc.{tenant_id}", lambda v, mine=mine, now=now: slot_refresh(v, mine, now))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("slot refresh for %s failed: %r", tenant_id, exc)

    # -- token charges ------------------------------------------------------------------------------

    async def charge_tokens(self, tenant_id: str, tokens: int, now: float | None = None) -> None:
        """Charge ``tokens`` to the tenant's tokens-per-minute window and its UTC day (always recorded,
        whether or not the tenant has token quotas, so that a quota set later sees current use)."""
        if tokens <= 0:
            return
        now = time.time() if now is None else now
        await self.charge_many(tenant_id, [(tokens, now)])

    async def charge_many(self, tenant_id: str, charges: list[tuple[int, float]]) -> None:
        """Charge several ``(tokens, epoch s)`` to one tenant: one compare-and-swap of its tpm window and one
        per UTC day touched, whatever the number of charges (the meter's batches, decision 0029); the
        result equals charging them one by one."""
        charges = [(int(t), float(ts)) for t, ts in charges if t > 0]
        if not charges:
            return

        def add_all(v):
            for tokens, ts in charges:
                v = window_add(v, tokens, ts)
            return v
        await self.kv.update(f"tpm.{tenant_id}", add_all)
        days: dict[str, int] = {}
        for tokens, ts in charges:
            days[day(ts)] = days.get(day(ts), 0) + tokens
        for d, tokens in days.items():
            await self.kv.update(f"day.{tenant_id}.{d}", lambda v, tokens=tokens: day_add(v, tokens))


def _headers(kind: str, limit: int, remaining: int, reset_s: float) -> dict[str, str]:
    return {f"x-ratelimit-limit-{kind}": str(limit), f"x-ratelimit-remaining-{kind}": str(remaining),
            f"x-ratelimit-reset-{kind}": _fmt_reset(reset_s)}


def _too_many(what: str, tenant_id: str, limit: int, retry_after: float, headers: dict[str, str]) -> ApiError:
    return ApiError(429, f"Rate limit reached for tenant {tenant_id} on {what}: limit {limit}. "
                    f"Please try again in {max(1, math.ceil(retry_after))}s.", type="requests",
                    code="rate_limit_exceeded", retry_after=max(1.0, math.ceil(retry_after)),
                    headers=dict(headers))
