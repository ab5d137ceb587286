"""The supervisor carries out desired replica counts (control/ops/supervisor_scaling.py): the pure rules
(record parsing, victim choice, indices, the autoscaler's limits under ``up``) and
:meth:`Supervisor.scaling_round` on fake processes (no process is started or signalled: ``procs.spawn`` and
the signal helpers are replaced by recorders)."""

from __future__ import annotations

import dataclasses
import json
import signal
from types import SimpleNamespace

import pytest

from control.ops import supervisor_processes as processes
from control.ops import supervisor_scaling as scaling
from control.ops.supervisor import START_ORDER, Supervisor
from control.ops.stack_config import StackConfig
from control.ops.supervisor_scaling import (Desired, Replica, autoscaler_limits_argv, choose_victims,
                                            next_free_index, parse_desired, replica_index)
from control.state.names import all_metrics_prefix, desired_key, desired_prefix, workers_prefix

P = desired_prefix()


# -- pure rules -----------------------------------------------------------------------------------


def test_parse_desired_sorts_keys_and_rejects_bad_records():
    recs = {desired_key("validator"): {"count": 3, "ts": 1.5, "reason": "lag", "by": "as-1"},
            desired_key("gateway"): {"count": 2},
            desired_key("worker", "m", "1", "local"): {"count": 0, "reason": "idle"},
            desired_key("worker", "m", "1", "spot"): {"count": 2},
            P + "validator/extra": {"count": 1},
            P + "worker/m/1": {"count": 1},
            P + "bad": {"count": -1},
            P + "flag": {"count": True},
            P + "text": "3"}
    c = parse_desired(recs, P)
    assert c.kinds == {"validator": Desired(3, "lag", "as-1", 1.5), "gateway": Desired(2)}
    assert c.workers == {("m@1", "local"): Desired(0, "idle"), ("m@1", "spot"): Desired(2)}
    assert set(c.errors) == {P + "validator/extra", P + "worker/m/1", P + "bad", P + "flag", P + "text"}
    assert "integer >= 0" in c.errors[P + "bad"] and "key shape" in c.errors[P + "worker/m/1"]


def test_choose_victims_not_ready_first_then_newest_and_keeps_ready():
    reps = [Replica("w-0", 0, True), Replica("w-1", 1, True), Replica("w-2", 2, False), Replica("w-3", 3, True)]
    assert choose_victims(reps, 1, 1) == ["w-2"]
    assert choose_victims(reps, 2, 1) == ["w-2", "w-3"]
    assert choose_victims(reps, 4, 1) == ["w-2", "w-3", "w-1"]  # w-0: the last ready one stays
    assert choose_victims(reps, 4, 0) == ["w-2", "w-3", "w-1", "w-0"]
    assert choose_victims([Replica("w-0", 0, True)], 1, 1) == []
    assert choose_victims(reps, 0, 0) == []


def test_indices():
    assert next_free_index([]) == 0 and next_free_index([0, 1, 3]) == 2 and next_free_index([1]) == 0
    assert replica_index("worker-12", "worker-") == 12
    assert replica_index("worker-m-1-3", "worker-") is None and replica_index("worker-m-1-3", "worker-m-1-") == 3


def test_autoscaler_limits_floor_is_today_ceiling_from_cores():
    assert autoscaler_limits_argv(2, 1, 1) == ["--limits", "validator=1:2,gateway=1:1", "--worker-limits", "1:2",
                                               "--pool", "local"]
    assert autoscaler_limits_argv(2, 3, 2)[1] == "validator=1:2,gateway=2:2"
    assert autoscaler_limits_argv(2, 3, 2)[3] == "3:3"  # the floor wins: never fewer than asked for
    assert autoscaler_limits_argv(16, 1, 1, pool="p")[1:] == ["validator=1:16,gateway=1:1", "--worker-limits",
                                                              "1:16", "--pool", "p"]
    with pytest.raises(ValueError):
        autoscaler_limits_argv(0, 1, 1)
    # up --multi-model --lend: one replica per host at most, to zero when idle, sleeping / waking / lending itself
    assert autoscaler_limits_argv(2, 3, 1, hosts=True)[2:] == ["--worker-limits", "1:3", "--scale-to-zero",
                                                              "--carry-sleep", "--lend", "--pool", "local"]


def test_lend_needs_multi_model_and_turns_the_autoscaler_on_for_hosts(tmp_path):
    with pytest.raises(ValueError, match="lend"):
        StackConfig(tmp_path, lend=True)
    assert StackConfig(tmp_path, multi_model=True, autoscaler=True).autoscaler is False
    assert StackConfig(tmp_path, multi_model=True, autoscaler=True, lend=True).autoscaler is True


def test_hosts_are_not_started_or_stopped_by_a_versions_desired_count(sup):
    """Under --multi-model the workers are hosts: a desired count of 0 or 3 for a version changes no process
    (the autoscaler carries it out by sleeping, waking and lending, actors/autoscaler/lend_carry.py)."""
    import dataclasses

    sup.scaling.cfg = dataclasses.replace(sup.cfg, multi_model=True)
    key = desired_key("worker", "m", "1", "local")
    for count in (0, 3):
        assert sup.scaling_round({key: rec(count)}, None, now=2000.0 + count) is False
        assert names(sup, "worker") == ["worker-0"] and sup.signals == []


# -- the supervisor on fake processes -------------------------------------------------------------


class FakeProc:
    """What the supervisor reads of a Popen: pid, poll(), returncode, wait()."""

    next_pid = 50000

    def __init__(self) -> None:
        FakeProc.next_pid += 1
        self.pid, self.returncode = FakeProc.next_pid, None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def exit(self, rc: int = 0) -> None:
        self.returncode = rc


@pytest.fixture
def sup(tmp_path, monkeypatch):
    """A supervisor whose stack and processes are fakes, model version ``m@1`` running with 1 worker
    (ready), 1 validator (ready), on a 2-core machine, past readiness."""
    monkeypatch.setattr(scaling, "kind_accepts", lambda kind, opt: True)
    signals: list[tuple[str, signal.Signals]] = []
    monkeypatch.setattr(scaling, "signal_actor", lambda a, sig: signals.append((a.name, sig)))
    s = Supervisor(StackConfig(tmp_path, port=0, model_name="m", model_version="1", cores=2))
    off = SimpleNamespace(running=False, pid=None, name="x")
    s.stack = SimpleNamespace(etcd_url="http://127.0.0.1:1", nats=off, etcd=off)

    def spawn(a):
        a.proc, a.stopped_by = FakeProc(), None
        a.spawned_at, a.ready_at, a.term_sent_at = 1000.0, None, None
    s.procs.spawn = spawn
    s.procs.actors = [*s.factory.version_actors(s.model_ref, 1), s.factory.validator(0)]
    for a in s.actors:
        spawn(a)
        a.ready_at = 1001.0
    s.versions.adopt(s.model_ref, "fp")
    s.health.ready = True
    s.signals = signals
    return s


def names(s, kind):
    return sorted(a.name for a in s.actors if a.kind == kind and a.running and a.stopped_by is None)


def rec(count, reason="test"):
    return {"count": count, "ts": 1.0, "reason": reason, "by": "tester"}


def test_worker_argv_carries_pool_and_names_stay(sup):
    w = sup.actor("worker-0")
    assert w.argv[w.argv.index("--worker-id") + 1] == "worker-0" and w.argv[w.argv.index("--pool") + 1] == "local"
    other = sup.factory.worker("m@2", 3, "spot")
    assert other.name == "worker-m-2-3" and other.argv[other.argv.index("--pool") + 1] == "spot"


def test_absent_keys_keep_todays_counts(sup):
    assert sup.scaling_round({}, None, now=2000.0) is False
    assert names(sup, "worker") == ["worker-0"] and names(sup, "validator") == ["validator-0"]
    assert sup.scaling_log == [] and sup.events == []


def test_validators_scale_up_then_down_newest_first_and_stay_stopped(sup, tmp_path):
    assert sup.scaling_round({desired_key("validator"): rec(3, "pending 40")}, None, now=2000.0)
    assert names(sup, "validator") == ["validator-0", "validator-1", "validator-2"]
    assert [e["action"] for e in sup.scaling_log] == ["start", "start"]
    assert any("scale validator 1 -> 3: started validator-1" in e and "pending 40 (by tester)" in e for e in sup.events)
    sup.actor("validator-1").ready_at = 2001.0
    sup.scaling_round({desired_key("validator"): rec(1, "idle")}, None, now=2002.0)
    # validator-2 (not ready) and validator-1 (the newest ready one) drain; validator-0 stays
    assert sorted(sup.signals) == [("validator-1", signal.SIGTERM), ("validator-2", signal.SIGTERM)]
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert pids["stopped"]["validator-1"] == {"by": "autoscaler", "status": None, "draining": True}
    for n in ("validator-1", "validator-2"):
        sup.actor(n).proc.exit(0)
    sup.scaling_round({desired_key("validator"): rec(1, "idle")}, None, now=2004.0)
    exited = [e for e in sup.scaling_log if e["action"] == "exited"]
    assert {e["name"] for e in exited} == {"validator-1", "validator-2"} and exited[0]["drain_s"] == 2.0
    assert json.loads((tmp_path / "pids.json").read_text())["stopped"]["validator-2"] == {"by": "autoscaler",
                                                                                          "status": 0}
    assert sup.health.supervise_once() is True and names(sup, "validator") == ["validator-0"]  # not restarted
    assert sup.start_stopped() == []  # SIGHUP starts only what the operator stopped
    sup.scaling_round({desired_key("validator"): rec(2)}, None, now=2010.0)
    assert names(sup, "validator") == ["validator-0", "validator-1"]  # the lowest free index again
    assert [a.name for a in sup.actors].count("validator-1") == 1


def test_scale_down_kills_a_replica_still_draining_after_stop_timeout(sup):
    sup.scaling_round({desired_key("validator"): rec(2)}, None, now=2000.0)
    sup.scaling_round({desired_key("validator"): rec(1)}, None, now=2001.0)
    sup.scaling_round({desired_key("validator"): rec(1)}, None, now=2001.0 + sup.cfg.stop_timeout_s + 1)
    sup.scaling_round({desired_key("validator"): rec(1)}, None, now=2001.0 + sup.cfg.stop_timeout_s + 2)
    assert sup.signals == [("validator-1", signal.SIGTERM), ("validator-1", signal.SIGKILL)]


def test_workers_scale_up_within_the_core_cap_and_readiness_is_reported(sup):
    key = desired_key("worker", "m", "1", "local")
    sup.scaling_round({key: rec(5, "queue 9000 tokens")}, None, now=2000.0)
    assert names(sup, "worker") == ["worker-0", "worker-1"]  # max_workers = cores = 2
    w1 = sup.actor("worker-1")
    assert w1.pool == "local" and w1.dynamic and "--pool" in w1.argv
    assert sup.scaling.wants_ready_records()
    stale = {workers_prefix("m", "1") + "worker-1": {"pid": w1.pid + 1}}
    sup.scaling_round({key: rec(5)}, stale, now=2003.0)
    assert w1.ready_at is None  # an older incarnation's lease does not count
    sup.scaling_round({key: rec(5)}, {workers_prefix("m", "1") + "worker-1": {"pid": w1.pid}}, now=2004.5)
    ready = [e for e in sup.scaling_log if e["action"] == "ready"]
    assert ready == [dict(ready[0], name="worker-1", cold_start_s=1004.5, target="worker/m/1/local")]
    assert not sup.scaling.wants_ready_records()


def test_validator_readiness_from_its_metrics_record(sup):
    sup.scaling_round({desired_key("validator"): rec(2)}, None, now=2000.0)
    v1 = sup.actor("validator-1")
    sup.scaling_round({}, {all_metrics_prefix() + f"validator/validator-{v1.pid}": {"pid": v1.pid}}, now=2002.0)
    assert v1.ready_at == 2002.0


def test_last_ready_worker_waits_for_its_replacement_on_another_pool(sup):
    recs = {desired_key("worker", "m", "1", "local"): rec(0, "move to spot"),
            desired_key("worker", "m", "1", "spot"): rec(1, "move to spot")}
    sup.scaling_round(recs, None, now=2000.0)
    assert names(sup, "worker") == ["worker-0", "worker-1"] and sup.signals == []
    assert sup.actor("worker-1").pool == "spot"
    sup.actor("worker-1").ready_at = 2005.0
    sup.scaling_round(recs, None, now=2006.0)
    assert sup.signals == [("worker-0", signal.SIGTERM)]


def test_scale_to_zero_stops_the_last_worker_and_scale_from_zero_starts_one(sup):
    key = desired_key("worker", "m", "1", "local")
    sup.scaling_round({key: rec(0, "idle 300 s")}, None, now=2000.0)
    assert sup.signals == [("worker-0", signal.SIGTERM)]
    sup.actor("worker-0").proc.exit(0)
    sup.scaling_round({key: rec(1, "request waiting")}, None, now=2003.0)
    assert names(sup, "worker") == ["worker-0"] and sup.actor("worker-0").dynamic


def test_nothing_before_readiness_or_for_unknown_versions_and_gateways(sup, caplog):
    sup.health.ready = False
    assert not sup.scaling_round({desired_key("validator"): rec(2)}, None, now=2000.0)
    sup.health.ready = True
    recs = {desired_key("gateway"): rec(3), desired_key("worker", "other", "1", "local"): rec(2)}
    assert not sup.scaling_round(recs, None, now=2001.0)
    assert not sup.scaling_round(recs, None, now=2002.0)
    assert sum("gateways bind fixed ports" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_operator_stopped_replica_keeps_its_name_and_count_is_met_elsewhere(sup):
    sup.scaling_round({desired_key("validator"): rec(2)}, None, now=2000.0)
    v1 = sup.actor("validator-1")
    v1.proc.exit(0)
    sup.health.supervise_once()  # a stop the supervisor did not send: "stopped by operator"
    assert v1.stopped_by == "operator"
    sup.scaling_round({desired_key("validator"): rec(2)}, None, now=2001.0)
    assert names(sup, "validator") == ["validator-0", "validator-2"]


def test_terminate_does_not_resignal_a_draining_replica(monkeypatch):
    sent: list[tuple[int, signal.Signals]] = []
    monkeypatch.setattr(processes, "_killpg", lambda pid, sig: sent.append((pid, sig)))
    a, b = (processes.ActorProcess(n, "worker", [], None) for n in ("worker-0", "worker-1"))
    a.proc, b.proc = FakeProc(), FakeProc()
    b.term_sent_at = 1.0
    processes.terminate([a, b], 0.01)
    assert (a.proc.pid, signal.SIGTERM) in sent and (b.proc.pid, signal.SIGTERM) not in sent


def test_autoscaler_actor_under_up_only_when_asked_and_installed(tmp_path, monkeypatch):
    from actors import kinds

    assert START_ORDER.index("autoscaler") < START_ORDER.index("gateway")
    monkeypatch.setattr(scaling, "kind_accepts", lambda kind, opt: False)
    monkeypatch.setitem(kinds.ACTOR_MODULES, "autoscaler", "actors.autoscaler.actor")

    def built(**kw):
        s = Supervisor(StackConfig(tmp_path, port=0, cores=2, actor_args={"autoscaler": ["--tick-s", "0.5"]}, **kw))
        s.stack = SimpleNamespace(etcd_url="http://127.0.0.1:1")
        s.gateway_ports = [8000]
        s.procs.actors = s.factory.initial()
        return [a for a in s.actors if a.kind == "autoscaler"]

    assert built() == []
    (auto,) = built(autoscaler=True, workers=1)
    tail = auto.argv[auto.argv.index("--limits"):]
    assert tail == ["--limits", "validator=1:2,gateway=1:1", "--worker-limits", "1:2", "--pool", "local",
                    "--tick-s", "0.5"]
    monkeypatch.delitem(kinds.ACTOR_MODULES, "autoscaler")
    assert built(autoscaler=True) == []


def test_every_argv_under_up_parses(tmp_path):
    """With the autoscaler on, every argv the supervisor builds (the autoscaler's limits, a worker's --pool)
    is accepted by the CLI parser."""
    import importlib

    from actors.kinds import ACTOR_MODULES
    from control.ops.cli import build_parser

    for kind in ("autoscaler", "worker"):
        if kind not in ACTOR_MODULES:
            pytest.skip(f"actor kind {kind!r} not registered yet (actors/kinds.py)")
        try:
            importlib.import_module(ACTOR_MODULES[kind])
        except ModuleNotFoundError as e:
            pytest.skip(f"{ACTOR_MODULES[kind]} does not import yet: {e}")
    s = Supervisor(StackConfig(tmp_path, port=0, cores=2, autoscaler=True, workers=2, gateways=2))
    s.stack = SimpleNamespace(etcd_url="http://127.0.0.1:1")
    s.gateway_ports = [8000, 8001]
    s.procs.actors = s.factory.initial()
    s.procs.actors.append(s.factory.worker(s.model_ref, 2, "spot"))
    assert [a.name for a in s.actors if a.kind == "autoscaler"] == ["autoscaler-0"]
    for a in s.actors:
        args = build_parser().parse_args(a.argv[3:])
        assert args.actor_kind == a.kind
    # what up seeds as desired counts (the autoscaler counts them as starting until they register)
    name, version = s.model_ref.split("@")
    assert scaling.started_counts(s.actors, s.model_ref, s.cfg.pool) == {
        desired_key("validator"): 1, desired_key("worker", name, version, "local"): 2,
        desired_key("worker", name, version, "spot"): 1}


def test_worker_with_a_due_preemption_notice_is_stopped_and_not_replaced_by_name(sup, tmp_path):
    from control.state.names import preemption_notice_key

    key = desired_key("worker", "m", "1", "local")
    sup.scaling_round({key: rec(2, "replace the noticed worker")}, None, now=2000.0)
    sup.actor("worker-1").ready_at = 2001.0
    notices = {preemption_notice_key("worker-0"): {"deadline": 2010.0, "reason": "spot reclaim"}}
    sup.scaling_round({key: rec(2)}, None, now=2005.0, notices=notices)
    assert sup.signals == []  # not due yet: it still counts, nothing else starts
    sup.scaling_round({key: rec(2)}, None, now=2010.0, notices=notices)
    assert sup.signals == [("worker-0", signal.SIGTERM)] and sup.actor("worker-0").stopped_by == "preempted"
    assert any("preemption notice is due (spot reclaim)" in e for e in sup.events)
    sup.actor("worker-0").proc.exit(0)
    sup.scaling_round({key: rec(2)}, None, now=2012.0, notices=notices)
    assert names(sup, "worker") == ["worker-1", "worker-2"]  # the count is met again, under a new name
    stopped = json.loads((tmp_path / "pids.json").read_text())["stopped"]
    assert stopped["worker-0"] == {"by": "preempted", "status": 0}
    assert sup.health.supervise_once() and not sup.actor("worker-0").running  # not restarted


def test_up_banner_says_whether_the_autoscaler_runs(tmp_path):
    from control.ops.up import _autoscaler_line

    s = Supervisor(StackConfig(tmp_path, port=0, cores=2))
    assert "off (--no-autoscaler)" in _autoscaler_line(s)
    s.cfg = dataclasses.replace(s.cfg, autoscaler=True)
    assert "off (its actor kind is not installed)" in _autoscaler_line(s)
    s.procs.actors = [processes.ActorProcess("autoscaler-0", "autoscaler", [], tmp_path / "a.log")]
    assert _autoscaler_line(s).startswith("autoscaler: on (validators 1..2, workers 1..2 per version, gateways 1)")


# -- the sleeping tier (issue [28], control/ops/supervisor_sleep.py) ------------------------------------------


@pytest.fixture
def sleepy(sup):
    """``sup`` with the sleeping tier on (horizon 300 s) and worker-1 started and ready."""
    sup.scaling = scaling.ScalingReconciler(dataclasses.replace(sup.cfg, sleep_horizon_s=300.0), sup.procs,
                                            sup.factory, sup.versions.running, lambda: True)
    key = desired_key("worker", "m", "1", "local")
    sup.scaling.round({key: rec(2)}, None, now=2000.0)
    sup.actor("worker-1").ready_at = 2001.0
    sup.scaling.take_commands()
    return sup, key


def test_scale_down_sleeps_and_scale_up_wakes_before_spawning(sleepy):
    from control.state.names import sleep_key

    sup, key = sleepy
    sup.scaling.round({key: rec(1, "idle")}, None, now=2010.0)
    w1 = sup.actor("worker-1")
    assert sup.signals == [] and w1.running and w1.sleeping_since == 2010.0 and w1.stopped_by is None
    [(k, v)] = sup.scaling.take_commands()
    assert k == sleep_key("worker-1") and v["want"] == "sleep" and v["by"] == "supervisor"
    sup.scaling.round({key: rec(1)}, None, now=2011.0)
    assert sup.scaling.take_commands() == []  # the sleeper does not count as current: nothing more to do
    pids = {a.name: a.pid for a in sup.actors}
    sup.scaling.round({key: rec(2, "queue")}, None, now=2020.0)
    assert [v["want"] for _, v in sup.scaling.take_commands()] == ["wake"] and w1.sleeping_since is None
    assert {a.name: a.pid for a in sup.actors} == pids  # woken, nothing spawned
    assert [e["action"] for e in sup.scaling_log][-2:] == ["sleep", "wake"]


def test_a_sleeper_past_the_horizon_exits_and_one_woken_by_its_scheduler_is_awake(sleepy):
    from control.state.names import sleep_key

    sup, key = sleepy
    sup.scaling.round({key: rec(1)}, None, now=2010.0)
    w1 = sup.actor("worker-1")
    sup.scaling.observe_sleep({sleep_key("worker-1"): {"want": "wake", "by": "scheduler", "ts": 1.0}})
    assert w1.sleeping_since is None  # a scheduler woke it: awake again
    sup.scaling.round({key: rec(1)}, None, now=2011.0)  # 2 awake for a count of 1: it sleeps again
    assert w1.sleeping_since == 2011.0
    sup.scaling.round({key: rec(1)}, None, now=2011.0 + 299.0)
    assert sup.signals == []
    sup.scaling.round({key: rec(1)}, None, now=2011.0 + 300.0)
    assert sup.signals == [("worker-1", signal.SIGTERM)] and w1.stopped_by == "autoscaler"


def test_the_tier_off_stops_as_before(sup):
    key = desired_key("worker", "m", "1", "local")
    sup.scaling_round({key: rec(2)}, None, now=2000.0)
    sup.actor("worker-1").ready_at = 2001.0
    sup.scaling_round({key: rec(1)}, None, now=2010.0)
    assert sup.signals == [("worker-1", signal.SIGTERM)] and sup.scaling.take_commands() == []


def test_the_autoscalers_sleep_plan_decides_whether_a_victim_sleeps_and_when_a_sleeper_exits(sleepy):
    """The desired record's ``sleep`` (actors/autoscaler/sleep_tier.py): ``keep`` 0 stops the victim, ``keep`` 1
    sleeps it, and a sleeper named in ``exit`` stops long before the horizon."""
    sup, key = sleepy
    w1 = sup.actor("worker-1")
    nothing_wanted = dict(rec(1, "idle"), sleep={"keep": 0, "horizon_s": 500.0, "exit": []})
    sup.scaling.round({key: nothing_wanted}, None, now=2010.0)
    assert sup.signals == [("worker-1", signal.SIGTERM)] and w1.sleeping_since is None  # not worth sleeping
    assert sup.scaling.take_commands() == []


def test_a_sleeper_named_in_the_plans_exit_stops_before_the_horizon(sleepy):
    sup, key = sleepy
    w1 = sup.actor("worker-1")
    sup.scaling.round({key: dict(rec(1, "idle"), sleep={"keep": 1, "horizon_s": 500.0, "exit": []})}, None,
                      now=2010.0)
    assert sup.signals == [] and w1.sleeping_since == 2010.0  # wanted again: it sleeps
    sup.scaling.round({key: dict(rec(1), sleep={"keep": 1, "horizon_s": 500.0, "exit": []})}, None, now=2100.0)
    assert sup.signals == []
    sup.scaling.round({key: dict(rec(1), sleep={"keep": 0, "horizon_s": 500.0, "exit": ["worker-1"]})}, None,
                      now=2101.0)
    assert sup.signals == [("worker-1", signal.SIGTERM)] and w1.stopped_by == "autoscaler"  # 91 s < the 300 s horizon
