"""The autoscaler's live lends on multi-version hosts (actors/autoscaler/lend_carry.py; issue [29] item 1):
the simulator's lending rule (lending.plan_starts) on worker records, with the hosts' one-replica-per-version
rule, protection of versions short themselves, retries and the counts of cold starts."""

from __future__ import annotations

import pytest

from actors.autoscaler.collect import WorkerRecord
from actors.autoscaler.lend_carry import LendCarrier
from actors.autoscaler.lending import LendingConfig, SpareHost, plan_starts


def rec(wid: str, model: str, host: str, sleeping: bool = False, since: float = 0.0) -> WorkerRecord:
    name, _, version = model.partition("@")
    return WorkerRecord(wid, name, version, "local", sleeping, host, since if sleeping else 0.0)


def test_a_version_short_of_replicas_is_lent_another_versions_sleeping_host():
    workers = [rec("h0-v1", "a@1", "h0", sleeping=True, since=100.0), rec("h1-v1", "b@1", "h1")]
    lender = LendCarrier()
    asks = lender.asks(1000.0, workers, {"a/1/local": 0, "b/1/local": 2}, {"b@1": 3})
    assert [(a.host_id, a.name, a.version, a.queue_len, a.lent_from) for a in asks] == [("h0", "b", "1", 3, "a@1")]
    assert lender.cold == {} and lender.on_the_way("b@1") == 1


def test_a_host_with_two_sleepers_names_both_as_lent_from():
    workers = [rec("h0-v1", "a@1", "h0", sleeping=True), rec("h0-v2", "c@1", "h0", sleeping=True)]
    asks = LendCarrier().asks(0.0, workers, {"a/1/local": 0, "b/1/local": 1, "c/1/local": 0})
    assert [(a.host_id, a.lent_from) for a in asks] == [("h0", "a@1, c@1")]


def test_own_sleepers_are_woken_not_lent_and_a_version_short_itself_keeps_its_sleepers():
    # b wants 2 and has a sleeper of its own on h2: that is a wake (the sleep carrier's), not a lend; a wants
    # 1 more itself, so its sleeper on h0 is protected: nothing to lend, b's second replica is a cold start
    workers = [rec("h0-v1", "a@1", "h0", sleeping=True), rec("h1-v1", "b@1", "h1"),
               rec("h2-v1", "b@1", "h2", sleeping=True), rec("h3-v1", "a@1", "h3")]
    lender = LendCarrier()
    asks = lender.asks(0.0, workers, {"a/1/local": 2, "b/1/local": 3})
    assert asks == [] and lender.cold == {"b@1": 1}


def test_a_host_where_the_version_is_resident_already_is_not_lent_to_it():
    # h0 holds b awake and a asleep: lending h0 to b would be a second replica of b on one host
    workers = [rec("h0-v1", "b@1", "h0"), rec("h0-v2", "a@1", "h0", sleeping=True)]
    lender = LendCarrier()
    assert lender.asks(0.0, workers, {"a/1/local": 0, "b/1/local": 2}) == [] and lender.cold == {"b@1": 1}


def test_an_ask_on_its_way_counts_as_a_replica_until_done_or_its_retry():
    workers = [rec("h0-v1", "a@1", "h0", sleeping=True), rec("h1-v1", "c@1", "h1", sleeping=True)]
    lender = LendCarrier(retry_s=10.0)
    want = {"a/1/local": 0, "b/1/local": 1, "c/1/local": 0}
    first = lender.asks(0.0, workers, want)
    assert len(first) == 1 and lender.on_the_way("b@1") == 1
    assert lender.asks(5.0, workers, want) == []  # on its way: not asked again, no other host taken
    again = lender.asks(11.0, workers, want)  # not carried out within retry_s: asked again
    assert [a.host_id for a in again] == [first[0].host_id]
    loaded = workers + [rec("h0-v2", "b@1", first[0].host_id)]  # the host's record shows b resident: done
    assert lender.asks(12.0, loaded, want) == [] and lender.on_the_way("b@1") == 0


def test_the_longest_asleep_is_lent_first_and_awake_workers_of_own_processes_count():
    workers = [rec("h0-v1", "a@1", "h0", sleeping=True, since=50.0),
               rec("h1-v1", "c@1", "h1", sleeping=True, since=10.0), rec("w-0", "b@1", "")]
    asks = LendCarrier().asks(100.0, workers, {"b/1/local": 2, "a/1/local": 0, "c/1/local": 0})
    assert [a.host_id for a in asks] == ["h1"]  # one short (w-0 serves b): c has slept longest


def test_lending_off_plans_no_lend_and_counts_cold_starts():
    workers = [rec("h0-v1", "a@1", "h0", sleeping=True)]
    lender = LendCarrier(LendingConfig(lend=False))
    assert lender.asks(0.0, workers, {"a/1/local": 0, "b/1/local": 1}) == [] and lender.cold == {"b@1": 1}


def test_plan_starts_holds_keeps_a_model_off_hosts_where_it_is_resident():
    spares = [SpareHost("h0", "a@1", 0.0), SpareHost("h1", "a@1", 1.0)]
    starts, left = plan_starts({"b@1": 1}, spares, LendingConfig(), holds={"b@1": ["h0"]})
    assert [(s.how, s.host) for s in starts] == [("lend", "h1")] and [s.host for s in left] == ["h0"]
    with pytest.raises(ValueError, match="b@1"):
        plan_starts({"b@1": -1}, spares, LendingConfig())


def test_a_lend_is_a_decision_of_its_own_loop_in_the_status_report():
    from actors.autoscaler.decisions import Decision, DecisionLog
    from control.ops.autoscaler_cli import build_report, format_report

    log = DecisionLog()
    log.extend([Decision(5.0, "lend", "worker/b/1/local", 0, 1, "lend host h0 (a@1 asleep there) to b@1",
                         {"host": "h0", "lent_from": "a@1"})])
    back = DecisionLog.from_json(log.to_json())  # as etcd stores it, read back by a successor
    text = format_report(build_report({"decisions": back.to_json()}))
    assert "[lend] worker/b/1/local 0 -> 1: lend host h0 (a@1 asleep there) to b@1" in text
    assert "inputs: host=h0, lent_from=a@1" in text
    with pytest.raises(ValueError, match="loop"):
        Decision(5.0, "borrow", "worker/b/1/local", 0, 1, "x")


@pytest.mark.parametrize("argv,why", [(["--lend"], "needs --multi-model"),
                                      (["--multi-model", "--lend", "--no-autoscaler"], "contradict")])
def test_up_refuses_lend_options_that_do_not_fit_together(argv, why, tmp_path, capsys):
    from control.ops.cli import build_parser
    from control.ops.up import main_up

    args = build_parser().parse_args(["up", "--state-dir", str(tmp_path), *argv])
    assert main_up(args) == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "pids.json").exists()  # nothing started


def test_an_invalid_autoscale_is_logged_once_per_version_and_the_defaults_used(caplog):
    from actors.autoscaler.service import Autoscaler, AutoscalerConfig

    scaler = Autoscaler(None, None, AutoscalerConfig(elect=False))
    scaler.state.versions = {("m", "1"): {"autoscale": {"min_worker": 1}}}
    for _ in range(5):
        assert scaler._version_limits("m", "1") == (scaler.cfg.worker_limits, scaler.cfg.pools.default_slo)
    said = [r for r in caplog.records if "autoscale.min_worker" in r.getMessage()]
    assert len(said) == 1 and "m@1" in said[0].getMessage()
