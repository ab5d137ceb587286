"""Spend budgets, pure rules (gateway/budgets.py): prices, the reservation bound, reserve / settle / end /
expiry, rounding, n choices, periods, the 429; plus the manifest and tenant fields they read."""

from __future__ import annotations

import random

import pytest

from control.state.manifest import ModelManifest
from control.state.tenants import Budget, Tenant, TenantError
from gateway import budgets as b

PRICE = b.Pricing(prompt_pico=150_000, completion_pico=600_000)  # 0.15 / 0.60 USD per 1M tokens
NOW = 1_764_633_600.0  # 2025-12-02T00:00:00Z


def _reserve(v, rid="r1", amount=100, budget=1000, choices=1, now=NOW, expires=NOW + 200):
    return b.reserve(v, request_id=rid, amount=amount, budget=budget, pid=b.period_id("month", now), now=now,
                     expires_at=expires, choices=choices, price=PRICE, model="m@1")


def _settle(v, rid="r1", choice=0, prompt=10, completion=20, budget=1000, now=NOW, price=PRICE):
    return b.settle(v, record_id=rid, choice=choice, prompt_tokens=prompt, completion_tokens=completion,
                    price=price, budget=budget, pid=b.period_id("month", now), now=now, model="m@1")


# -- manifest and tenant fields ---------------------------------------------------------------------

def test_manifest_pricing_is_validated_and_names_the_field():
    m = ModelManifest("a", "1", "/x", pricing={"prompt_per_1m": 0.15, "completion_per_1m": 0.6})
    assert m.to_dict()["pricing"] == {"prompt_per_1m": 0.15, "completion_per_1m": 0.6}
    assert "pricing" not in ModelManifest("a", "1", "/x").to_dict()  # unpriced manifests stay as they were
    for bad, field in (({"prompt_per_1m": -1, "completion_per_1m": 0}, "pricing.prompt_per_1m"),
                       ({"prompt_per_1m": 1}, "pricing.completion_per_1m"),
                       ({"prompt_per_1m": 1, "completion_per_1m": True}, "pricing.completion_per_1m"),
                       ({"prompt_per_1m": 1, "completion_per_1m": 1, "cached": 1}, "pricing.cached"),
                       ({"prompt_per_1m": float("nan"), "completion_per_1m": 1}, "pricing.prompt_per_1m")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            ModelManifest("a", "1", "/x", pricing=bad)


def test_a_price_change_restarts_nothing():
    from control.ops.deploy import manifest_fingerprint

    m = {"name": "m", "version": "1", "artifact": "/x"}
    priced = {**m, "pricing": {"prompt_per_1m": 1.0, "completion_per_1m": 2.0}}
    assert manifest_fingerprint(m) == manifest_fingerprint(priced)
    assert manifest_fingerprint(m) != manifest_fingerprint({**m, "context_length": 64})


def test_pricing_units_and_free_versions():
    assert b.Pricing.of({"pricing": {"prompt_per_1m": 0.15, "completion_per_1m": 0.6}}) == PRICE
    assert b.Pricing.of({}) is None and b.Pricing.of(None) is None
    assert b.Pricing.of({"pricing": {"prompt_per_1m": 0, "completion_per_1m": 0}}) is None
    # 1M prompt tokens at 0.15 USD per 1M = 0.15 USD = 150,000 micro-USD
    assert b.ceil_micro(PRICE.cost_pico(1_000_000, 0)) == 150_000


def test_tenant_budget_record_round_trip_and_validation():
    t = Tenant.from_record("acme", {"budget": {"usd": 2.5, "period": "day"}})
    assert t.budget == Budget(2.5, "day") and t.budget.micro_usd == 2_500_000
    assert t.to_record()["budget"] == {"usd": 2.5, "period": "day"}
    assert Tenant.from_record("acme", {}).budget is None
    with pytest.raises(TenantError, match="budget.period"):
        Tenant.from_record("acme", {"budget": {"usd": 1, "period": "week"}})
    with pytest.raises(ValueError, match="budget.usd"):
        Budget(-1.0)


# -- the reservation bound ----------------------------------------------------------------------------

def test_prompt_bounds():
    assert b.prompt_bounds("chat", {"messages": []}, 2048) == [(1, 2047)]
    assert b.prompt_bounds("completions", {"prompt": "héllo"}, 2048) == [(1, 6 + b.SPECIAL_SLACK)]
    assert b.prompt_bounds("completions", {"prompt": [5, 6, 7]}, 2048) == [(3, 3)]
    assert b.prompt_bounds("completions", {"prompt": ["ab", [1, 2]]}, 2048) == [(1, 2 + b.SPECIAL_SLACK), (2, 2)]
    assert b.prompt_bounds("completions", {"prompt": "x" * 5000}, 2048) == [(1, 2047)]


def test_completion_limit_follows_the_validator():
    assert b.completion_limit("chat", {"max_tokens": 7}, {}) == 7
    assert b.completion_limit("chat", {"max_completion_tokens": 5, "max_tokens": 7}, {}) == 5
    assert b.completion_limit("completions", {}, {}) == 16  # OpenAI's completions default
    assert b.completion_limit("chat", {}, {"defaults": {"max_tokens": 64}}) == 64
    assert b.completion_limit("chat", {}, {}) is None  # the context bounds it
    assert b.completion_limit("chat", {"max_tokens": -3}, {}) is None  # refused by the validator anyway


def test_max_cost_is_the_exact_maximum_over_every_admissible_prompt_length():
    rng = random.Random(7)
    for _ in range(300):
        ctx = rng.randint(2, 300)
        lo = rng.randint(1, ctx - 1)
        hi = rng.randint(lo, ctx - 1)
        n, m = rng.randint(1, 4), rng.choice([None, rng.randint(1, 400)])
        price = b.Pricing(rng.randint(0, 10**6), rng.randint(0, 10**6))
        mm = ctx if m is None else m
        brute = max(price.cost_pico(p, n * max(1, min(mm, ctx - p))) for p in range(lo, hi + 1))
        assert b.max_cost_pico([(lo, hi)], n, m, ctx, price) == brute


def test_request_max_cost_n_choices_and_context():
    m = {"context_length": 2048}
    one = b.request_max_cost_micro("completions", {"prompt": "Hi", "max_tokens": 4}, m, PRICE)
    assert one == b.ceil_micro(PRICE.cost_pico(2 + b.SPECIAL_SLACK, 4))
    three = b.request_max_cost_micro("completions", {"prompt": "Hi", "max_tokens": 4, "n": 3}, m, PRICE)
    assert three == b.ceil_micro(PRICE.cost_pico(2 + b.SPECIAL_SLACK, 12))  # prompt once, 3 x max_tokens
    # chat without max_tokens: the prompt and the completion share the context
    assert b.request_max_cost_micro("chat", {"messages": []}, m, PRICE) == b.ceil_micro(PRICE.cost_pico(1, 2047))
    # no context_length: a large upper bound, never less than with one
    assert b.request_max_cost_micro("chat", {"messages": [], "max_tokens": 4}, {}, PRICE) > \
        b.request_max_cost_micro("chat", {"messages": [], "max_tokens": 4}, m, PRICE)


# -- reserve / settle / end / expiry ------------------------------------------------------------------

def test_reserve_refuses_what_does_not_fit():
    v = _reserve(None, "r1", amount=600)
    assert v["r"]["r1"]["a"] == 600 and b.reserved(v) == 600
    assert _reserve(v, "r2", amount=401) is None
    v = _reserve(v, "r2", amount=400)
    assert b.reserved(v) == 1000 and _reserve(v, "r3", amount=1) is None


def test_settle_charges_actual_cost_and_returns_the_rest():
    v = _reserve(None, "r1", amount=500)
    v, cost = _settle(v, "r1", prompt=1000, completion=100)  # 150 + 60 = 210 micro-USD
    assert cost == PRICE.cost_pico(1000, 100) and v["s"] == 210 and v["r"] == {} and v["m"] == {"m@1": 210}
    assert b.reserved(v) == 0 and v["u"] == 0


def test_n_choices_settle_one_by_one_rounded_once_per_request():
    # three choices of 1 completion token each: 0.6 micro-USD each, 1.8 together -> 2 micro-USD, not 3
    v = _reserve(None, "r", amount=10, choices=3)
    v, _ = _settle(v, "r-0", choice=0, prompt=0, completion=1)
    assert v["s"] == 1 and b.reserved(v) == 9 and v["r"]["r"]["c"] == [1, 2]
    v, _ = _settle(v, "r-1", choice=1, prompt=0, completion=1)
    assert _settle(v, "r-1", choice=1, prompt=0, completion=1)[0] is None  # a redelivered record: no change
    v, _ = _settle(v, "r-2", choice=2, prompt=0, completion=1)
    assert v["s"] == 2 and v["r"] == {} and b.reserved(v) == 0


def test_settlement_never_exceeds_the_reservation():
    v = _reserve(None, "r", amount=5)
    v, cost = _settle(v, "r", prompt=0, completion=100)  # 60 micro-USD > 5 reserved (price raised, say)
    assert v["s"] == 5 and v["u"] == 55 and cost == PRICE.cost_pico(0, 100)


def test_lapsed_reservation_frees_room_and_a_late_record_gets_only_the_room():
    v = _reserve(None, "dead", amount=900, expires=NOW + 10)
    assert _reserve(v, "r2", amount=200) is None
    later = NOW + 11
    v = _reserve(v, "r2", amount=200, now=later, expires=later + 100)  # the dead gateway's hold lapsed
    assert set(v["r"]) == {"r2"}
    v, _ = _settle(v, "dead", prompt=0, completion=2000, now=later)  # 1200 micro-USD, no reservation
    assert v["s"] == 800 and v["u"] == 400 and v["s"] + b.reserved(v) == 1000


def test_end_shortens_and_drop_removes():
    v = _reserve(None, "r", amount=100, expires=NOW + 500)
    e = b.end(v, "r", NOW)
    assert e["r"]["r"]["e"] == NOW + b.SETTLE_GRACE_S and b.end(e, "r", NOW) is None
    assert b.end(v, "other", NOW) is None
    assert b.drop(v, "r")["r"] == {} and b.drop(v, "other") is None
    assert b.reserved(b.current(e, b.period_id("month", NOW), NOW + b.SETTLE_GRACE_S + 1)) == 0


def test_period_rollover_resets_spend_but_keeps_reservations():
    v = _reserve(None, "r", amount=100, expires=NOW + 40 * 86400)
    v, _ = _settle(v, "x", prompt=0, completion=1000)  # unreserved: 600
    assert v["s"] == 600
    nxt = NOW + 31 * 86400  # next month
    cur = b.current(v, b.period_id("month", nxt), nxt)
    assert cur["s"] == 0 and cur["m"] == {} and set(cur["r"]) == {"r"}
    assert b.period_id("total", NOW) == b.period_id("total", nxt) == "total"
    assert b.period_reset("day", NOW + 5) == NOW + 86400 and b.period_reset("total", NOW) is None


def test_random_interleavings_never_overspend():
    """Random reserve / settle / end / lapse / late-record sequences: spent + reserved <= budget always and
    spent <= budget; settled requests hold nothing."""
    rng = random.Random(3)
    for _ in range(200):
        v, budget, now, live = None, rng.randint(50, 2000), NOW, {}
        for step in range(60):
            now += rng.random() * 5
            op = rng.random()
            if op < 0.45:
                rid, amt = f"r{step}", rng.randint(1, 400)
                nv = _reserve(v, rid, amount=amt, budget=budget, now=now, expires=now + rng.randint(1, 30),
                              choices=rng.randint(1, 3))
                if nv is not None:
                    v, live[rid] = nv, nv["r"][rid]["c"][:]
            elif op < 0.85 and (live or op < 0.5):
                rid = rng.choice(sorted(live)) if live else f"ghost{step}"
                ch = rng.choice(live[rid]) if rid in live else 0
                nv, _ = _settle(v, rid if ch == 0 else f"{rid}-{ch}", choice=ch, prompt=rng.randint(0, 300),
                                completion=rng.randint(0, 300), budget=budget, now=now)
                v = nv if nv is not None else v
                if rid in live:
                    live[rid].remove(ch)
                    if not live[rid]:
                        del live[rid]
            elif live:
                rid = rng.choice(sorted(live))
                v = b.end(v, rid, now) or v
            cur = b.current(v, b.period_id("month", now), now)
            assert cur["s"] + b.reserved(cur) <= budget and cur["s"] <= budget


# -- the 429 ----------------------------------------------------------------------------------------

def test_exhausted_error_shape_and_retry_after():
    v = _reserve(None, "r", amount=900, budget=1000)
    err = b.exhausted("acme", "month", 1000, v, 200, "m@1", NOW)
    assert err.status == 429 and err.code == "budget_exhausted" and err.type == "insufficient_quota"
    assert "month budget" in err.message and "$0.000100" in err.message and "m@1" in err.message
    assert err.retry_after == 1.0  # the in-flight reservation will come back
    spent, _ = _settle(_reserve(None, "r", amount=900), "r", prompt=0, completion=1500)  # 900 spent
    err = b.exhausted("acme", "month", 1000, spent, 200, "m@1", NOW + 3600)
    assert err.retry_after == 29 * 86400 + 23 * 3600  # until the UTC month resets (2026-01-01)
    total = {**spent, "p": b.period_id("total", NOW)}
    assert b.exhausted("acme", "total", 1000, total, 200, "m@1", NOW).retry_after is None
    assert "larger than the whole budget" in b.exhausted("acme", "month", 1000, None, 1001, "m@1", NOW).message
    assert err.body()["error"]["code"] == "budget_exhausted"
    assert b.unavailable("acme").status == 503 and b.unavailable("acme").code == "budget_unavailable"


def test_view_reports_usd():
    v = _reserve(None, "r", amount=250_000, budget=1_000_000)
    v, _ = _settle(v, "x", prompt=0, completion=500_000, budget=1_000_000)  # 300,000 micro
    rep = b.view(v, 1_000_000, "month", NOW)
    assert rep["budget_usd"] == 1.0 and rep["spent_usd"] == 0.3 and rep["reserved_usd"] == 0.25
    assert rep["remaining_usd"] == pytest.approx(0.45) and rep["by_model_usd"] == {"m@1": 0.3}
    assert rep["period_id"] == "m202512" and rep["in_flight"] == 1
