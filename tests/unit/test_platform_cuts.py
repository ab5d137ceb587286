"""Pure parts of the platform-cost cuts (decision 0029): the scheduler's running token sum and which
requests the validator prepares on its event loop."""

from __future__ import annotations

import random

from actors.scheduler.policy import ThroughputMeter
from actors.validator.service import INLINE_CHARS, prepare_inline


def test_throughput_meter_running_sum_equals_the_window_sum():
    rnd = random.Random(7)
    meter, events, now = ThroughputMeter(window_s=2.0, min_records=1, started=0.0), [], 0.0
    for _ in range(500):
        now += rnd.random() * 0.05
        tokens = rnd.randint(0, 50)
        meter.add(now, tokens)
        events.append((now, tokens))
        if rnd.random() < 0.3:
            now += rnd.random()
            kept = [t for ts, t in events if ts >= now - 2.0]
            rate = meter.tokens_per_s(now)
            if len(kept) >= 1:
                assert abs(rate - sum(kept) / min(2.0, max(1.0, now))) < 1e-9
            else:
                assert rate is None


def test_prepare_inline_only_for_short_plain_requests():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert prepare_inline(chat)
    assert prepare_inline({"model": "m", "prompt": "x" * INLINE_CHARS})
    assert not prepare_inline({"model": "m", "prompt": "x" * (INLINE_CHARS + 1)})
    assert not prepare_inline({"model": "m", "prompt": ["a", "b"]})  # several prompts: the thread
    assert not prepare_inline({**chat, "messages": [{"role": "user", "content": "y" * (INLINE_CHARS + 1)}]})
    assert not prepare_inline({**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})
    for slow in ("tools", "response_format", "guided_json", "structured_outputs"):
        assert not prepare_inline({**chat, slow: {}})
    assert not prepare_inline({"model": "m"}) and not prepare_inline([])
