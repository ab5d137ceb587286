"""The journal's group-committed removals (decision 0054) against a JetStream stand-in that keeps a stream's
contract: sequences, Nats-Msg-Id de-duplication, get-next by sequence, purge below a sequence. The same paths
against a real nats-server: tests/integration/test_journal.py."""

from __future__ import annotations

import asyncio
import time

from bus import journal
from bus.journal import JetStreamJournal
from bus.messages import GenerateRequest, SamplingParams


class StreamStandIn:
    """One JetStream stream: ``publish`` (with de-dup), ``next_msg``, ``purge`` (counted)."""

    def __init__(self) -> None:
        self.msgs: dict[int, bytes] = {}
        self.last_seq_, self.ids, self.calls = 0, {}, {"publish": 0, "purge": 0, "next_msg": 0}

    async def publish(self, subject, data, *, msg_id=None, timeout=5.0, ride_out_s=None):
        self.calls["publish"] += 1
        await asyncio.sleep(0.001)  # a round trip: removals made meanwhile join the next tombstone
        if msg_id is not None and msg_id in self.ids:
            return self.ids[msg_id]
        self.last_seq_ += 1
        self.msgs[self.last_seq_] = data
        if msg_id is not None:
            self.ids[msg_id] = self.last_seq_
        return self.last_seq_

    async def next_msg(self, stream, subject, seq):
        self.calls["next_msg"] += 1
        later = [s for s in self.msgs if s >= seq]
        return (min(later), self.msgs[min(later)]) if later else None

    async def last_seq(self, stream):
        return self.last_seq_

    async def purge(self, stream, below):
        self.calls["purge"] += 1
        self.msgs = {s: d for s, d in self.msgs.items() if s >= below}


async def replayed(js: StreamStandIn) -> list[str]:
    """The request ids a new scheduler's replay of ``js`` finds, in order."""
    return [r.request_id for r in await JetStreamJournal(js, "m", "1").replay()]


def req(i: int) -> GenerateRequest:
    return GenerateRequest(f"r{i}", "t", "m", "1", "_INBOX.t.x", (1, 2), SamplingParams(max_tokens=3),
                           deadline=time.time() + 60)


async def test_removals_made_during_a_flush_share_the_next_tombstone_and_replay_skips_them(monkeypatch):
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 3600.0)  # no purge: replay must skip by tombstones alone
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    for i in range(40):
        await j.append(req(i))
    for i in range(0, 40, 2):
        await j.remove(f"r{i}")  # returns at once; the first starts a flush, the rest wait for the next one
    await j.flush()
    tombstones = [d for d in js.msgs.values() if d.startswith(journal.TOMBSTONE_PREFIX)]
    assert 1 <= len(tombstones) <= 2, f"20 removals in {len(tombstones)} tombstones"
    again = JetStreamJournal(js, "m", "1")  # a new scheduler after a failover
    assert [r.request_id for r in await again.replay()] == [f"r{i}" for i in range(1, 40, 2)]


async def test_a_purge_frees_every_message_below_the_oldest_live_entry(monkeypatch):
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 0.0)
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    for i in range(6):
        await j.append(req(i))
    for rid in ("r0", "r1", "r3"):
        await j.remove(rid)
        await j.flush()
    assert js.calls["purge"] >= 1 and min(js.msgs) == 3  # r2 (sequence 3) holds the purge back
    await j.remove("r2")
    await j.flush()
    assert min(js.msgs) == 5  # r4, r5 and the tombstones above them stay
    assert await replayed(js) == ["r4", "r5"]


async def test_a_long_queued_entry_is_written_again_so_the_stream_does_not_grow_behind_it(monkeypatch):
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "COMPACT_MIN_DEAD", 16)
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    await j.append(req(0))  # queued for long: every later request is dispatched at once
    for i in range(1, 60):
        await j.append(req(i))
        await j.remove(f"r{i}")
        await j.flush()
    assert len(js.msgs) < 40, f"{len(js.msgs)} messages kept behind one live entry"
    assert j._seq["r0"] > 1  # its copy moved to the tip
    got = await JetStreamJournal(js, "m", "1").replay()
    assert [r.request_id for r in got] == ["r0"] and list(got[0].prompt_token_ids) == [1, 2]


async def test_a_compacted_entry_replays_once_before_and_not_after_its_removal():
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    await j.append(req(0))
    await j.append(req(1))
    copy = await j._store(req(0).encode(), "r0@1")  # compaction wrote a copy; the old one not yet tombstoned
    j._seq["r0"] = copy
    assert await replayed(js) == ["r0", "r1"]
    adopter = JetStreamJournal(js, "m", "1")
    await adopter.replay()
    await adopter.remove("r0")  # the newest copy; the old one rides along in the same tombstone
    await adopter.flush()
    assert await replayed(js) == ["r1"]


async def test_a_write_in_flight_is_never_purged(monkeypatch):
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 0.0)
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    await j.append(req(0))
    slow = asyncio.ensure_future(j.append(req(1)))  # stored before the tombstone, acknowledged after it
    await asyncio.sleep(0)
    await j.remove("r0")
    await j.flush()
    await slow
    assert await replayed(js) == ["r1"]


async def test_a_tombstone_the_server_refused_is_written_later(monkeypatch):
    monkeypatch.setattr(journal, "FLUSH_RETRY_S", 0.01)
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    await j.append(req(0))
    real, fails = js.publish, [1]

    async def flaky(*a, **kw):
        if fails:
            fails.pop()
            raise TimeoutError("no answer")
        return await real(*a, **kw)

    js.publish = flaky
    await j.remove("r0")
    await j.flush()
    assert await replayed(js) == []


async def test_a_request_removed_while_its_append_is_in_flight_is_removed_once_it_lands():
    """Direct dispatch (decision 0054) may remove a request whose append has not been acknowledged yet."""
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    landing = asyncio.ensure_future(j.append(req(0)))
    await asyncio.sleep(0)
    await j.remove("r0")
    await landing
    await j.flush()
    assert "r0" not in j._seq and await replayed(js) == []


async def test_a_request_removed_while_compaction_copies_it_stays_removed(monkeypatch):
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 3600.0)
    monkeypatch.setattr(journal, "COMPACT_MIN_DEAD", 4)
    js = StreamStandIn()
    j = JetStreamJournal(js, "m", "1")
    real = js.publish

    async def dispatched_meanwhile(subject, data, *, msg_id=None, **kw):
        seq = await real(subject, data, msg_id=msg_id, **kw)
        if msg_id == "r0@1":  # the compaction copy of r0 lands as r0 is dispatched
            await j.remove("r0")
        return seq

    js.publish = dispatched_meanwhile
    await j.append(req(0))
    for i in range(1, 8):
        await j.append(req(i))
        await j.remove(f"r{i}")
        await j.flush()
    await j.flush()
    assert "r0" not in j._seq
    assert await replayed(js) == []


async def test_a_purge_never_reaches_a_sequence_another_scheduler_wrote(monkeypatch):
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 0.0)
    js = StreamStandIn()
    old, new = JetStreamJournal(js, "m", "1"), JetStreamJournal(js, "m", "1")
    await old.append(req(0))
    await new.append(req(1))  # the successor's queued request, above the predecessor's floor
    await old.remove("r0")  # the predecessor's late removal
    await old.flush()
    assert 2 in js.msgs  # purged at most below the first sequence the predecessor did not write
    assert await replayed(js) == ["r1"]


async def test_a_request_journaled_and_removed_while_replay_reads_is_not_adopted_again():
    """A new active scheduler takes submits before its replay ends: what it removed meanwhile stays removed."""
    js = StreamStandIn()
    await JetStreamJournal(js, "m", "1").append(req(0))  # the predecessor's queued request
    k = JetStreamJournal(js, "m", "1")
    await k.append(req(1))
    await k.remove("r1")  # dispatched at once; its tombstone is not written yet when the replay reads
    got = await k.replay()
    assert [r.request_id for r in got] == ["r0"] and "r1" not in k._seq and "r0" in k._seq
    await k.flush()
    assert await replayed(js) == ["r0"]


async def test_a_successor_of_a_purged_stream_purges_too(monkeypatch):
    """The stream was purged empty by a predecessor: the successor's writes start above a gap it has read as
    gone, so its own purges still run (and nothing piles up behind them)."""
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 0.0)
    js = StreamStandIn()
    old = JetStreamJournal(js, "m", "1")
    for i in range(3):
        await old.append(req(i))
        await old.remove(f"r{i}")
        await old.flush()
    assert js.msgs == {} or min(js.msgs) > 3
    new = JetStreamJournal(js, "m", "1")
    assert await new.replay() == []
    purges = js.calls["purge"]
    for i in range(3, 6):
        await new.append(req(i))
        await new.remove(f"r{i}")
        await new.flush()
    assert js.calls["purge"] > purges and len(new._mine) == 0 and len(js.msgs) <= 2


async def test_a_gap_left_by_a_tombstone_the_purge_can_pass(monkeypatch):
    """A sequence this instance did not store but may purge — here a late tombstone of a predecessor — is read
    and passed; an entry it never held stops the purge below it."""
    monkeypatch.setattr(journal, "PURGE_EVERY_S", 0.0)
    js = StreamStandIn()
    new = JetStreamJournal(js, "m", "1")
    await new.append(req(0))  # sequence 1
    await js.publish("s", b'{"removed":[]}')  # sequence 2: a predecessor's late tombstone
    await new.append(req(1))  # sequence 3
    await new.remove("r0")
    await new.remove("r1")
    await new.flush()
    assert all(s > 3 for s in js.msgs)  # passed the tombstone
    foreign = JetStreamJournal(js, "m", "1")
    await foreign.append(req(7))  # another scheduler's queued request
    await new.append(req(2))
    await new.remove("r2")
    await new.flush()
    assert any(b'"r7"' in d for d in js.msgs.values())  # never purged by the instance that did not write it
