"""One JSON key-value layer: JetStream KV (``bus/jetstream.py`` opens it) and its in-memory twin.

Values are JSON (orjson), keys JetStream KV keys (``[-/_=.A-Za-z0-9]``, no leading or trailing dot).
Every store of the platform (quotas, idempotency, usage, jobs) uses :class:`KeyValue`; the rules of
those stores are pure functions of values, so the store shells hold no JetStream code.

Semantics, shared by both implementations (tests/integration/test_kv_contract.py):

* revisions are per bucket and grow with every write or delete (JetStream stream sequences);
* ``get`` -> ``Entry`` or None when the key is absent, deleted or expired (bucket TTL);
* ``create`` fails with :class:`KvConflict` when the key holds a value (a deleted one may be re-created);
* ``swap(key, value, last)`` writes only if the key is still at revision ``last``, else KvConflict;
* ``update(key, change)``: read, ``change(value or None) -> new value | None`` (None: no write),
  compare-and-swap; a lost race re-reads and retries, at most ``attempts`` times (then TimeoutError);
  updates of one key through one KeyValue object are serialised by a local lock, so only other
  processes (replicas) race;
* ``delete(key, last=None)``: a delete marker (optionally only at revision ``last``);
* ``watch(pattern)``: current values, one ``None`` marker, then every change (deletes as entries
  with ``deleted=True``); ``values(pattern)``: the current values only; ``history(key)``: the kept
  revisions (``BucketConfig.history``), oldest first, delete markers included.

Every call to the bucket is bounded by ``timeout`` seconds (TimeoutError).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson

from bus.base import BusError
from bus.memory import subject_matches
from bus.streams import BucketConfig

CAS_ATTEMPTS = 50
_KEY = re.compile(r"^[-/_=.A-Za-z0-9]+$")
_PATTERN = re.compile(r"^[-/_=.A-Za-z0-9*>]+$")


class KvError(BusError):
    """A key-value operation failed (server error, bucket full, connection lost)."""


class KvConflict(KvError):
    """A conditional write lost: the key exists (create) or moved past the expected revision (swap)."""


@dataclass(frozen=True)
class Entry:
    """One revision of a key: ``value`` is the decoded JSON (None for a delete marker)."""

    key: str
    value: Any
    revision: int
    deleted: bool = False


@dataclass(frozen=True)
class Updated:
    """Outcome of :meth:`KeyValue.update`: the value now stored (None: no such key), its revision
    (0: none), and whether this call wrote it."""

    value: Any
    revision: int
    changed: bool


def _checked(text: str, allowed: re.Pattern, what: str) -> str:
    if not isinstance(text, str) or not allowed.match(text) or text[0] == "." or text[-1] == ".":
        raise ValueError(f"invalid {what} {text!r}: {allowed.pattern[1:-1]}, no leading or trailing dot")
    return text


def check_key(key: str) -> str:
    """``key`` if it is a valid KV key; ValueError naming it otherwise."""
    return _checked(key, _KEY, "KV key")


def check_pattern(pattern: str) -> str:
    """``pattern`` if it is a valid key filter (``*`` one token, ``>`` the rest); ValueError otherwise."""
    return _checked(pattern, _PATTERN, "KV key filter")


def encode(value: Any) -> bytes:
    """JSON bytes of ``value`` (TypeError for what JSON cannot hold)."""
    return orjson.dumps(value)


def decode(data: bytes | None) -> Any:
    """The JSON value of ``data`` (None for empty data: a delete marker)."""
    return orjson.loads(data) if data else None


class Watch:
    """An open watch: async iterator of ``Entry`` (and one ``None`` after the current values).

    Use ``async with kv.watch(pattern) as w: async for e in w: ...``; ``stop()`` ends it."""

    def __init__(self, start: Callable[[], Awaitable[tuple[AsyncIterator, Callable[[], Awaitable[None]]]]]) -> None:
        self._start, self._it, self._stop = start, None, None

    async def __aenter__(self) -> "Watch":
        if self._it is None:
            self._it, self._stop = await self._start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def __aiter__(self) -> "Watch":
        return self

    async def __anext__(self) -> Entry | None:
        await self.__aenter__()
        return await self._it.__anext__()

    async def stop(self) -> None:
        """End the watch (idempotent)."""
        stop, self._stop = self._stop, None
        if stop is not None:
            await stop()


class KeyValue(abc.ABC):
    """A JSON KV bucket. Subclasses implement the raw operations (``_entry``, ``_put``, ``_create``,
    ``_swap``, ``_delete``, ``_history``, ``_open_watch``) on bytes; this class adds JSON, key
    checks, timeouts and the compare-and-swap loop."""

    def __init__(self, config: BucketConfig, timeout: float = 5.0) -> None:
        self.config, self.timeout = config, timeout
        self._locks: dict[str, list] = {}  # key -> [lock, users]: dropped when no update waits

    @property
    def name(self) -> str:
        """The bucket's name."""
        return self.config.name

    async def _timed(self, aw: Awaitable):
        async with asyncio.timeout(self.timeout):
            return await aw

    async def get(self, key: str) -> Entry | None:
        """The key's current entry; None when absent, deleted or expired."""
        e = await self._timed(self._entry(check_key(key)))
        return None if e is None or e.deleted else e

    async def put(self, key: str, value: Any) -> int:
        """Write unconditionally; returns the new revision."""
        return await self._timed(self._put(check_key(key), encode(value)))

    async def create(self, key: str, value: Any) -> int:
        """Write only if the key holds no value; returns the new revision. KvConflict otherwise."""
        return await self._timed(self._create(check_key(key), encode(value)))

    async def swap(self, key: str, value: Any, last: int) -> int:
        """Write only if the key is at revision ``last``; returns the new revision. KvConflict otherwise."""
        return await self._timed(self._swap(check_key(key), encode(value), int(last)))

    async def delete(self, key: str, last: int | None = None) -> None:
        """Place a delete marker (only at revision ``last`` when given: KvConflict otherwise)."""
        await self._timed(self._delete(check_key(key), last))

    async def history(self, key: str) -> list[Entry]:
        """Kept revisions of ``key``, oldest first (delete markers included); [] for an unknown key."""
        return await self._timed(self._history(check_key(key)))

    def watch(self, pattern: str = ">") -> Watch:
        """Watch the keys matching ``pattern`` (see the module docstring)."""
        return Watch(lambda: self._timed(self._open_watch(check_pattern(pattern))))

    async def values(self, pattern: str = ">") -> list[Entry]:
        """Current entries of the keys matching ``pattern`` (deleted keys left out), in revision order."""
        out = []
        async with self.watch(pattern) as w:
            while (e := await self._timed(w.__anext__())) is not None:
                out.append(e)
        return out

    async def update(self, key: str, change: Callable[[Any], Any], *, attempts: int = CAS_ATTEMPTS) -> Updated:
        """Compare-and-swap ``change`` into ``key`` (see the module docstring). TimeoutError after
        ``attempts`` lost races or a bucket call over ``timeout`` s; ``change``'s exceptions propagate."""
        async with self._locked(check_key(key)):
            for _ in range(attempts):
                cur = await self._timed(self._entry(key))
                value = None if cur is None or cur.deleted else cur.value
                new = change(value)
                if new is None:
                    return Updated(value, cur.revision if value is not None else 0, False)
                try:
                    rev = await (self.create(key, new) if value is None else self.swap(key, new, cur.revision))
                    return Updated(new, rev, True)
                except KvConflict:
                    await asyncio.sleep(0)
        raise TimeoutError(f"KV key {key} of {self.name}: {attempts} concurrent updates lost")

    @contextlib.asynccontextmanager
    async def _locked(self, key: str):
        slot = self._locks.setdefault(key, [asyncio.Lock(), 0])
        slot[1] += 1
        try:
            async with slot[0]:
                yield
        finally:
            slot[1] -= 1
            if not slot[1]:
                self._locks.pop(key, None)

    # -- raw operations (implementations) --------------------------------------------------------

    @abc.abstractmethod
    async def _entry(self, key: str) -> Entry | None:
        """Latest entry, delete markers included (as ``deleted`` entries); None if none."""
        ...

    @abc.abstractmethod
    async def _put(self, key: str, data: bytes) -> int:
        ...

    @abc.abstractmethod
    async def _create(self, key: str, data: bytes) -> int:
        ...

    @abc.abstractmethod
    async def _swap(self, key: str, data: bytes, last: int) -> int:
        ...

    @abc.abstractmethod
    async def _delete(self, key: str, last: int | None) -> None:
        ...

    @abc.abstractmethod
    async def _history(self, key: str) -> list[Entry]:
        ...

    @abc.abstractmethod
    async def _open_watch(self, pattern: str) -> tuple[AsyncIterator, Callable[[], Awaitable[None]]]:
        ...


# -- the in-memory twin ----------------------------------------------------------------------------

@dataclass
class _Rev:
    data: bytes | None  # None: delete marker
    revision: int
    written: float  # clock() at the write (bucket TTL)


@dataclass
class _Bucket:
    """The shared state of one memory bucket (every MemoryKV handle on it sees the same)."""

    config: BucketConfig
    clock: Callable[[], float]
    revision: int = 0
    keys: dict[str, deque] = field(default_factory=dict)  # key -> deque[_Rev] (history)
    watchers: list[tuple[str, asyncio.Queue]] = field(default_factory=list)

    def live(self, key: str) -> deque:
        """Revisions of ``key`` not expired (expired ones are dropped, as JetStream's max age does)."""
        revs = self.keys.get(key, deque())
        ttl = self.config.ttl_s
        while ttl is not None and revs and self.clock() - revs[0].written >= ttl:
            revs.popleft()
        if not revs:
            self.keys.pop(key, None)
        return revs

    def write(self, key: str, data: bytes | None) -> int:
        self.revision += 1
        rev = _Rev(data, self.revision, self.clock())
        self.keys.setdefault(key, deque(maxlen=self.config.history)).append(rev)
        for pattern, q in self.watchers:
            if subject_matches(pattern, key):
                q.put_nowait(_entry(key, rev))
        return rev.revision


def _entry(key: str, rev: _Rev) -> Entry:
    return Entry(key, decode(rev.data), rev.revision, rev.data is None)


class MemoryKV(KeyValue):
    """In-memory twin of a JetStream KV bucket (unit tests, single-process tools). Handles made by one
    :class:`MemoryBuckets` on the same bucket name share the data but not their update locks, so
    they race like replicas. ``clock``: seconds, for the bucket TTL (default ``time.monotonic``)."""

    def __init__(self, bucket: _Bucket, timeout: float = 5.0) -> None:
        super().__init__(bucket.config, timeout)
        self._b = bucket

    async def _entry(self, key: str) -> Entry | None:
        revs = self._b.live(key)
        return _entry(key, revs[-1]) if revs else None

    async def _put(self, key: str, data: bytes) -> int:
        return self._b.write(key, data)

    async def _create(self, key: str, data: bytes) -> int:
        cur = await self._entry(key)
        if cur is not None and not cur.deleted:
            raise KvConflict(f"key {key} exists in {self.name}")
        return self._b.write(key, data)

    async def _swap(self, key: str, data: bytes, last: int) -> int:
        cur = await self._entry(key)
        if (cur.revision if cur else 0) != last:
            raise KvConflict(f"key {key} of {self.name} is not at revision {last}")
        return self._b.write(key, data)

    async def _delete(self, key: str, last: int | None) -> None:
        cur = await self._entry(key)
        if last is not None and last > 0 and (cur.revision if cur else 0) != last:
            raise KvConflict(f"key {key} of {self.name} is not at revision {last}")
        self._b.write(key, None)

    async def _history(self, key: str) -> list[Entry]:
        return [_entry(key, r) for r in self._b.live(key)]

    async def _open_watch(self, pattern: str):
        q: asyncio.Queue = asyncio.Queue()
        for key in sorted(self._b.keys, key=lambda k: self._b.keys[k][-1].revision):
            if subject_matches(pattern, key) and (e := await self._entry(key)) is not None and not e.deleted:
                q.put_nowait(e)
        q.put_nowait(None)
        item = (pattern, q)
        self._b.watchers.append(item)

        async def stop() -> None:
            if item in self._b.watchers:
                self._b.watchers.remove(item)
            q.put_nowait(StopAsyncIteration)
        return _drain(q), stop


async def _drain(q: asyncio.Queue) -> AsyncIterator:
    while (e := await q.get()) is not StopAsyncIteration:
        yield e


class MemoryBuckets:
    """Opens memory KV buckets by config, like ``bus.jetstream.JetStream.bucket``: the first open of a
    name creates it (with that config), later opens bind to it. One instance = one "server"."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    async def bucket(self, config: BucketConfig, timeout: float = 5.0) -> MemoryKV:
        """A new handle on bucket ``config.name`` (created on first use)."""
        b = self._buckets.setdefault(config.name, _Bucket(config, self.clock))
        return MemoryKV(b, timeout)
