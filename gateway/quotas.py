"""Per-tenant quotas shared by every gateway replica, in a NATS JetStream key-value bucket.

Why JetStream KV and not etcd (docs/decisions/0008-tenancy.md): a compare-and-swap on a KV key is
one round trip to nats-server with no Raft fsync on the request path, etcd holds only slow-changing
state (ARCHITECTURE.md), and the same bucket family also serves idempotency records and usage.

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

import orjson

from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

BUCKET = "as_quota"
WINDOW_S = 60
SLOT_TTL_S = 15.0
CAS_ATTEMPTS = 50


def _day(ts: float) -> str:
    return time.strftime("%Y%m%d", time.gmtime(ts))


def _window_sum(buckets: dict[str, int], now: float) -> tuple[int, dict[str, int], float | None]:
    """(sum over the last 60 s, pruned buckets, epoch second of the oldest bucket still counted)."""
    lo = int(now) - WINDOW_S + 1
    kept = {k: int(v) for k, v in buckets.items() if int(k) >= lo}
    oldest = min((int(k) for k in kept), default=None)
    return sum(kept.values()), kept, oldest


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
    """Quota checks and charges on the ``as_quota`` JetStream KV bucket.

    ``js``: a nats-py JetStreamContext. ``await open()`` creates / binds the bucket. Every call is
    bounded by ``timeout`` seconds per KV operation; a store that cannot be reached fails open
    (the request is admitted and a warning logged): quotas protect fairness, not safety.
    """

    def __init__(self, js, *, timeout: float = 2.0) -> None:
        self.js = js
        self.timeout = timeout
        self.kv = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._slots: dict[str, set[str]] = {}  # tenant -> request ids holding a slot on this gateway
        self._refresher: asyncio.Task | None = None

    async def open(self) -> None:
        """Create or bind the bucket (file storage, history 1) and start the slot-refresh task."""
        from nats.js.api import KeyValueConfig, StorageType

        try:
            self.kv = await self.js.key_value(BUCKET)
        except Exception:
            self.kv = await self.js.create_key_value(KeyValueConfig(
                bucket=BUCKET, history=1, storage=StorageType.FILE, max_bytes=16 * 1024 * 1024))
        self._refresher = asyncio.create_task(self._refresh_slots(), name="quota-slot-refresh")

    async def close(self) -> None:
        """Stop refreshing slots (they then lapse within SLOT_TTL_S)."""
        if self._refresher:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)

    # -- compare-and-swap core --------------------------------------------------------------

    async def _cas(self, key: str, change) -> object:
        return await kv_cas(self.kv, key, change, self._locks.setdefault(key, asyncio.Lock()), self.timeout)

    async def _read(self, key: str) -> dict:
        return await kv_read(self.kv, key, self.timeout)

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
                used, _, oldest = _window_sum((await self._read(f"tpm.{tenant.id}")).get("b", {}), now)
                adm.headers.update(_headers("tokens", tpm, max(0, tpm - used), _reset_s(oldest, now)))
                if used >= tpm:
                    raise _too_many("tokens per minute", tenant.id, tpm, _reset_s(oldest, now), adm.headers)
            if daily is not None:
                used = int((await self._read(f"day.{tenant.id}.{_day(now)}")).get("t", 0))
                if used >= daily:
                    until = 86400 - (now % 86400)
                    raise _too_many("tokens per day", tenant.id, daily, until, adm.headers)
            if conc is not None:
                if not await self._take_slot(tenant.id, request_id, conc, now):
                    raise _too_many("concurrent requests", tenant.id, conc, 1.0, adm.headers)
                adm.slot = True
            if rpm is not None:
                ok, used, oldest = await self._cas(f"rpm.{tenant.id}", lambda v: _rpm_change(v, rpm, now))
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
        def change(v: dict):
            slots = {rid: exp for rid, exp in v.get("s", {}).items() if exp > now}
            if len(slots) >= limit:
                return None, False
            slots[request_id] = now + SLOT_TTL_S
            return {"s": slots}, True
        ok = await self._cas(f"conc.{tenant_id}", change)
        if ok:
            self._slots.setdefault(tenant_id, set()).add(request_id)
        return ok

    async def release(self, adm: Admission) -> None:
        """Give back the concurrency slot of an admitted request (idempotent; errors are logged)."""
        if not adm.slot:
            return
        adm.slot = False
        self._slots.get(adm.tenant, set()).discard(adm.request_id)

        def change(v: dict):
            slots = v.get("s", {})
            if adm.request_id not in slots:
                return None, None
            return {"s": {r: e for r, e in slots.items() if r != adm.request_id}}, None
        try:
            await self._cas(f"conc.{adm.tenant}", change)
        except Exception as exc:
            log.warning("slot release of %s failed (%r); it lapses in %.0f s", adm.request_id, exc, SLOT_TTL_S)

    async def _refresh_slots(self) -> None:
        while True:
            await asyncio.sleep(SLOT_TTL_S / 3)
            for tenant_id, rids in list(self._slots.items()):
                if not rids:
                    continue
                mine = set(rids)
                now = time.time()

                def change(v: dict, mine=mine, now=now):
                    slots = {r: e for r, e in v.get("s", {}).items() if e > now or r in mine}
                    for r in mine:
                        slots[r] = now + SLOT_TTL_S
                    return {"s": slots}, None
                try:
                    await self._cas(f"conc.{tenant_id}", change)
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

        def add_window(v: dict):
            _, kept, _ = _window_sum(v.get("b", {}), now)
            k = str(int(now))
            kept[k] = kept.get(k, 0) + int(tokens)
            return {"b": kept}, None
        await self._cas(f"tpm.{tenant_id}", add_window)
        await self._cas(f"day.{tenant_id}.{_day(now)}", lambda v: ({"t": int(v.get("t", 0)) + int(tokens)}, None))


async def kv_read(kv, key: str, timeout: float = 2.0) -> dict:
    """The JSON object at ``key`` of JetStream KV ``kv`` ({} when absent or deleted)."""
    from nats.js.errors import KeyDeletedError, KeyNotFoundError

    try:
        entry = await asyncio.wait_for(kv.get(key), timeout)
    except (KeyNotFoundError, KeyDeletedError):
        return {}
    return orjson.loads(entry.value) if entry.value else {}


async def kv_cas(kv, key: str, change, lock: asyncio.Lock, timeout: float = 2.0) -> object:
    """Compare-and-swap update of the JSON object at ``key``.

    ``change(value) -> (new_value | None, result)``; None means "no write". A lost race re-reads and
    retries (``lock`` serialises updates of the key within this process, so only other replicas race).
    Returns ``result``; TimeoutError after CAS_ATTEMPTS lost races or a KV call over ``timeout`` s."""
    from nats.js.errors import APIError, KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

    async with lock:
        for _ in range(CAS_ATTEMPTS):
            try:
                entry = await asyncio.wait_for(kv.get(key), timeout)
                value, rev = (orjson.loads(entry.value) if entry.value else {}), entry.revision
            except KeyNotFoundError:
                value, rev = {}, 0
            except KeyDeletedError as e:  # a tombstone: update on top of it
                value, rev = {}, getattr(getattr(e, "entry", None), "revision", 0) or 0
            new, result = change(value)
            if new is None:
                return result
            data = orjson.dumps(new)
            try:
                if rev == 0:
                    await asyncio.wait_for(kv.create(key, data), timeout)
                else:
                    await asyncio.wait_for(kv.update(key, data, last=rev), timeout)
                return result
            except (KeyWrongLastSequenceError, APIError):
                await asyncio.sleep(0)
    raise TimeoutError(f"KV key {key}: too many concurrent updates")


def _rpm_change(v: dict, rpm: int, now: float):
    used, kept, oldest = _window_sum(v.get("b", {}), now)
    if used >= rpm:
        return None, (False, used, oldest)
    k = str(int(now))
    kept[k] = kept.get(k, 0) + 1
    oldest = int(now) if oldest is None else oldest
    return {"b": kept}, (True, used + 1, oldest)


def _headers(kind: str, limit: int, remaining: int, reset_s: float) -> dict[str, str]:
    return {f"x-ratelimit-limit-{kind}": str(limit), f"x-ratelimit-remaining-{kind}": str(remaining),
            f"x-ratelimit-reset-{kind}": _fmt_reset(reset_s)}


def _too_many(what: str, tenant_id: str, limit: int, retry_after: float, headers: dict[str, str]) -> ApiError:
    return ApiError(429, f"Rate limit reached for tenant {tenant_id} on {what}: limit {limit}. "
                    f"Please try again in {max(1, math.ceil(retry_after))}s.", type="requests",
                    code="rate_limit_exceeded", retry_after=max(1.0, math.ceil(retry_after)),
                    headers=dict(headers))
