"""A JetStream leader election (no leader for a few seconds, e.g. right after a partition heals) is waited
out by KV calls and publishes (bus/jetstream.py ``riding_out``), within a bound; other errors are not
retried. Fakes stand for nats-py; no server. About 0.8 s (the retries' pauses)."""

from __future__ import annotations

import time

import pytest
from nats import errors as nats_errors
from nats.js import errors as js_errors

from bus import jetstream, streams
from bus.jetstream import JetStreamKV, riding_out
from bus.kv import KvError


class Flaky:
    """An awaitable call that raises ``errors`` one by one, then returns ``value``; counts calls."""

    def __init__(self, errors: list[BaseException], value=1) -> None:
        self.errors, self.value, self.calls = list(errors), value, 0

    async def __call__(self, *a, **kw):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


def unavailable() -> js_errors.ServiceUnavailableError:
    return js_errors.ServiceUnavailableError(code=503, err_code=10008, description="JetStream system temporarily unavailable")


async def test_leaderless_answers_are_waited_out():
    fn = Flaky([unavailable(), nats_errors.NoRespondersError(), unavailable()], value=7)
    assert await riding_out(fn, 2.0) == 7 and fn.calls == 4


async def test_the_wait_is_bounded():
    fn = Flaky([unavailable()] * 100)
    t0 = time.monotonic()
    with pytest.raises(js_errors.ServiceUnavailableError):
        await riding_out(fn, 0.6)
    assert time.monotonic() - t0 < 0.6 + jetstream.RIDE_OUT_STEP_S and 2 <= fn.calls <= 4


async def test_timeouts_and_other_errors_are_not_retried():
    for err in (nats_errors.TimeoutError(), js_errors.BadRequestError()):
        fn = Flaky([err])
        with pytest.raises(type(err)):
            await riding_out(fn, 2.0)
        assert fn.calls == 1


class FakeKv:
    def __init__(self, put) -> None:
        self.put = put


async def test_a_kv_put_rides_out_an_election_and_a_long_one_is_a_kv_error():
    cfg = streams.BucketConfig("as_idem")
    put = Flaky([unavailable(), unavailable()], value=5)
    assert await JetStreamKV(FakeKv(put), cfg, timeout=1.0).put("k", {"a": 1}) == 5 and put.calls == 3
    forever = Flaky([unavailable()] * 100)
    with pytest.raises(KvError):
        await JetStreamKV(FakeKv(forever), cfg, timeout=0.5).put("k", 1)  # ride-out: 0.8 x 0.5 s, then KvError
