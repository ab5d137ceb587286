"""Per-role NATS permissions (control/ops/nats_roles.py): pure checks of the allow lists built from
bus/subjects.py. The server-side behaviour is tested in tests/integration/test_nats_roles.py."""

from __future__ import annotations

import pytest

from bus import subjects
from bus.nats_bus import default_inbox_prefix, redact
from control.ops import nats_roles
from control.ops.nats_roles import ROLES, any_of, role_permissions, role_users


def _all(role: str, op: str) -> list[str]:
    return role_permissions(role)[op].get("allow", [])


def test_wildcards_come_from_the_subject_functions():
    assert any_of(subjects.work) == "as.int.work.*"
    assert any_of(subjects.credits) == "as.int.credits.*.*.*"
    assert any_of(subjects.sched_submit) == "as.int.sched.*.*.submit"
    assert any_of(subjects.gateway_reply) == "_INBOX.*.gw.*.*"
    assert any_of(subjects.done) == subjects.done_all()
    assert any_of(subjects.cancel) == subjects.cancel_all()
    assert any_of(subjects.stats) == subjects.stats_all()


def test_no_role_gets_everything_and_each_reads_its_own_inbox():
    for role in ROLES:
        perms = role_permissions(role)
        for op in ("publish", "subscribe"):
            assert ">" not in perms[op].get("allow", []), (role, op)
        assert subjects.role_inbox_prefix(role) + ".>" in _all(role, "subscribe")
        others = [subjects.role_inbox_prefix(r) + ".>" for r in ROLES if r != role]
        assert not set(others) & set(_all(role, "subscribe") + _all(role, "publish"))


def test_jetstream_only_for_the_roles_that_use_it():
    js = {r for r in ROLES if any(s.startswith("$JS.") for s in _all(r, "publish"))}
    assert js == {"gateway", "scheduler", "jobs"}


def test_the_brief_s_examples_are_not_allowed():
    assert not any(s.startswith("as.api") for s in _all("worker", "subscribe"))
    assert any_of(subjects.sched_submit) not in _all("worker", "publish")
    assert any_of(subjects.work) not in _all("validator", "publish")
    assert any_of(subjects.work) not in _all("gateway", "subscribe")
    # only the gateway reads the public API; nobody but the gateway writes into any tenant inbox
    assert [r for r in ROLES if subjects.API_CHAT in _all(r, "subscribe")] == ["gateway"]
    assert [r for r in ROLES if "_INBOX.*.>" in _all(r, "publish")] == ["gateway"]


def test_step_frames_only_from_workers_and_only_to_the_frontends():
    """Frames mix tenants (decision 0052): workers publish them, gateways and the jobs frontend read them,
    and they lie outside every tenant inbox (a tenant's user may subscribe only under ``_INBOX.<tenant>``)."""
    assert [r for r in ROLES if subjects.frames_all() in _all(r, "publish")] == ["worker"]
    assert [r for r in ROLES if subjects.frames_all() in _all(r, "subscribe")] == ["gateway", "jobs"]
    assert not subjects.frames("gw-1").startswith(subjects.INBOX)


def test_the_control_role_publishes_only_host_load_asks_and_answers_nothing():
    """The rollout controller and the autoscaler hear; the autoscaler's lends (--lend) ask hosts to load."""
    assert role_permissions("control")["publish"] == {"allow": ["as.int.host.*.load"]}
    assert "allow_responses" not in role_permissions("control")
    assert role_permissions("worker")["allow_responses"] is True


def test_unknown_roles_and_kinds_are_refused():
    with pytest.raises(ValueError):
        role_permissions("root")
    with pytest.raises(ValueError):
        nats_roles.role_of_kind("nope")
    assert nats_roles.role_of_kind("rollout") == "control"


def test_durable_jetstream_names_are_the_documented_ones():
    """Stream, bucket and consumer names hold data across restarts (docs/state.md): renaming one would orphan
    what is stored, so they are pinned here, and the role permissions grant exactly these."""
    from bus import streams
    assert (streams.USAGE_STREAM, streams.USAGE_CONSUMER, streams.JOBS_STREAM, streams.JOBS_CONSUMER) == \
        ("AS_DONE", "meter", "AS_JOBS", "jobs")
    assert (streams.QUOTA_BUCKET, streams.IDEM_BUCKET, streams.USAGE_BUCKET, streams.JOBS_BUCKET,
            streams.JOBS_OBJECTS) == ("as_quota", "as_idem", "as_usage", "as_jobs", "as_job_data")
    assert streams.journal_stream("m", "v1") == "SCHED_m_v1"
    assert subjects.jobs_submit("acme") == "as.jobs.submit.acme" and nats_roles.JOBS_SUBMIT == "as.jobs.submit.*"
    assert streams.DONE.subjects == ("as.int.done.>",) and streams.JOB_QUEUE.subjects == (nats_roles.JOBS_SUBMIT,)


def test_role_users_and_inbox_prefix_from_the_url():
    users = role_users({r: f"pw-{r}" for r in ROLES})
    assert [u["user"] for u in users] == [f"actorserve-{r}" for r in ROLES]
    assert subjects.role_of_user("actorserve-worker") == "worker"
    assert subjects.role_of_user("actorserve") is None and subjects.role_of_user("0123abcd4567") is None
    assert default_inbox_prefix("nats://actorserve-gateway:pw@127.0.0.1:4222") == "_INBOX_gateway"
    assert default_inbox_prefix("nats://actorserve:pw@127.0.0.1:4222") == "_INBOX"
    assert default_inbox_prefix("nats://127.0.0.1:4222") == "_INBOX"
    assert redact("nats://actorserve-worker:secret@127.0.0.1:1,nats://h:2") == \
        "nats://actorserve-worker:***@127.0.0.1:1,nats://h:2"
