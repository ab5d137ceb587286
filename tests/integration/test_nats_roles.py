"""Per-role NATS users on a real nats-server (control/ops/nats_roles.py): each internal role can publish and
subscribe on its own subjects, and gets a permission violation, with nothing delivered, outside them.

The matrix publishes / subscribes every sample subject as every role and compares what the server let
through with what the role's allow lists say; the brief's examples (a worker reading ``as.api.>`` or
publishing a submit, a validator dispatching to a worker, a gateway reading dispatches) are also checked
by name. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import pytest
from nats.js.api import KeyValueConfig

from bus import subjects
from bus.memory import subject_matches
from control.ops.embedded import EmbeddedNats
from control.ops.nats_roles import ROLES, role_passwords, role_permissions

# Concrete subjects touching every role's lists (and some nobody but the operator may touch).
SAMPLES = [
    subjects.API_CHAT, subjects.API_COMPLETIONS, subjects.API_CANCEL, subjects.VALIDATE,
    subjects.sched_submit("m", "v1"), subjects.sched_events("m", "v1"), subjects.sched_leader("m", "v1"),
    subjects.work("w1"), subjects.cancel("r1"), subjects.gateway_cancel("r1"), subjects.credits("m", "v1", "w1"),
    subjects.stats("w1"), subjects.frames("gw-0"),
    subjects.done("m", "v1"), subjects.gateway_reply("acme", "gw-0", "r1"), "_INBOX.acme.x",
    "_INBOX.acme.a.b", "as.jobs.submit.acme", "as.other", "_INBOX_worker.x", "_INBOX_gateway.x",
    "_INBOX_scheduler.x",
]


DENIED_S = 0.4  # JetStream API timeout of the refused requests (a denied request is never answered)


def _allowed(role: str, op: str, subject: str) -> bool:
    perms = role_permissions(role)[op]
    if any(subject_matches(p, subject) for p in perms.get("deny", [])):
        return False
    return any(subject_matches(p, subject) for p in perms.get("allow", []))


async def _wait_until(cond, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


class _Conn:
    """A role's connection that records the server's asynchronous errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def open(self, url: str, inbox_prefix: str = "_INBOX") -> "_Conn":
        async def on_error(e):
            self.errors.append(str(e))
        self.nc = await nats.connect(url, inbox_prefix=inbox_prefix, error_cb=on_error, allow_reconnect=False,
                                     connect_timeout=5)
        return self

    def violations(self, what: str) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower() and what in e]


@pytest.fixture
async def server(tmp_path):
    srv = EmbeddedNats(tmp_path, auth=True)
    async with srv:
        yield srv


async def _role(srv: EmbeddedNats, role: str) -> _Conn:
    return await _Conn().open(srv.role_url(role), inbox_prefix=subjects.role_inbox_prefix(role))


async def test_role_passwords_are_private_and_stable(server, tmp_path):
    path = tmp_path / "nats-role-passwords.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert server.config_path.stat().st_mode & 0o777 == 0o600
    assert role_passwords(tmp_path) == role_passwords(tmp_path)
    assert set(role_passwords(tmp_path)) == set(ROLES)
    with pytest.raises(Exception):  # a wrong password is refused
        await nats.connect(server.url, user="actorserve-worker", password="nope", allow_reconnect=False,
                           connect_timeout=3, max_reconnect_attempts=0)


async def test_publish_matrix(server):
    admin = await _Conn().open(server.client_url)
    got: list[tuple[str, str]] = []

    async def on_msg(m):
        got.append((m.data.decode(), m.subject))
    await admin.nc.subscribe(">", cb=on_msg)
    await admin.nc.flush()
    conns = {r: await _role(server, r) for r in ROLES}
    try:
        for role, c in conns.items():
            for s in SAMPLES:
                await c.nc.publish(s, role.encode())
            await c.nc.flush()
        expected = {(r, s) for r in ROLES for s in SAMPLES if _allowed(r, "publish", s)}
        await _wait_until(lambda: expected <= set(got))
        # nats-server reports no -ERR for a denied publish to an _INBOX* subject (it only drops it), so
        # the error is awaited for the others and non-delivery is checked for all
        denied = {(r, s) for r in ROLES for s in SAMPLES if not s.startswith("_INBOX")} - expected
        await _wait_until(lambda: all(conns[r].violations(f'"{s}"') for r, s in denied))
        await asyncio.sleep(0.2)  # late deliveries would show up here
        assert set(got) == expected
    finally:
        for c in [admin, *conns.values()]:
            await c.nc.close()


async def test_subscribe_matrix(server):
    admin = await _Conn().open(server.client_url)
    conns = {r: await _role(server, r) for r in ROLES}
    got: list[tuple[str, str]] = []
    try:
        for role, c in conns.items():
            for s in SAMPLES:
                async def on_msg(m, role=role):
                    got.append((role, m.subject))
                await c.nc.subscribe(s, cb=on_msg)
            await c.nc.flush()
        expected = {(r, s) for r in ROLES for s in SAMPLES if _allowed(r, "subscribe", s)}
        denied = {(r, s) for r in ROLES for s in SAMPLES if not s.startswith("_INBOX")} - expected
        await _wait_until(lambda: all(conns[r].violations(f'"{s}"') for r, s in denied))  # see test_publish_matrix
        for s in SAMPLES:
            await admin.nc.publish(s, b"admin")
        await admin.nc.flush()
        await _wait_until(lambda: expected <= set(got))
        await asyncio.sleep(0.2)
        assert set(got) == expected
    finally:
        for c in [admin, *conns.values()]:
            await c.nc.close()


async def test_the_brief_s_examples(server):
    """Named cases: each is a permission violation and nothing reaches the other side."""
    admin = await _Conn().open(server.client_url)
    worker, validator, gateway, scheduler = [await _role(server, r) for r in
                                             ("worker", "validator", "gateway", "scheduler")]
    seen: list[str] = []

    async def on_msg(m):
        seen.append(m.subject)
    try:
        await admin.nc.subscribe("as.int.>", cb=on_msg)
        await admin.nc.flush()
        api_msgs, dispatches = [], []

        async def to_api(m):
            api_msgs.append(m)

        async def to_dispatches(m):
            dispatches.append(m)

        async def ack(m):
            await m.respond(b"ack")
        await worker.nc.subscribe("as.api.>", cb=to_api)
        await gateway.nc.subscribe("as.int.work.*", cb=to_dispatches)
        await gateway.nc.subscribe(subjects.work("w1"), cb=to_dispatches)
        await worker.nc.publish(subjects.sched_submit("m", "v1"), b"{}")
        await validator.nc.publish(subjects.work("w1"), b"{}")
        for c in (worker, validator, gateway):
            await c.nc.flush()
        await _wait_until(lambda: worker.violations('"as.api.>"') and worker.violations("as.int.sched.m.v1.submit")
                          and validator.violations("as.int.work.w1") and len(gateway.violations("as.int.work")) == 2)
        # what they are allowed to do still flows: a dispatch from the scheduler reaches the worker
        await worker.nc.subscribe(subjects.work("w1"), cb=ack)
        await worker.nc.flush()
        # nats-server v2.15 now and then drops the first delivery to a subscription made just after a denied
        # one (about 1 run in 12 here, and the second request arrives); the scheduler retries a dispatch that
        # gets no ack (SchedulerConfig.max_attempts), so the test does the same, a bounded number of times
        reply, attempts = None, 0
        while reply is None and attempts < 4:
            attempts += 1
            try:
                reply = await scheduler.nc.request(subjects.work("w1"), b"{}", timeout=2)
            except nats.errors.TimeoutError:
                pass
        assert reply is not None and reply.data == b"ack"
        await admin.nc.publish(subjects.API_CHAT, b"{}")
        await admin.nc.flush()
        await asyncio.sleep(0.3)
        assert api_msgs == [] and dispatches == []
        assert subjects.sched_submit("m", "v1") not in seen
        assert seen.count(subjects.work("w1")) == attempts  # the scheduler's dispatches only, not the validator's
    finally:
        for c in (admin, worker, validator, gateway, scheduler):
            await c.nc.close()


async def test_responses_go_only_to_reply_subjects_received(server):
    """A worker may answer the dispatch it received but not publish into the scheduler's inbox unasked."""
    worker, scheduler = await _role(server, "worker"), await _role(server, "scheduler")
    try:
        got = []

        async def on_msg(m):
            got.append(m)
        await scheduler.nc.subscribe("_INBOX_scheduler.unasked", cb=on_msg)
        await scheduler.nc.subscribe("as.int.done.m.v1", cb=on_msg)
        await scheduler.nc.flush()
        await worker.nc.publish("_INBOX_scheduler.unasked", b"x")  # dropped silently (no -ERR for _INBOX*)
        # the allowed publish is repeated (bounded) until it arrives: nats-server 2.15 now and then drops the
        # first message after a denied one (see test_the_brief_s_examples)
        sent = 0
        while not got and sent < 4:
            await worker.nc.publish(subjects.done("m", "v1"), b"allowed")
            await worker.nc.flush()
            sent += 1
            with contextlib.suppress(TimeoutError):
                await _wait_until(lambda: len(got) >= 1, timeout=2.0)
        await asyncio.sleep(0.3)
        assert got and {m.subject for m in got} == {"as.int.done.m.v1"} and len(got) <= sent
    finally:
        await worker.nc.close()
        await scheduler.nc.close()


async def test_jetstream_only_for_its_roles(server):
    gateway, worker = await _role(server, "gateway"), await _role(server, "worker")
    try:
        kv = await gateway.nc.jetstream().create_key_value(KeyValueConfig(bucket="as_idem"))
        await kv.put("k", b"v")
        assert (await kv.get("k")).value == b"v"
        with pytest.raises(Exception):
            await worker.nc.jetstream(timeout=DENIED_S).key_value("as_idem")
        with pytest.raises(Exception):  # a bucket that is not the gateway's: its stream's API is denied too
            await gateway.nc.jetstream(timeout=DENIED_S).create_key_value(KeyValueConfig(bucket="other"))
        with pytest.raises(Exception):
            await (await gateway.nc.jetstream(timeout=DENIED_S).key_value("other")).put("k", b"v")
    finally:
        await gateway.nc.close()
        await worker.nc.close()


async def _denied(coro_fn, what: str) -> None:
    """``coro_fn()`` must fail (a denied JetStream API request gets no answer: it times out)."""
    try:
        await coro_fn()
    except Exception:
        return
    raise AssertionError(f"{what} was allowed")


async def test_roles_use_their_own_streams_and_cannot_touch_the_others(server):
    """The JetStream API is narrowed per stream (bus.subjects.js_stream_api): each role runs its own stream
    operations through bus/jetstream.py, and reading another role's stream (the jobs queue, stored
    responses, a scheduler journal) is refused. About 5 s (each refusal is a 0.4 s API timeout)."""
    from bus.jetstream import JetStream
    from bus import streams

    conns = {r: await _role(server, r) for r in ("gateway", "jobs", "scheduler", "validator")}
    try:
        gw, jobs, sched = (JetStream(conns[r].nc) for r in ("gateway", "jobs", "scheduler"))
        # what each role does in the stack: the gateway submits a job and stores a response ...
        await gw.ensure_stream(streams.JOB_QUEUE)
        await gw.publish(subjects.jobs_submit("acme"), b'{"id": "j1"}', msg_id="j1")
        responses = await gw.bucket(streams.RESPONSES)
        await responses.put("r.acme.resp_1", {"secret": "of acme"})
        assert (await responses.get("r.acme.resp_1")).value == {"secret": "of acme"}
        await (await gw.objects(streams.JOB_DATA)).put("in/j1", b"x" * 300_000)  # chunked (3 chunks)
        # ... the jobs actor pulls it and reads the job data; a scheduler keeps its journal
        pulled = await (await jobs.pull(streams.JOB_QUEUE, streams.JOB_RUNNERS)).fetch(1, 5.0)
        assert [m.data for m in pulled] == [b'{"id": "j1"}']
        assert len(await (await jobs.objects(streams.JOB_DATA)).get("in/j1")) == 300_000
        await (await jobs.bucket(streams.JOBS)).put("j.acme.j1", {"status": "queued"})
        journal = streams.journal("m", "v1")
        await sched.ensure_stream(journal)
        seq = await sched.publish(journal.subjects[0], b"queued", msg_id="q1")
        assert await sched.next_msg(journal.name, journal.subjects[0], seq) == (seq, b"queued")
        assert await sched.last_seq(journal.name) == seq  # what the journal's replay and purge call
        await sched.purge(journal.name, seq + 1)
        assert await sched.next_msg(journal.name, journal.subjects[0], 1) is None
        # nobody else reads them
        for role in ("validator", "scheduler"):
            js = conns[role].nc.jetstream(timeout=DENIED_S)
            await _denied(lambda: js.stream_info(streams.JOBS_STREAM), f"{role} STREAM.INFO of AS_JOBS")
            await _denied(lambda: js.get_msg(streams.JOBS_STREAM, seq=1), f"{role} reading AS_JOBS")
        for role in ("jobs", "scheduler"):
            js = conns[role].nc.jetstream(timeout=DENIED_S)
            await _denied(lambda: js.key_value(streams.RESPONSES_BUCKET), f"{role} opening as_responses")
            await _denied(lambda: js.get_msg(streams.kv_stream(streams.RESPONSES_BUCKET), seq=1,
                                             direct=True), f"{role} direct get of as_responses")
        sjs = conns["scheduler"].nc.jetstream(timeout=DENIED_S)
        await _denied(lambda: sjs.pull_subscribe(subjects.jobs_submit_all(), durable="spy", stream=streams.JOBS_STREAM),
                      "scheduler consumer on AS_JOBS")
        gjs = conns["gateway"].nc.jetstream(timeout=DENIED_S)
        await _denied(lambda: gjs.get_msg(journal.name, seq=1), "gateway reading a scheduler journal")
    finally:
        for c in conns.values():
            await c.nc.close()


async def test_the_control_role_hears_one_models_records(server):
    """The rollout controller subscribes to ``as.int.done.<name>.*`` (one model in rollout), inside its
    ``as.int.done.*.*`` allowance: no violation, and it hears that model's records and no other's."""
    control, worker = await _role(server, "control"), await _role(server, "worker")
    got: list[str] = []
    try:
        async def on_msg(m):
            got.append(m.subject)
        await control.nc.subscribe(subjects.done_of_model("m"), cb=on_msg)
        await control.nc.flush()
        for name in ("m", "other"):
            await worker.nc.publish(subjects.done(name, "v1"), b"record")
        await worker.nc.flush()
        await _wait_until(lambda: got)
        await asyncio.sleep(0.2)
        assert got == [subjects.done("m", "v1")] and not control.violations("as.int.done")
    finally:
        for c in (control, worker):
            await c.nc.close()
