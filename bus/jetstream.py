"""JetStream behind a small bus-level API: the only module besides ``bus/nats_bus.py`` that uses nats-py's
JetStream. Streams, publishes with a de-duplication id, durable pull consumers, KV buckets
(``bus/kv.py`` semantics) and object stores, all opened from the configs of ``bus/streams.py``.

nats-py errors never leave this module: a lost conditional write is ``bus.kv.KvConflict``, a server or
connection failure ``bus.base.BusError`` (``KvError`` for KV calls), an expired wait ``TimeoutError``.
Opening is create-or-bind: an existing stream / bucket / store is used as it is (its config is not
changed), a missing one is created; two processes opening at once both succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import AsyncIterator, BinaryIO

import nats
from nats import errors as nats_errors
from nats.js import api
from nats.js import errors as js_errors

from bus import streams, subjects
from bus.base import BusError
from bus.kv import Entry, KeyValue, KvConflict, KvError, check_pattern, decode

log = logging.getLogger(__name__)

_WRONG_LAST = (10071, 10164)  # JSStreamWrongLastSequenceErr(Constant): a conditional write lost
# JetStream that is there but cannot answer yet: no meta / stream leader (a clustered server lost, a
# partition, a fresh cluster still placing streams), the API request unanswered, the client reconnecting.
_NOT_YET = (nats_errors.TimeoutError, nats_errors.NoRespondersError, nats_errors.ConnectionReconnectingError,
            js_errors.ServiceUnavailableError)
OPEN_RETRY_S = 30.0  # how long opening a stream / bucket / store / consumer retries _NOT_YET (s)
# JetStream that answered at once that no leader serves the stream now: a leader election, e.g. right after a
# partition heals (the rejoining server's higher Raft term deposes the leaders: Raft without pre-vote, Ongaro's
# dissertation section 9.6; nats-server re-elects in 4-9 s). Worth waiting out briefly, unlike a timeout
# (which already spent the wait). KV calls and publishes retry these every RIDE_OUT_STEP_S for at most
# RIDE_OUT_S (and 0.8 of the call's own timeout), so a request arriving during an election waits rather than
# failing with a retryable 503.
_LEADERLESS = (nats_errors.NoRespondersError, js_errors.ServiceUnavailableError)
RIDE_OUT_S = 4.0
RIDE_OUT_STEP_S = 0.25


async def riding_out(fn, budget_s: float):
    """``await fn()``, again every RIDE_OUT_STEP_S s while JetStream answers that it has no leader
    (:data:`_LEADERLESS`), for at most ``budget_s`` seconds; then that error is raised. Other errors at once."""
    t_end = time.monotonic() + budget_s
    while True:
        try:
            return await fn()
        except _LEADERLESS:
            if time.monotonic() + RIDE_OUT_STEP_S >= t_end:
                raise
            await asyncio.sleep(RIDE_OUT_STEP_S)


def _storage(file: bool) -> api.StorageType:
    return api.StorageType.FILE if file else api.StorageType.MEMORY


@contextlib.contextmanager
def _mapped(what: str, error: type[BusError] = BusError):
    """Translate nats-py errors raised inside into this package's errors (``what`` names the call)."""
    try:
        yield
    except js_errors.KeyWrongLastSequenceError as exc:
        raise KvConflict(f"{what}: {exc}") from exc
    except js_errors.APIError as exc:
        if getattr(exc, "err_code", None) in _WRONG_LAST:  # KV errors skip APIError.__init__
            raise KvConflict(f"{what}: {exc}") from exc
        raise error(f"{what}: {exc}") from exc
    except nats_errors.TimeoutError:
        raise
    except nats_errors.Error as exc:
        raise error(f"{what}: {exc}") from exc


class JsMsg:
    """A message delivered by a pull consumer: ``data``, ``ack()``, ``in_progress()`` (BusError on failure)."""

    def __init__(self, msg) -> None:
        self._msg = msg
        self.data: bytes = msg.data

    async def ack(self) -> None:
        """Acknowledge: the message is done (a work queue removes it)."""
        with _mapped("ack"):
            await self._msg.ack()

    async def in_progress(self) -> None:
        """Still working on it: restart the consumer's ack wait."""
        with _mapped("in-progress ack"):
            await self._msg.in_progress()


class PullConsumer:
    """A durable pull consumer (``JetStream.pull``)."""

    def __init__(self, sub, name: str) -> None:
        self._sub, self.name = sub, name

    async def fetch(self, batch: int, timeout: float) -> list[JsMsg]:
        """Up to ``batch`` messages, waiting at most ``timeout`` s; [] when none came. BusError otherwise."""
        try:
            with _mapped(f"fetch from {self.name}"):
                return [JsMsg(m) for m in await self._sub.fetch(batch, timeout=timeout)]
        except TimeoutError:
            return []

    async def stop(self) -> None:
        """Stop pulling (unacknowledged messages are redelivered after their ack wait)."""
        try:
            await self._sub.unsubscribe()
        except (nats_errors.Error, ValueError) as exc:
            log.debug("unsubscribe of consumer %s: %s", self.name, exc)


class ObjectStore:
    """A JetStream object store holding whole byte strings by name."""

    def __init__(self, store, name: str) -> None:
        self._store, self.name = store, name

    async def put(self, name: str, data: bytes | BinaryIO) -> None:
        """Store ``data`` under ``name`` (replacing any previous object). ``data``: bytes, or a binary file
        read in chunks by nats-py (in a thread), so a large object need not be held in memory."""
        with _mapped(f"put {name} into {self.name}"):
            await self._store.put(name, data)

    async def delete(self, name: str) -> None:
        """Delete object ``name``; KeyError if there is none, BusError on failure."""
        try:
            with _mapped(f"delete {name} from {self.name}"):
                await self._store.delete(name)
        except BusError as exc:
            if isinstance(exc.__cause__, js_errors.NotFoundError):
                raise KeyError(name) from exc
            raise

    async def get(self, name: str) -> bytes:
        """The bytes of object ``name``; KeyError if there is none, BusError on failure."""
        try:
            with _mapped(f"get {name} from {self.name}"):
                return (await self._store.get(name)).data
        except BusError as exc:
            if isinstance(exc.__cause__, js_errors.NotFoundError):
                raise KeyError(name) from exc
            raise


class JetStreamKV(KeyValue):
    """A :class:`bus.kv.KeyValue` on a nats-py KV bucket (open with ``JetStream.bucket``)."""

    def __init__(self, kv, config: streams.BucketConfig, timeout: float = 5.0, manager=None) -> None:
        super().__init__(config, timeout)
        self._kv, self._manager = kv, manager
        self._ride_s = min(RIDE_OUT_S, 0.8 * timeout)  # leader elections waited out per call (s)

    async def values(self, pattern: str = ">") -> list[Entry]:
        """Current entries matching ``pattern``, in revision order, read as the stream's subject list
        (STREAM.INFO with a subjects filter) then one get per key. Not through a watch: nats-py's watcher
        can send its end-of-initial-values marker before values already on their way (it compares the
        consumer's pending count with what the client has processed), which once listed no jobs."""
        if self._manager is None:
            return await super().values(pattern)
        filt = subjects.kv_key_subjects(self.name, check_pattern(pattern))
        with _mapped(f"list {pattern} in {self.name}", KvError):
            info = await self._timed(self._manager.stream_info(streams.kv_stream(self.name), subjects_filter=filt))
        prefix = filt[: len(filt) - len(pattern)]
        found = [await self.get(subj[len(prefix):]) for subj in sorted(info.state.subjects or {})]
        return sorted((e for e in found if e is not None), key=lambda e: e.revision)

    async def _entry(self, key: str) -> Entry | None:
        try:
            with _mapped(f"get {key} from {self.name}", KvError):
                e = await riding_out(lambda: self._kv.get(key), self._ride_s)
        except KvError as exc:
            if not isinstance(exc.__cause__, js_errors.KeyNotFoundError):
                raise
            tomb = exc.__cause__.entry  # set when the key's latest entry is a delete / purge marker
            return Entry(key, None, tomb.revision, True) if tomb is not None else None
        return Entry(key, decode(e.value), e.revision)

    async def _put(self, key: str, data: bytes) -> int:
        with _mapped(f"put {key} into {self.name}", KvError):
            return await riding_out(lambda: self._kv.put(key, data), self._ride_s)

    async def _create(self, key: str, data: bytes) -> int:
        with _mapped(f"create {key} in {self.name}", KvError):
            return await riding_out(lambda: self._kv.create(key, data), self._ride_s)

    async def _swap(self, key: str, data: bytes, last: int) -> int:
        with _mapped(f"update {key} of {self.name}", KvError):
            return await riding_out(lambda: self._kv.update(key, data, last=last), self._ride_s)

    async def _delete(self, key: str, last: int | None) -> None:
        with _mapped(f"delete {key} from {self.name}", KvError):
            await riding_out(lambda: self._kv.delete(key, last=last), self._ride_s)

    async def _history(self, key: str, attempts: int = 3) -> list[Entry]:
        """nats-py's ``history`` may end before the first entry is delivered (its watcher reads the consumer's
        pending count before the server counted the messages: seen under CI load as ``[]`` for a key with three
        kept revisions), so an empty answer for a key that has an entry is asked again (at most ``attempts``)."""
        for attempt in range(attempts):
            try:
                with _mapped(f"history of {key} in {self.name}", KvError):
                    return [_js_entry(e) for e in await self._kv.history(key)]
            except KvError as exc:
                if not isinstance(exc.__cause__, js_errors.NoKeysError):
                    raise
            if attempt + 1 < attempts and await self._entry(key) is not None:
                await asyncio.sleep(0.05 * (attempt + 1))
                continue
            return []
        return []

    async def _open_watch(self, pattern: str):
        with _mapped(f"watch {pattern} in {self.name}", KvError):
            watcher = await self._kv.watch(pattern)
        return _watched(watcher), watcher.stop


def _js_entry(e) -> Entry:
    deleted = e.operation in ("DEL", "PURGE")
    return Entry(e.key, None if deleted else decode(e.value), e.revision, deleted)


async def _watched(watcher) -> AsyncIterator[Entry | None]:
    """Entries of a nats-py watcher: current values (their delete markers skipped), None, then changes."""
    initial = True
    async for e in watcher:
        if e is None:
            initial = False
            yield None
            continue
        entry = _js_entry(e)
        if not (initial and entry.deleted):
            yield entry


async def _opening(what: str, fn, deadline_s: float):
    """``await fn()``, again every 0.5 s while JetStream cannot answer yet (:data:`_NOT_YET`), for at most
    ``deadline_s`` seconds; then the last error is raised (mapped by the caller's ``_mapped``)."""
    t_end = time.monotonic() + deadline_s
    while True:
        try:
            return await fn()
        except _NOT_YET as exc:
            if time.monotonic() >= t_end:
                raise
            log.warning("%s: JetStream not available yet (%r); retrying", what, exc)
            await asyncio.sleep(0.5)


def replicas_from_env() -> int:
    """Replicas for new streams, buckets and object stores: ``$ACTORSERVE_JS_REPLICAS`` (1..5), else 1.
    ValueError naming the variable when it is set to anything else."""
    value = os.environ.get(streams.REPLICAS_ENV, "").strip()
    return streams.check_replicas(value) if value else streams.DEFAULT_REPLICAS


class JetStream:
    """JetStream of one NATS connection. ``JetStream(nc)`` on a nats-py client, or ``bus.js()`` on a
    connected ``bus.nats_bus.NatsBus``. ``timeout``: seconds per JetStream API request. ``replicas``:
    how many copies a stream / bucket / store this object creates gets (None: :func:`replicas_from_env`;
    3 on a 3-node NATS cluster); one that exists already is bound as it is. ValueError for a bad count.
    Opening (bucket, ensure_stream, pull, objects) retries for up to ``open_retry_s`` seconds while
    JetStream has no leader yet (a clustered server lost, a partition, a fresh cluster)."""

    def __init__(self, nc: nats.NATS, timeout: float = 5.0, replicas: int | None = None,
                 open_retry_s: float = OPEN_RETRY_S) -> None:
        self._js = nc.jetstream(timeout=timeout)
        self.replicas = replicas_from_env() if replicas is None else streams.check_replicas(replicas, "replicas")
        self.open_retry_s = float(open_retry_s)

    async def bucket(self, config: streams.BucketConfig, timeout: float = 5.0) -> JetStreamKV:
        """The KV bucket of ``config`` (created if missing); its calls are bounded by ``timeout`` s."""
        async def open_():
            try:
                return await self._js.key_value(config.name)
            except js_errors.NotFoundError:
                return await self._js.create_key_value(api.KeyValueConfig(
                    bucket=config.name, history=config.history, ttl=config.ttl_s, max_bytes=config.max_bytes,
                    storage=_storage(config.file), replicas=self.replicas))
        with _mapped(f"open bucket {config.name}", KvError):
            kv = await _opening(f"open bucket {config.name}", open_, self.open_retry_s)
        return JetStreamKV(kv, config, timeout, self._js)

    async def ensure_stream(self, config: streams.StreamConfig) -> None:
        """Create the stream of ``config`` unless it exists."""
        async def open_():
            try:
                await self._js.stream_info(config.name)
            except js_errors.NotFoundError:
                try:
                    await self._js.add_stream(api.StreamConfig(
                        name=config.name, subjects=list(config.subjects), storage=_storage(config.file),
                        retention=api.RetentionPolicy.WORK_QUEUE if config.work_queue else api.RetentionPolicy.LIMITS,
                        max_bytes=config.max_bytes, max_age=config.max_age_s,
                        duplicate_window=config.duplicate_window_s, num_replicas=self.replicas))
                except js_errors.BadRequestError:  # created meanwhile (a retry after a lost reply, a peer)
                    await self._js.stream_info(config.name)
        with _mapped(f"open stream {config.name}"):
            await _opening(f"open stream {config.name}", open_, self.open_retry_s)

    async def publish(self, subject: str, data: bytes, *, msg_id: str | None = None, timeout: float = 5.0,
                      ride_out_s: float | None = None) -> int:
        """Publish into a stream and wait for its ack; returns the stream sequence. ``msg_id``: the
        ``Nats-Msg-Id`` de-duplication id (a repeat within the stream's window is stored once).
        ``ride_out_s``: how long a "no leader" answer is retried (:func:`riding_out`; default
        min(RIDE_OUT_S, 0.8 * ``timeout``) seconds; 0: not at all). BusError / TimeoutError on failure."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id is not None else None
        ride = min(RIDE_OUT_S, 0.8 * timeout) if ride_out_s is None else ride_out_s
        with _mapped(f"publish to {subject}"):
            ack = await riding_out(lambda: self._js.publish(subject, data, timeout=timeout, headers=headers), ride)
            return ack.seq

    async def pull(self, stream: streams.StreamConfig, consumer: streams.ConsumerConfig) -> PullConsumer:
        """Bind (creating if needed) the durable pull consumer ``consumer`` of ``stream`` (filtered on the
        stream's first subject: every stream of bus/streams.py has one)."""
        cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, ack_wait=consumer.ack_wait_s,
                                 max_ack_pending=consumer.max_ack_pending, max_deliver=consumer.max_deliver or -1)
        with _mapped(f"consumer {consumer.durable} of {stream.name}"):
            sub = await _opening(f"consumer {consumer.durable} of {stream.name}", lambda: self._js.pull_subscribe(
                stream.subjects[0], durable=consumer.durable, stream=stream.name, config=cfg), self.open_retry_s)
        return PullConsumer(sub, consumer.durable)

    async def objects(self, config: streams.ObjectStoreConfig) -> ObjectStore:
        """The object store of ``config`` (created if missing)."""
        async def open_():
            try:
                return await self._js.object_store(config.name)
            except js_errors.NotFoundError:
                return await self._js.create_object_store(config.name, api.ObjectStoreConfig(
                    bucket=config.name, ttl=config.ttl_s, max_bytes=config.max_bytes, storage=_storage(config.file),
                    replicas=self.replicas))
        with _mapped(f"open object store {config.name}"):
            store = await _opening(f"open object store {config.name}", open_, self.open_retry_s)
        return ObjectStore(store, config.name)

    async def next_msg(self, stream: str, subject: str, seq: int) -> tuple[int, bytes] | None:
        """``(sequence, data)`` of the first message on ``subject`` of ``stream`` at or after ``seq``; None if none."""
        try:
            with _mapped(f"read {stream}"):
                msg = await self._js.get_msg(stream, seq=seq, subject=subject, next=True)
        except BusError as exc:
            if isinstance(exc.__cause__, js_errors.NotFoundError):
                return None
            raise
        return msg.seq, msg.data

    async def last_seq(self, stream: str) -> int:
        """The sequence of the last message ever stored in ``stream`` (0: none; one ``STREAM.INFO`` call;
        BusError if the server is away)."""
        with _mapped(f"info of {stream}"):
            return (await self._js.stream_info(stream)).state.last_seq

    async def purge(self, stream: str, below: int) -> None:
        """Remove every message of ``stream`` with a sequence below ``below`` (one ``STREAM.PURGE`` call with
        ``seq``; BusError if the server is away)."""
        with _mapped(f"purge {stream} below {below}"):
            await self._js.purge_stream(stream, seq=below)
