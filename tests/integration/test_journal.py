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
        again = await JetStreamJournal.open(bus, "jm", "1")  # a new scheduler after a failover
        assert [r.request_id for r in await again.replay()] == ["j1", "j2", "j4"]
        for rid in ("j1", "j2", "j4"):
            await again.remove(rid)
        assert await (await JetStreamJournal.open(bus, "jm", "1")).replay() == []
    finally:
        await bus.close()
