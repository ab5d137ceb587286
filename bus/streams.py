"""Every JetStream stream, consumer, KV bucket and object store of the platform: names and configs.

The sibling of ``bus/subjects.py`` for durable state: no other module spells one of these names
(tests/unit/test_boundaries.py). Pure module: plain frozen dataclasses, validated at construction;
``bus/jetstream.py`` turns them into nats-py configs, ``bus/kv.py``'s memory twin reads them too.

==================  =====================================  ===============================================
name                what                                   who
==================  =====================================  ===============================================
``AS_DONE``         stream of ``as.int.done.>`` (7 days)   usage meter (gateway), durable consumer ``meter``
``AS_JOBS``         work queue of ``as.jobs.submit.*``     jobs API publishes, jobs actors pull (``jobs``)
``SCHED_<m>_<v>``   one scheduler's queue journal          the active scheduler of model version m@v
``as_quota``        KV: rpm/tpm windows, day, slots        quota store (gateway)
``as_idem``         KV: idempotency records (TTL 24 h)     idempotency store (gateway)
``as_usage``        KV: usage per tenant and version       usage meter (gateway)
``as_jobs``         KV: job records (TTL 7 days)           jobs API, jobs actor
``as_job_data``     objects: large inputs, batch outputs   jobs API, jobs actor
``as_responses``    KV: stored responses (TTL 30 days)     Responses API (gateway)
==================  =====================================  ===============================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bus import subjects

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
MiB = 1024 * 1024
DAY_S = 24 * 3600


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} name {name!r} must match [A-Za-z0-9_-]+")


def _check_limit(value: float | None, what: str) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{what} must be > 0 or None (unlimited), got {value!r}")


@dataclass(frozen=True)
class BucketConfig:
    """A JetStream KV bucket. ``history``: revisions kept per key (1..64); ``ttl_s``: seconds a value
    lives after its last write (None: forever); ``max_bytes``: size cap (None: unlimited); ``file``:
    file storage (else memory). ValueError names the bad field."""

    name: str
    history: int = 1
    ttl_s: float | None = None
    max_bytes: int | None = None
    file: bool = True

    def __post_init__(self) -> None:
        _check_name(self.name, "bucket")
        if not isinstance(self.history, int) or not 1 <= self.history <= 64:
            raise ValueError(f"history must be an integer 1..64, got {self.history!r}")
        _check_limit(self.ttl_s, "ttl_s")
        _check_limit(self.max_bytes, "max_bytes")


@dataclass(frozen=True)
class StreamConfig:
    """A JetStream stream over ``subjects``. ``work_queue``: a message is removed once acknowledged
    (else kept by limits); ``max_age_s`` / ``max_bytes``: limits (None: none); ``duplicate_window_s``:
    how long a ``Nats-Msg-Id`` de-duplicates. ValueError names the bad field."""

    name: str
    subjects: tuple[str, ...]
    max_bytes: int | None = None
    max_age_s: float | None = None
    work_queue: bool = False
    duplicate_window_s: float = 120.0
    file: bool = True

    def __post_init__(self) -> None:
        _check_name(self.name, "stream")
        if not self.subjects or not all(isinstance(s, str) and s for s in self.subjects):
            raise ValueError(f"subjects must be a non-empty tuple of subjects, got {self.subjects!r}")
        _check_limit(self.max_bytes, "max_bytes")
        _check_limit(self.max_age_s, "max_age_s")
        _check_limit(self.duplicate_window_s, "duplicate_window_s")


@dataclass(frozen=True)
class ConsumerConfig:
    """A durable pull consumer with explicit acks. ``ack_wait_s``: redelivery after this long without
    an ack; ``max_ack_pending`` / ``max_deliver``: None = server default / unlimited."""

    durable: str
    ack_wait_s: float
    max_ack_pending: int | None = None
    max_deliver: int | None = None

    def __post_init__(self) -> None:
        _check_name(self.durable, "consumer")
        _check_limit(self.ack_wait_s, "ack_wait_s")
        _check_limit(self.max_ack_pending, "max_ack_pending")
        _check_limit(self.max_deliver, "max_deliver")


@dataclass(frozen=True)
class ObjectStoreConfig:
    """A JetStream object store (``ttl_s``, ``max_bytes``: None = unlimited)."""

    name: str
    ttl_s: float | None = None
    max_bytes: int | None = None
    file: bool = True

    def __post_init__(self) -> None:
        _check_name(self.name, "object store")
        _check_limit(self.ttl_s, "ttl_s")
        _check_limit(self.max_bytes, "max_bytes")


# -- replication -----------------------------------------------------------------------------------

#: environment variable naming how many JetStream replicas every stream, KV bucket and object store is
#: created with (1 on a single nats-server; 3 on a 3-node cluster: survives the loss of one server).
#: Read by ``bus/jetstream.py`` when it creates one; an existing one keeps its replica count.
REPLICAS_ENV = "ACTORSERVE_JS_REPLICAS"
DEFAULT_REPLICAS = 1
MAX_REPLICAS = 5  # JetStream's own limit


def check_replicas(value: object, what: str = REPLICAS_ENV) -> int:
    """``value`` (an int or a decimal string) as a replica count 1..5; ValueError naming ``what``."""
    try:
        n = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_REPLICAS:
        raise ValueError(f"{what} must be an integer 1..{MAX_REPLICAS} (JetStream replicas), got {value!r}")
    return n


# -- names -----------------------------------------------------------------------------------------

USAGE_STREAM = "AS_DONE"
JOBS_STREAM = "AS_JOBS"
USAGE_CONSUMER = "meter"
JOBS_CONSUMER = "jobs"
QUOTA_BUCKET = "as_quota"
IDEM_BUCKET = "as_idem"
USAGE_BUCKET = "as_usage"
JOBS_BUCKET = "as_jobs"
JOBS_OBJECTS = "as_job_data"
RESPONSES_BUCKET = "as_responses"
JOURNAL_PREFIX = "SCHED_"
NAMES = (USAGE_STREAM, JOBS_STREAM, QUOTA_BUCKET, IDEM_BUCKET, USAGE_BUCKET, JOBS_BUCKET, JOBS_OBJECTS,
         RESPONSES_BUCKET)


def kv_stream(bucket: str) -> str:
    """``KV_<bucket>``: the stream behind a JetStream KV bucket (NATS ADR-8)."""
    _check_name(bucket, "bucket")
    return f"KV_{bucket}"


def object_stream(bucket: str) -> str:
    """``OBJ_<bucket>``: the stream behind a JetStream object store (NATS ADR-20)."""
    _check_name(bucket, "object store")
    return f"OBJ_{bucket}"


def journal_stream(name: str, version: str) -> str:
    """``SCHED_<name>_<version>``: the stream of one model version's scheduler journal (no dots allowed)."""
    _check_name(name, "model")
    _check_name(version, "version")
    return f"{JOURNAL_PREFIX}{name}_{version}"


# -- configs ---------------------------------------------------------------------------------------

JOBS_TTL_S = 7 * DAY_S  # job records and data live a week
QUOTAS = BucketConfig(QUOTA_BUCKET, max_bytes=16 * MiB)
IDEMPOTENCY = BucketConfig(IDEM_BUCKET, ttl_s=DAY_S, max_bytes=128 * MiB)
USAGE = BucketConfig(USAGE_BUCKET, max_bytes=16 * MiB)
JOBS = BucketConfig(JOBS_BUCKET, ttl_s=JOBS_TTL_S, max_bytes=128 * MiB)
# job data and OpenAI files; the sum of every stream's max_bytes must fit the embedded nats-server's 1 GB
# max_file_store, or a stream created later is refused ("insufficient storage resources": 384 MiB here did that)
JOB_DATA = ObjectStoreConfig(JOBS_OBJECTS, ttl_s=JOBS_TTL_S, max_bytes=192 * MiB)
RESPONSES_TTL_S = 30 * DAY_S  # stored responses (POST /v1/responses, store=true) live 30 days after their last write
RESPONSES = BucketConfig(RESPONSES_BUCKET, ttl_s=RESPONSES_TTL_S, max_bytes=128 * MiB)
DONE = StreamConfig(USAGE_STREAM, (subjects.done_tree(),), max_bytes=64 * MiB, max_age_s=7 * DAY_S)
JOB_QUEUE = StreamConfig(JOBS_STREAM, (subjects.jobs_submit_all(),), max_bytes=64 * MiB, work_queue=True)
METER = ConsumerConfig(USAGE_CONSUMER, ack_wait_s=30.0, max_ack_pending=10000)
JOB_RUNNERS = ConsumerConfig(JOBS_CONSUMER, ack_wait_s=10.0)
JOURNAL_MAX_BYTES = 32 * MiB  # per model version: queued requests only, so small


def journal(name: str, version: str) -> StreamConfig:
    """The stream of one model version's scheduler journal (file, capped, a day, 2-minute de-dup)."""
    return StreamConfig(journal_stream(name, version), (subjects.sched_journal(name, version),),
                        max_bytes=JOURNAL_MAX_BYTES, max_age_s=DAY_S)
