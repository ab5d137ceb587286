"""JetStream without a leader for a while (a clustered nats-server lost, a partition, a fresh cluster):
opening a stream retries instead of failing at once (bus/jetstream.py), and a scheduler term retries its
journal (actors/scheduler/actor.py ``_retrying``). Seen in the cluster test (tests/cluster): a scheduler
elected during a partition, and a jobs actor started on a fresh 3-node cluster, exited. No server: fakes
stand for nats-py's JetStream context. About 1.5 s (the retries' pauses)."""

from __future__ import annotations

import asyncio

import pytest
from nats import errors as nats_errors
from nats.js import errors as js_errors

from actors.scheduler.actor import _retrying
from bus import streams
from bus.base import BusError
from bus.jetstream import JetStream


class _FlakyJs:
    """stream_info times out ``fails`` times, then the stream is missing; add_stream records the config."""

    def __init__(self, fails: int) -> None:
        self.fails, self.added = fails, []

    async def stream_info(self, name):
        if self.fails:
            self.fails -= 1
            raise nats_errors.TimeoutError
        if self.added:
            return object()
        raise js_errors.NotFoundError

    async def add_stream(self, config):
        self.added.append(config)


class _Nc:
    def __init__(self, js) -> None:
        self.js = js

    def jetstream(self, timeout: float):
        return self.js


def test_ensure_stream_waits_for_a_leader():
    fake = _FlakyJs(fails=2)
    asyncio.run(JetStream(_Nc(fake), replicas=3).ensure_stream(streams.JOB_QUEUE))
    assert [c.num_replicas for c in fake.added] == [3]


def test_ensure_stream_gives_up_after_its_deadline():
    fake = _FlakyJs(fails=100)
    with pytest.raises(TimeoutError):
        asyncio.run(JetStream(_Nc(fake), open_retry_s=0.0).ensure_stream(streams.JOB_QUEUE))


def test_scheduler_term_retries_then_raises():
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 2:
            raise BusError("JetStream system temporarily unavailable")
        return "journal"
    assert asyncio.run(_retrying("journal open", flaky, deadline_s=5.0)) == "journal"

    async def down():
        raise TimeoutError
    with pytest.raises(TimeoutError):
        asyncio.run(_retrying("journal open", down, deadline_s=0.0))
