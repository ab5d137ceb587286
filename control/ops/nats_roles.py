"""Per-role NATS users of the embedded nats-server (issue #8 item 8; docs/decisions/0016-nats-roles.md).

Every internal actor connects as the user of its role, ``actorserve-<role>`` (bus.subjects.role_user),
whose publish/subscribe allow lists name only the subjects that role uses. The lists are built here by
pure functions from the subject functions of ``bus/subjects.py``: each subject function is called with
placeholder tokens and the placeholders become ``*`` (``subjects.work`` -> ``as.int.work.*``), so a
renamed or extended subject moves the permissions with it.

Roles and what they do on NATS (read from actors/*, gateway/*, bus/*, control/*):

* ``gateway``: requests ``as.int.validate``; publishes cancels, replies into tenant inboxes (NATS API),
  job submissions; subscribes its reply subjects ``_INBOX.*.gw.*.*``, the public API subjects, completion
  records and worker statistics (metrics), the schedulers' load reports (operator dashboard); JetStream
  (usage stream + KV buckets, quota, idempotency, jobs, responses).
* ``validator``: serves ``as.int.validate``; requests scheduler submits; publishes cancels and error chunks
  to gateway reply subjects.
* ``scheduler``: serves its submit subject; dispatches (request) to ``as.int.work.*``; hears credits,
  events, completion records and cancels; publishes error chunks, completion records, leader announcements;
  JetStream (its queue journal).
* ``worker``: serves its dispatch subject; hears cancels; streams chunks to gateway reply subjects (and
  probes them) or in step frames to ``as.int.frames.<receiver>``; publishes events, completion records,
  credits and statistics.
* ``jobs``: the jobs actor, a frontend like the gateway (validate requests, cancels, its reply subjects)
  plus JetStream (jobs stream, KV bucket, object store).
* ``control``: the rollout controller and the autoscaler (and other control-plane clients): hear completion
  records, and (the autoscaler) load reports ``as.int.load.>`` and worker credits; publish only load asks to
  multi-version hosts ``as.int.host.*.load`` (the autoscaler's lends, actors/autoscaler/lend_carry.py).

Validators, gateways and schedulers also publish their load reports, each on its own kind's
``as.int.load.<kind>.*`` only (actors/load_report.py).

Each role may subscribe to its own inbox ``_INBOX_<role>.>`` (replies to its requests, JetStream API
replies, consumer deliveries) and, where it serves requests, answer them (``allow_responses``: one
reply to the reply subject of each request it received, whoever sent it). JetStream only for ``gateway``,
``scheduler`` and ``jobs``, and only the API subjects of the streams each uses (bus.subjects.js_stream_api:
``$JS.API.STREAM.INFO.<stream>``, ``$JS.API.CONSUMER.*.<stream>...``, ``$JS.API.DIRECT.GET.KV_<bucket>.>``,
...; no ``$JS.API.INFO``, which nats-py does not need here), plus ``$JS.ACK.<stream>.>``, ``$JS.FC.>``,
``$KV.<bucket>.>``, ``$O.<bucket>.>``: the gateway AS_DONE, AS_JOBS, its five KV buckets and the job
object store; jobs AS_JOBS, ``as_jobs``, ``as_quota`` (spend-budget reservations) and the object store;
the scheduler its journals
``SCHED_<name>_<version>`` — any stream name, since a name prefix is no NATS wildcard, but every platform
stream of :func:`platform_streams` denied (what remains: a scheduler could create and read streams of
other names). Tenant users are unchanged (bus/nats_auth.py).

Passwords: one random password per role, kept (mode 0600) in ``<state-dir>/nats-role-passwords.json``
and in the 0600 server config; the supervisor hands each actor its role's URL in the environment
(``ACTORSERVE_NATS``), never in argv or logs.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Mapping

from bus import streams, subjects

ROLES = ("gateway", "validator", "scheduler", "worker", "jobs", "control")
ROLE_PASSWORDS_FILE = "nats-role-passwords.json"

# Supervisor actor kinds (actors/kinds.py ACTOR_MODULES) -> NATS role.
KIND_ROLES = {"gateway": "gateway", "validator": "validator", "scheduler": "scheduler", "worker": "worker",
              "jobs": "jobs", "rollout": "control", "autoscaler": "control"}

# JetStream names (bus/streams.py, the one place that spells them).
USAGE_STREAM = streams.USAGE_STREAM  # completion records (as.int.done.>), pull consumer of the gateway
USAGE_BUCKET = streams.USAGE_BUCKET
QUOTA_BUCKET = streams.QUOTA_BUCKET
IDEM_BUCKET = streams.IDEM_BUCKET
JOBS_STREAM = streams.JOBS_STREAM  # job submissions (as.jobs.submit.<tenant>), pull consumer of the jobs actor
JOBS_BUCKET = streams.JOBS_BUCKET
RESPONSES_BUCKET = streams.RESPONSES_BUCKET  # stored responses of the Responses API (gateway only)
JOBS_OBJECTS = streams.JOBS_OBJECTS
JOBS_SUBMIT = subjects.jobs_submit_all()

_PLACEHOLDER = "zzplaceholder"


def any_of(subject_fn: Callable[..., str]) -> str:
    """The wildcard over every subject ``subject_fn`` builds: each argument becomes one ``*`` token
    (``any_of(subjects.credits)`` == ``"as.int.credits.*.*.*"``)."""
    n = len(inspect.signature(subject_fn).parameters)
    args = [f"{_PLACEHOLDER}{i}" for i in range(n)]
    tokens = subject_fn(*args).split(".")
    return ".".join("*" if t in args else t for t in tokens)


def _below(prefix_fn: Callable[..., str]) -> str:
    """``any_of(prefix_fn) + ".>"``: everything under a wildcard prefix (``_INBOX.*.>`` for tenant inboxes)."""
    return any_of(prefix_fn) + ".>"


def inbox(role: str) -> str:
    """``_INBOX_<role>.>``: the subscribe permission of a role's own inbox."""
    return subjects.role_inbox_prefix(role) + ".>"


def _jetstream(stream_subjects: tuple[str, ...] = (), buckets: tuple[str, ...] = (), objects: tuple[str, ...] = (),
               acks: tuple[str, ...] = (), streams_used: tuple[str, ...] = ()) -> list[str]:
    """Publish permissions of a JetStream client: the JetStream API of exactly the streams it uses
    (``streams_used``, the streams behind ``buckets`` ``KV_<b>`` and ``objects`` ``OBJ_<b>``, and those of
    ``acks``: bus.subjects.js_stream_api), flow-control replies, the KV buckets' (``$KV.<b>.>``) and object
    stores' (``$O.<b>.>``) subjects, acks of the named consumers' streams, and the stream subjects in
    ``stream_subjects`` (published to with an ack). With an object store also ``STREAM.NAMES`` (nats-py
    looks the store's stream up by subject when it reads an object)."""
    used = [*streams_used, *acks, *(streams.kv_stream(b) for b in buckets), *(streams.object_stream(o) for o in objects)]
    api = [p for st in dict.fromkeys(used) for p in subjects.js_stream_api(st)]
    return (api + ([subjects.js_stream_names()] if objects else []) + [subjects.js_flow_control_all()]
            + [subjects.js_acks(s) for s in acks] + [subjects.kv_subjects(b) for b in buckets]
            + [subjects.object_subjects(o) for o in objects] + list(stream_subjects))


def platform_streams() -> tuple[str, ...]:
    """Every stream of bus/streams.py with a fixed name: AS_DONE, AS_JOBS and the streams behind the
    KV buckets and the object store (what a scheduler, allowed any stream for its per-version journals
    ``SCHED_<name>_<version>``, is denied)."""
    kv = (USAGE_BUCKET, QUOTA_BUCKET, IDEM_BUCKET, JOBS_BUCKET, RESPONSES_BUCKET)
    return (USAGE_STREAM, JOBS_STREAM, *map(streams.kv_stream, kv), streams.object_stream(JOBS_OBJECTS))


def load_of(kind: str) -> str:
    """``as.int.load.<kind>.*``: the load reports of one actor kind (``subjects.load_subject``)."""
    return any_of(functools.partial(subjects.load_subject, kind))


def _spec() -> dict[str, dict[str, Any]]:
    """``{role: {"publish": [...], "subscribe": [...], "responses": bool}}`` (before the inbox is added)."""
    gw_replies = any_of(subjects.gateway_reply)  # _INBOX.*.gw.*.*: chunks for gateway / jobs frontends
    cancel = any_of(subjects.cancel)
    done = any_of(subjects.done)
    return {
        "gateway": {
            "publish": [subjects.VALIDATE, cancel, any_of(subjects.gateway_cancel),
                        _below(subjects.tenant_inbox_prefix), load_of("gateway")]
            + _jetstream(stream_subjects=(JOBS_SUBMIT,), buckets=(USAGE_BUCKET, QUOTA_BUCKET, IDEM_BUCKET, JOBS_BUCKET,
                                                                  RESPONSES_BUCKET),
                         objects=(JOBS_OBJECTS,), acks=(USAGE_STREAM,), streams_used=(JOBS_STREAM,)),
            "subscribe": [subjects.API_CHAT, subjects.API_COMPLETIONS, subjects.API_CANCEL, subjects.API_RESPONSES,
                          *subjects.API_RESPONSES_OPS, *subjects.API_FILES_OPS, *subjects.API_BATCHES_OPS,
                          gw_replies, subjects.frames_all(), done, any_of(subjects.stats),
                          any_of(subjects.gateway_cancel),  # cancel look-ups between gateways
                          subjects.load_of_kind("scheduler")],  # queues and tenant shares (operator dashboard)
            "responses": True,  # reply-subject probes from workers, NATS API request acks
        },
        "validator": {
            "publish": [any_of(subjects.sched_submit), cancel, gw_replies, load_of("validator")],
            "subscribe": [subjects.VALIDATE, cancel],
            "responses": True,  # acks of as.int.validate requests
        },
        "scheduler": {
            "publish": [any_of(subjects.work), gw_replies, done, any_of(subjects.sched_leader), load_of("scheduler"),
                        any_of(subjects.host_load)]
            + _jetstream(stream_subjects=(any_of(subjects.sched_journal),), streams_used=(subjects.ANY_STREAM,)),
            # a stream-name prefix (SCHED_) cannot be a NATS wildcard: any stream, but not the platform's others
            "publish_deny": [p for st in platform_streams() for p in subjects.js_stream_api(st)],
            "subscribe": [any_of(subjects.sched_submit), any_of(subjects.sched_migrate), any_of(subjects.credits),
                          any_of(subjects.sched_events),
                          done, cancel],
            "responses": True,  # acks of submits
        },
        "worker": {
            "publish": [gw_replies, subjects.frames_all(), any_of(subjects.sched_events), done,
                        any_of(subjects.credits),
                        any_of(subjects.stats), any_of(subjects.sched_migrate)],  # + hand-overs (resume)
            "subscribe": [any_of(subjects.work), cancel, any_of(subjects.host_load)],  # + load asks (hosts)
            "responses": True,  # dispatch acks
        },
        "jobs": {
            "publish": [subjects.VALIDATE, cancel]
            + _jetstream(buckets=(JOBS_BUCKET, QUOTA_BUCKET), objects=(JOBS_OBJECTS,), acks=(JOBS_STREAM,)),  # quota: budgets
            "subscribe": [gw_replies, subjects.frames_all()],
            "responses": True,  # reply-subject probes from workers
        },
        "control": {
            "publish": [any_of(subjects.host_load)],  # the autoscaler's lends (--lend: lend_carry.py)
            "subscribe": [done, subjects.LOAD_ALL, any_of(subjects.credits)],
            "responses": False,
        },
    }


def role_permissions(role: str) -> dict[str, Any]:
    """nats-server ``permissions`` block of ``role`` (one of :data:`ROLES`; ValueError otherwise):
    publish/subscribe allow lists (own inbox included), ``allow_responses`` where the role answers
    requests. A role that publishes nothing gets ``publish: {deny: [">"]}`` (an empty allow list would
    allow everything)."""
    spec = _spec().get(role)
    if spec is None:
        raise ValueError(f"unknown NATS role {role!r} (one of {', '.join(ROLES)})")
    perms: dict[str, Any] = {
        "publish": ({"allow": list(spec["publish"])} if spec["publish"] else {"deny": [subjects.EVERYTHING]}),
        "subscribe": {"allow": [*spec["subscribe"], inbox(role)]},
    }
    if spec.get("publish_deny"):
        perms["publish"]["deny"] = list(spec["publish_deny"])
    if spec["responses"]:
        perms["allow_responses"] = True
    return perms


def role_users(passwords: Mapping[str, str]) -> list[dict[str, Any]]:
    """nats-server user entries (``user``, ``password``, ``permissions``) of every role in
    ``passwords`` (``{role: password}``), in :data:`ROLES` order."""
    return [{"user": subjects.role_user(r), "password": passwords[r], "permissions": role_permissions(r)}
            for r in ROLES if r in passwords]


def role_of_kind(kind: str) -> str:
    """NATS role of a supervisor actor kind (``rollout`` -> ``control``); ValueError if unknown."""
    try:
        return KIND_ROLES[kind]
    except KeyError:
        raise ValueError(f"no NATS role for actor kind {kind!r}") from None


def role_passwords(state_dir: str | Path) -> dict[str, str]:
    """``{role: password}`` of every role, created (random, mode 0600) in
    ``<state-dir>/nats-role-passwords.json`` on first use; a role missing from the file is added."""
    path = Path(state_dir) / ROLE_PASSWORDS_FILE
    current: dict[str, str] = {}
    if path.exists():
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            current = {k: v for k, v in data.items() if isinstance(v, str) and v}
    if all(r in current for r in ROLES):
        return current
    for r in ROLES:
        current.setdefault(r, secrets.token_urlsafe(24))
    write_private(path, json.dumps(current, indent=1) + "\n")
    return current


def write_private(path: str | Path, text: str) -> None:
    """Atomically write ``text`` to ``path`` with mode 0600 (secrets: passwords, server config)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
