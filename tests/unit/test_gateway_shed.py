"""Pure tests of the gateway's refusal hints (gateway/shed.py): what is learnt, for whom, for how long."""

from __future__ import annotations

import pytest

from bus.errors import ServeError
from gateway.shed import HINT_TTL_S, Shape, ShedHints

T0 = 1_000_000.0


def refusal(code: str, status: int = 503, **extra) -> dict:
    return ServeError(status, "refused", type="overloaded", code=code, retryable=True, retry_after=1.0,
                      extra=extra).to_wire()


def shape(tenant="a", deadline=T0 + 10, max_tokens=32, ignore_eos=True, model="m@1", priority="interactive"):
    return Shape(model, tenant, priority, deadline, max_tokens, ignore_eos)


def test_queue_full_covers_the_model_for_the_ttl_only():
    h = ShedHints()
    h.learn("m@1", "a", "interactive", refusal("queue_full"), T0)
    assert h.check(shape(tenant="b"), T0 + 0.1)["code"] == "queue_full"  # every tenant: the whole queue is full
    assert h.check(shape(model="m@2"), T0 + 0.1) is None  # another version has its own queue
    assert h.check(shape(), T0 + HINT_TTL_S + 0.01) is None  # lapsed: the scheduler decides again
    assert h.num_shed == 1


def test_tenant_queue_full_covers_that_tenant_only():
    h = ShedHints()
    h.learn("m@1", "a", "interactive", refusal("tenant_queue_full", 429), T0)
    assert h.check(shape(tenant="a"), T0)["status"] == 429
    assert h.check(shape(tenant="b"), T0) is None


def test_deadline_hint_refuses_only_what_surely_finishes_late():
    h = ShedHints()
    # the queue ahead clears at T0 + 4 s; a decode step takes 0.1 s
    h.learn("m@1", "a", "interactive", refusal("deadline_unmeetable", queue_clear_at=T0 + 4, decode_step_s=0.1), T0)
    assert h.check(shape(deadline=T0 + 6.0, max_tokens=32), T0)["code"] == "deadline_unmeetable"  # 4 + 3.2 > 6
    assert h.check(shape(deadline=T0 + 7.5, max_tokens=32), T0) is None  # 4 + 3.2 < 7.5: the scheduler decides
    assert h.check(shape(deadline=T0 + 6.0, ignore_eos=False), T0) is None  # may stop early: own decode unknown
    assert h.check(shape(deadline=T0 + 3.9, ignore_eos=False), T0) is not None  # before the queue even clears
    assert h.check(shape(deadline=T0 + 3.9, priority="batch"), T0) is None  # another class has another queue
    assert h.check(shape(deadline=T0 + 3.9, tenant="b"), T0) is None  # another tenant has another share


@pytest.mark.parametrize("err", [refusal("deadline_unmeetable"), refusal("deadline_exceeded"),
                                 ServeError(400, "bad", code="context_length_exceeded").to_wire(), None])
def test_other_errors_and_hintless_refusals_teach_nothing(err):
    h = ShedHints()
    h.learn("m@1", "a", "interactive", err, T0)
    assert h.check(shape(deadline=T0), T0) is None


def test_bounded_and_ttl_zero_disables():
    h = ShedHints(max_hints=2)
    for i in range(3):
        h.learn(f"m@{i}", "a", "interactive", refusal("queue_full"), T0)
    assert h.check(shape(model="m@2"), T0) is None and h.check(shape(model="m@1"), T0) is not None
    h.learn("m@2", "a", "interactive", refusal("queue_full"), T0 + 1)  # the expired ones make room
    assert h.check(shape(model="m@2"), T0 + 1) is not None
    off = ShedHints(ttl_s=0)
    off.learn("m@1", "a", "interactive", refusal("queue_full"), T0)
    assert off.check(shape(), T0) is None


def test_shed_refusals_are_counted_per_model_and_code():
    from actors.metrics import render_latest
    from gateway.metrics import count_shed

    def value() -> float:
        rows = [r for r in render_latest().decode().splitlines()
                if r.startswith("actorserve_gateway_shed_total{") and 'model="shed-test@1"' in r]
        return float(rows[0].rsplit(" ", 1)[1]) if rows else 0.0
    before = value()
    count_shed("shed-test@1", "queue_full")
    assert value() == before + 1
