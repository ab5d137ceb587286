"""The dashboard's pure figures (gateway/dashboard_data.py): traffic windows and quantiles, worker states from
etcd records + statistics + notices, replicas by pool against desired counts, decisions newest first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway import dashboard_data as dd

WP, NP, DP = "/actorserve/workers/", "/actorserve/notices/preemption/", "/actorserve/desired/"


def _rec(status="ok", prompt=10, gen=5, prefill=20.0, choice=0, name="m", version="1"):
    return SimpleNamespace(name=name, version=version, status=status, prompt_tokens=prompt, completion_tokens=gen,
                           timing={"validation_ms": 1.0, "queue_ms": 4.0, "prefill_ms": prefill, "decode_ms": 80.0},
                           choice_index=choice)


def test_traffic_rates_quantiles_and_windows():
    t = dd.Traffic()
    for i in range(100):  # 100 requests over the last 50 s, TTFT 25..124 ms
        t.add_record(1000.0 - 50 + i * 0.5, _rec(prefill=20.0 + i))
    t.add_record(999.0, _rec(status="error"))
    t.add_record(999.5, _rec(gen=7, choice=1))  # a second choice: tokens, not a request
    f = t.figures(1000.0)["m@1"]
    assert f["requests_60s"] == 101 and f["errors_60s"] == 1
    assert f["requests_per_s"] == pytest.approx(21 / dd.RATE_WINDOW_S)  # 20 ok in the last 10 s + the error
    assert f["generation_tokens_per_s"] == pytest.approx((20 * 5 + 5 + 7) / dd.RATE_WINDOW_S)
    assert f["ttft_ms_p50"] == 74.0 and f["ttft_ms_p99"] == 123.0  # nearest rank of 25..124 ms
    assert f["itl_ms_p50"] == 20.0  # 80 ms / (5 - 1)
    later = t.figures(1000.0 + dd.LATENCY_WINDOW_S + 1)
    assert later == {} and t.versions == {}  # a silent version is forgotten


def test_worker_states_pools_and_desired():
    records = {f"{WP}m/1/w0": {"pool": "spot"}, f"{WP}m/1/w1": {"pool": "spot"}, f"{WP}m/1/w2": {},
               f"{WP}other/2/x": {"pool": "od"}, "/actorserve/workers/bad": {}}
    stats = [{"labels": {"model": "m@1", "worker": "w0"}, "kv": 0.5, "running": 2, "waiting": 0, "gen_tps": 12.34},
             {"labels": {"model": "m@1", "worker": "w1"}, "kv": 0.1, "running": 1, "waiting": 1, "gen_tps": 3.0},
             {"labels": {"model": "m@1", "worker": "gone"}, "kv": 0.0, "running": 0, "waiting": 0, "gen_tps": 0.0}]
    by = dd.workers_by_version(records, WP, {f"{NP}w1": {"deadline": 1.0}}, NP, stats)
    states = {w["worker"]: (w["pool"], w["state"]) for w in by["m@1"]}
    assert states == {"w0": ("spot", "serving"), "w1": ("spot", "preempting"), "w2": ("default", "registered"),
                      "gone": ("?", "unregistered")}
    assert by["other@2"][0]["kv"] is None and [w for w in by["m@1"] if w["worker"] == "w0"][0]["gen_tps"] == 12.3
    desired = dd.desired_targets({f"{DP}worker/m/1/spot": {"count": 3, "reason": "r", "ts": 5.0},
                                  f"{DP}worker/m/1/od": {"count": 1}, f"{DP}validator": {"count": 2}}, DP)
    pools = {p["pool"]: p for p in dd.pools_of(by["m@1"], desired, "m@1")}
    assert pools["spot"] == {"pool": "spot", "ready": 1, "preempting": 1, "no_stats": 0, "leaving": 0, "sleeping": 0,
                             "desired": 3}
    assert pools["od"]["desired"] == 1 and pools["od"]["ready"] == 0  # desired, none running yet
    assert pools["default"]["no_stats"] == 1 and pools["default"]["desired"] is None
    assert pools["?"]["leaving"] == 1  # statistics, no record: draining or lease lost
    assert desired["validator"]["count"] == 2


def test_a_sleeping_worker_is_shown_asleep_and_counted_in_its_pool():
    """Issue [28]: a worker whose record says it sleeps is ``sleeping`` (even with statistics heard: it still
    reports), and its pool counts it apart from the ready ones."""
    records = {f"{WP}m/1/w0": {"pool": "p", "sleep": {"state": "sleeping"}}, f"{WP}m/1/w1": {"pool": "p"},
               f"{WP}m/1/w2": {"pool": "p", "sleep": {"state": "running"}}}
    stats = [{"labels": {"model": "m@1", "worker": w}, "kv": 0.0, "running": 0, "waiting": 0, "gen_tps": 0.0}
             for w in ("w0", "w1", "w2")]
    by = dd.workers_by_version(records, WP, {}, NP, stats)
    assert {w["worker"]: w["state"] for w in by["m@1"]} == {"w0": "sleeping", "w1": "serving", "w2": "serving"}
    [pool] = dd.pools_of(by["m@1"], {}, "m@1")
    assert (pool["ready"], pool["sleeping"]) == (2, 1)


def test_decisions_newest_first_and_bounded():
    hist = {"decisions": [{"ts": float(i), "loop": "pool", "target": "worker/m/1/spot", "current": i,
                           "desired": i + 1, "reason": f"r{i}", "inputs": {"big": 1}} for i in range(30)] + ["junk"]}
    got = dd.recent_decisions(hist, last=5)
    assert [d["ts"] for d in got] == [29.0, 28.0, 27.0, 26.0, 25.0] and "inputs" not in got[0]
    assert dd.recent_decisions(None) == [] and dd.recent_decisions({"decisions": None}) == []


def test_snapshot_hides_tenants_without_a_token_and_lists_every_source():
    load = {"actor_id": "s1", "queue_len": 2, "queue_tokens": 64.0, "arrivals_tokens_per_s": 1.0,
            "served_tokens_per_s": 2.0, "workers": 1, "cold_start_waiting": 0, "tenants": [("a", 1.0, 1.0)]}
    kw = dict(taken_at=5.0, traffic={}, loads={"m@1": (0.4, load)}, workers={"w@2": []}, desired={}, decisions=[])
    snap = dd.build_snapshot(show_tenants=False, **kw)
    assert [v["model"] for v in snap["versions"]] == ["m@1", "w@2"] and snap["versions"][0]["tenants"] is None
    assert snap["versions"][0]["queue"]["age_s"] == 0.4 and snap["versions"][0]["traffic"]["requests_60s"] == 0
    snap = dd.build_snapshot(show_tenants=True, errors={"etcd workers": "down"}, **kw)
    assert snap["versions"][0]["tenants"] == [{"tenant": "a", "service_share": 1.0, "weight_share": 1.0}]
    assert snap["errors"] == {"etcd workers": "down"} and snap["versions"][1]["queue"] is None


def test_scheduler_load_report_carries_tenant_shares_against_weights():
    """actors/scheduler/load.py: ``tenants`` of the scheduler's ActorLoad = the ledger's shares of service
    against each active tenant's weight share (a tenant no longer active is due 0)."""
    from actors.scheduler.load import SchedulerLoad
    from bus.messages import ActorLoad

    ledger = SimpleNamespace(shares=lambda now: {"a": 0.6, "b": 0.3, "old": 0.1})
    svc = SimpleNamespace(bus=None, cfg=SimpleNamespace(scheduler_id="s1"), ledger=ledger,
                          weights={"a": 1.0, "b": 3.0}, fair=SimpleNamespace(active_tenants=lambda: ["a", "b", "c"]))
    rows = SchedulerLoad(svc).tenant_shares(0.0)
    assert rows == [["a", 0.6, 0.2], ["b", 0.3, 0.6], ["c", 0.0, 0.2], ["old", 0.1, 0.0]]  # largest first
    load = ActorLoad("scheduler", "s1", 1.0, 1.0, tenants=rows)
    assert ActorLoad.decode(load.encode()).tenants == tuple(tuple(r) for r in rows)
    with pytest.raises(ValueError, match="ActorLoad.tenants"):
        ActorLoad("scheduler", "s1", 1.0, 1.0, tenants=[["a", 2.0, 0.5]])
