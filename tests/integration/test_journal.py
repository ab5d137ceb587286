"""The scheduler's JetStream journal against a real nats-server: append, remove, replay, dedupe."""

from __future__ import annotations

import time

from bus.journal import JetStreamJournal
from bus.messages import GenerateRequest, SamplingParams
from bus.nats_bus import NatsBus


def req(i: int) -> GenerateRequest:
    return GenerateRequest(f"j{i}", "t", "jm", "1", "_INBOX.t.x", (1, 2), SamplingParams(max_tokens=3),
                           deadline=time.time() + 60)


async def test_journal_replays_what_was_not_removed(infra):
    bus = await NatsBus.connect(infra.nats_url)
    try:
        j = await JetStreamJournal.open(bus, "jm", "1")
        for i in range(5):
            await j.append(req(i))
        await j.append(req(1))  # duplicate publish (same request id) is ignored by the stream
        await j.remove("j0")
        await j.remove("j3")
        await j.flush()  # removals are written in the background (decision 0054)
        again = await JetStreamJournal.open(bus, "jm", "1")  # a new scheduler after a failover
        assert [r.request_id for r in await again.replay()] == ["j1", "j2", "j4"]
        for rid in ("j1", "j2", "j4"):
            await again.remove(rid)
        await again.flush()
        assert await (await JetStreamJournal.open(bus, "jm", "1")).replay() == []
    finally:
        await bus.close()


async def test_removals_are_tombstones_and_a_purge_empties_the_stream(infra, monkeypatch):
    """Decision 0054 on a real nats-server: removals ride in tombstones (no per-entry delete call), the stream
    is purged below its oldest live entry, and replay after the purge still names exactly the live entries."""
    from bus import journal, streams

    monkeypatch.setattr(journal, "PURGE_EVERY_S", 0.0)
    bus = await NatsBus.connect(infra.nats_url)
    try:
        j = await JetStreamJournal.open(bus, "jt", "1")
        for i in range(30):
            await j.append(req(i))
        for i in range(29):
            await j.remove(f"j{i}")
        await j.flush()
        info = await bus.js()._js.stream_info(streams.journal_stream("jt", "1"))
        assert info.state.last_seq < 30 + 29, "a tombstone per removal: not group-committed"
        assert info.state.first_seq >= 30 and info.state.messages <= info.state.last_seq - 29
        assert [r.request_id for r in await (await JetStreamJournal.open(bus, "jt", "1")).replay()] == ["j29"]
    finally:
        await bus.close()
