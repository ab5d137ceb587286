"""Every NATS subject of docs/architecture.md, built by pure functions in one module.

Names are fixed by docs/architecture.md ("Names, subjects and keys"); extend, never rename. Tokens that
come from user input (model name, version, tenant, worker and request ids) are checked so that a dot,
a space or a wildcard can never split or widen a subject.
"""

from __future__ import annotations

import re

API_CHAT = "as.api.v1.chat"  # public NATS API: chat completions (request-reply, streaming to inbox)
API_COMPLETIONS = "as.api.v1.completions"  # public NATS API: completions
API_CANCEL = "as.api.v1.cancel"  # public NATS API: cancel by request id
API_RESPONSES = "as.api.v1.responses"  # public NATS API: OpenAI Responses create (docs/responses.md)
API_RESPONSES_GET = API_RESPONSES + ".get"  # public NATS API: retrieve a stored response {"response_id"}
API_RESPONSES_INPUT_ITEMS = API_RESPONSES + ".input_items"  # public NATS API: a response's input items page
API_RESPONSES_DELETE = API_RESPONSES + ".delete"  # public NATS API: delete a stored response
API_RESPONSES_CANCEL = API_RESPONSES + ".cancel"  # public NATS API: cancel a background response
# the stored-response operations of the NATS API: {subject: operation name of gateway.responses_api}
API_RESPONSES_OPS = {API_RESPONSES_GET: "get", API_RESPONSES_INPUT_ITEMS: "input_items",
                     API_RESPONSES_DELETE: "delete", API_RESPONSES_CANCEL: "cancel"}
API_FILES = "as.api.v1.files"  # public NATS API: OpenAI Files, one subject per operation (docs/batch.md)
# {subject: operation name of gateway.files_api.FilesApi.operate}
API_FILES_OPS = {f"{API_FILES}.{op}": op for op in ("create", "list", "retrieve", "content", "delete")}
API_BATCHES = "as.api.v1.batches"  # public NATS API: OpenAI Batch, one subject per operation (docs/batch.md)
# {subject: operation name of gateway.batches_api.BatchesApi.operate}
API_BATCHES_OPS = {f"{API_BATCHES}.{op}": op for op in ("create", "list", "retrieve", "cancel")}
VALIDATE = "as.int.validate"  # validator queue group
VALIDATORS_QUEUE = "validators"  # queue group name of the validators
GATEWAYS_QUEUE = "gateways"  # queue group name of the NATS API front
SCHEDULERS_QUEUE = "schedulers"  # queue group of scheduler replicas (only the active one subscribes)

INBOX = "_INBOX"  # default inbox prefix of a NATS connection (no tenant, no role)
EVERYTHING = ">"  # the full wildcard: every subject (operator user, deny-all lists)

_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


def _token(value: str, what: str) -> str:
    """Return ``value`` if it is one safe subject token (no dot, space or wildcard); else ValueError."""
    if not isinstance(value, str) or not _SAFE.match(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token ([A-Za-z0-9_-]+)")
    return value


def tenant_inbox_prefix(tenant: str) -> str:
    """``_INBOX.<tenant>``: the inbox prefix of one tenant's NATS connections."""
    return f"{INBOX}.{_token(tenant, 'tenant')}"


def sched_submit(name: str, version: str) -> str:
    """``as.int.sched.<name>.<version>.submit``: the active scheduler of one model version."""
    return f"as.int.sched.{_token(name, 'model')}.{_token(version, 'version')}.submit"


def sched_migrate(name: str, version: str) -> str:
    """``as.int.sched.<name>.<version>.migrate``: a worker hands a running sequence (GenerateRequest with
    ``resume`` set) to the active scheduler of its version, request-reply (actors/worker/migration.py).

    Extension of docs/architecture.md's scheduler subjects, kept apart from ``submit`` so that a worker
    can never submit new requests (its NATS role may publish here, not there)."""
    return f"as.int.sched.{_token(name, 'model')}.{_token(version, 'version')}.migrate"


def work(worker_id: str) -> str:
    """``as.int.work.<worker_id>``: dispatch to one worker."""
    return f"as.int.work.{_token(worker_id, 'worker id')}"


def host_load(host_id: str) -> str:
    """``as.int.host.<host_id>.load``: a scheduler asks a multi-version worker host to make its version
    resident (request-reply, HostLoad / HostLoadAck; actors/worker/host.py). Extension of the original map
    (issue [11])."""
    return f"as.int.host.{_token(host_id, 'host id')}.load"


def cancel(request_id: str) -> str:
    """``as.int.cancel.<request_id>``: cancel, heard by whoever holds the request."""
    return f"as.int.cancel.{_token(request_id, 'request id')}"


def cancel_all() -> str:
    """Wildcard over every internal cancel subject."""
    return "as.int.cancel.*"


def gateway_cancel(request_id: str) -> str:
    """``as.int.gwcancel.<request_id>``: a gateway that received a public NATS cancel asks every gateway
    (request-reply, no queue group) which one holds the request; only the holder answers."""
    return f"as.int.gwcancel.{_token(request_id, 'request id')}"


def gateway_cancel_all() -> str:
    """Wildcard over every gateway cancel look-up (each gateway subscribes, no queue group)."""
    return "as.int.gwcancel.*"


def credits(name: str, version: str, worker_id: str) -> str:
    """``as.int.credits.<name>.<version>.<worker_id>``: worker heartbeat with free KV blocks / slots."""
    return f"as.int.credits.{_token(name, 'model')}.{_token(version, 'version')}.{_token(worker_id, 'worker id')}"


def credits_of_version(name: str, version: str) -> str:
    """Wildcard over the credit heartbeats of every worker of one model version."""
    return f"as.int.credits.{_token(name, 'model')}.{_token(version, 'version')}.*"


def credits_all() -> str:
    """Wildcard over the credit heartbeats of every worker of every version (the autoscaler listens)."""
    return "as.int.credits.*.*.*"


def stats(worker_id: str) -> str:
    """``as.int.stats.<worker_id>``: worker statistics (steps, batch sizes, KV use)."""
    return f"as.int.stats.{_token(worker_id, 'worker id')}"


def stats_all() -> str:
    """Wildcard over all worker statistics."""
    return "as.int.stats.*"


def done(name: str, version: str) -> str:
    """``as.int.done.<name>.<version>``: one completion record per finished request."""
    return f"as.int.done.{_token(name, 'model')}.{_token(version, 'version')}"


def done_of_model(name: str) -> str:
    """``as.int.done.<name>.*``: the completion records of every version of one model."""
    return f"as.int.done.{_token(name, 'model')}.*"


def done_all() -> str:
    """Wildcard over completion records of every model version."""
    return "as.int.done.*.*"


def done_tree() -> str:
    """``as.int.done.>``: every completion record (the subjects of the usage stream ``AS_DONE``)."""
    return "as.int.done.>"


LOAD_ALL = "as.int.load.>"  # every actor's load report (the autoscaler subscribes)


def load_subject(kind: str, actor_id: str) -> str:
    """``as.int.load.<kind>.<actor_id>``: the ~1 Hz load report (``bus.messages.ActorLoad``) of one actor
    (validator, gateway, scheduler) to the autoscaler (docs/architecture.md)."""
    return f"as.int.load.{_token(kind, 'actor kind')}.{_token(actor_id, 'actor id')}"


def load_of_kind(kind: str) -> str:
    """``as.int.load.<kind>.*``: the load reports of every actor of one kind (the gateway's operator dashboard
    hears the schedulers': queues and tenant shares, gateway/dashboard_feed.py)."""
    return f"as.int.load.{_token(kind, 'actor kind')}.*"


def jobs_submit(tenant: str) -> str:
    """``as.jobs.submit.<tenant>``: one accepted job (extension of docs/architecture.md's subjects for the
    jobs stream ``AS_JOBS``; docs/architecture.md)."""
    return f"as.jobs.submit.{_token(tenant, 'tenant')}"


def jobs_submit_all() -> str:
    """Wildcard over the job submissions of every tenant (the subjects of ``AS_JOBS``)."""
    return "as.jobs.submit.*"


def sched_events(name: str, version: str) -> str:
    """``as.int.sched.<name>.<version>.events``: worker -> scheduler request events (first token).

    Extension of docs/architecture.md's scheduler subjects: the scheduler needs to know which in-flight
    requests already streamed a token, to decide between re-dispatch and a retryable error when a
    worker's lease disappears.
    """
    return f"as.int.sched.{_token(name, 'model')}.{_token(version, 'version')}.events"


def gateway_reply(tenant: str, gateway_id: str, request_id: str) -> str:
    """``_INBOX.<tenant>.gw.<gateway_id>.<request_id>``: where chunks of one gateway request go.

    Lives under the tenant's inbox prefix (docs/architecture.md ``_INBOX.<tenant>.>``)."""
    return f"{tenant_inbox_prefix(tenant)}.gw.{_token(gateway_id, 'gateway id')}.{_token(request_id, 'request id')}"


def gateway_replies(gateway_id: str) -> str:
    """Wildcard over every reply subject of one gateway (all tenants)."""
    return f"{INBOX}.*.gw.{_token(gateway_id, 'gateway id')}.*"


def frames(receiver_id: str) -> str:
    """``as.int.frames.<receiver_id>``: step frames for one receiver (a gateway, or the jobs actor's frontend):
    one message per worker step holding every chunk of that receiver's requests in the step (bus.messages.
    StepFrame, docs/decisions/0052-step-frames.md). Outside every tenant's ``_INBOX.<tenant>.>``: a frame mixes
    tenants, so only internal roles may read it."""
    return f"as.int.frames.{_token(receiver_id, 'receiver id')}"


def frames_all() -> str:
    """``as.int.frames.*``: every receiver's step frames (the permission pattern of the roles)."""
    return "as.int.frames.*"


def sched_journal(name: str, version: str) -> str:
    """``as.int.sched.<name>.<version>.journal``: JetStream subject of the scheduler's durable queue journal."""
    return f"as.int.sched.{_token(name, 'model')}.{_token(version, 'version')}.journal"


def sched_leader(name: str, version: str) -> str:
    """``as.int.sched.<name>.<version>.leader``: announced by a scheduler replica when it becomes active."""
    return f"as.int.sched.{_token(name, 'model')}.{_token(version, 'version')}.leader"


# -- internal NATS roles (issue #8 item 8) ------------------------------------------------------------
# Every internal actor connects as the NATS user of its role (control/ops/nats_roles.py builds their
# permissions). A role's connection uses its own inbox prefix, outside every tenant's ``_INBOX.<tenant>``,
# so a role's subscribe permission on its inbox reads no tenant's (nor another role's) replies.

ROLE_USER_PREFIX = "actorserve-"  # NATS user name of a role: "actorserve-<role>" (never a 12-hex key id)


def role_user(role: str) -> str:
    """``actorserve-<role>``: the NATS user name of an internal role (gateway, worker, ...)."""
    return ROLE_USER_PREFIX + _token(role, "role")


def role_of_user(user: str | None) -> str | None:
    """The role named by NATS user ``user`` (``actorserve-worker`` -> ``worker``), else None."""
    if not user or not user.startswith(ROLE_USER_PREFIX):
        return None
    role = user[len(ROLE_USER_PREFIX):]
    return role if _SAFE.match(role) else None


def role_inbox_prefix(role: str) -> str:
    """``_INBOX_<role>``: the inbox prefix of a role's connections (replies to its requests, JetStream
    API replies and consumer deliveries); its subscribe permission is ``_INBOX_<role>.>``."""
    return f"{INBOX}_{_token(role, 'role')}"


# -- JetStream API subjects (permissions of JetStream clients; control/ops/nats_roles.py) -------------

def js_api_all() -> str:
    """``$JS.API.>``: every JetStream API request (stream / consumer / KV / object-store management)."""
    return "$JS.API.>"


JS_API = "$JS.API"  # prefix of every JetStream API request subject
ANY_STREAM = "*"  # the stream token of js_stream_api() for "every stream" (scheduler journals: SCHED_<m>_<v>)


def js_stream_api(stream: str) -> list[str]:
    """The JetStream API subjects a client of one stream (a KV bucket's ``KV_<b>``, an object store's
    ``OBJ_<b>``) sends, as nats-py 2.x builds them (nats/js/manager.py, client.py, kv.py, object_store.py):
    stream info / create / update / purge, message get / delete (``STREAM.MSG.*``: KV get, journal), direct
    get (KV get on servers with direct access), and consumers: create (named, durable, ephemeral,
    with a filter subject), info, delete, fetch (``CONSUMER.MSG.NEXT``: pull consumers). ``stream``: a
    stream name, or :data:`ANY_STREAM`; ValueError otherwise."""
    s = stream if stream == ANY_STREAM else _token(stream, "stream")
    return [f"{JS_API}.STREAM.{op}.{s}" for op in ("INFO", "CREATE", "UPDATE", "PURGE", "MSG.GET", "MSG.DELETE")] + [
        f"{JS_API}.DIRECT.GET.{s}", f"{JS_API}.DIRECT.GET.{s}.>",
        f"{JS_API}.CONSUMER.CREATE.{s}", f"{JS_API}.CONSUMER.CREATE.{s}.>",
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{s}.>", f"{JS_API}.CONSUMER.INFO.{s}.>",
        f"{JS_API}.CONSUMER.DELETE.{s}.>", f"{JS_API}.CONSUMER.MSG.NEXT.{s}.>"]


def js_stream_names() -> str:
    """``$JS.API.STREAM.NAMES``: stream names by subject (nats-py looks up an object store's stream so
    when it reads an object)."""
    return f"{JS_API}.STREAM.NAMES"


def js_flow_control_all() -> str:
    """``$JS.FC.>``: flow-control replies of push consumers (KV watchers)."""
    return "$JS.FC.>"


def js_acks(stream: str) -> str:
    """``$JS.ACK.<stream>.>``: acknowledgements of messages of one stream's consumers."""
    return f"$JS.ACK.{_token(stream, 'stream')}.>"


def kv_subjects(bucket: str) -> str:
    """``$KV.<bucket>.>``: every key of one JetStream KV bucket."""
    return f"$KV.{_token(bucket, 'bucket')}.>"


def kv_key_subjects(bucket: str, pattern: str) -> str:
    """``$KV.<bucket>.<pattern>``: the subjects of the keys of one KV bucket matching ``pattern``
    (``*`` / ``>`` wildcards; JetStream KV stores key K of bucket B on subject ``$KV.B.K``, ADR-8)."""
    return f"$KV.{_token(bucket, 'bucket')}.{pattern}"


def object_subjects(bucket: str) -> str:
    """``$O.<bucket>.>``: the chunks and metadata of one JetStream object store."""
    return f"$O.{_token(bucket, 'bucket')}.>"
