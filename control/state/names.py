"""Names, model references and etcd key builders (pure: no I/O).

Names (model names, versions, adapters, tenant ids, worker ids, pools) match
``[a-z0-9][a-z0-9_-]*`` — no dots, since a dot splits a NATS subject token.
A model reference is ``name``, ``name@version``, or either followed by ``:adapter``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "/actorserve"

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")
MAX_NAME_LEN = 128


def validate_name(kind: str, value: object) -> str:
    """Check that ``value`` is a valid name and return it.

    ``kind`` is only used in the error message (e.g. "model name", "version", "tenant id").
    Raises ValueError if ``value`` is not a str, is empty, longer than 128 characters, or does not
    match ``[a-z0-9][a-z0-9_-]*``.
    """
    if not isinstance(value, str):
        raise ValueError(f"{kind} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{kind} must not be empty")
    if len(value) > MAX_NAME_LEN:
        raise ValueError(f"{kind} {value[:32]!r}... is longer than {MAX_NAME_LEN} characters")
    if NAME_RE.fullmatch(value) is None:
        raise ValueError(f"{kind} {value!r} is invalid: must match [a-z0-9][a-z0-9_-]*")
    return value


def is_valid_name(value: object) -> bool:
    """Return True if ``value`` is a valid name (see validate_name); never raises."""
    try:
        validate_name("name", value)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference: ``name[@version][:adapter]``.

    ``version`` None means "resolve through the routing table"; ``adapter`` None means base model.
    Fields are validated on construction (ValueError).
    """

    name: str
    version: str | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        validate_name("model name", self.name)
        if self.version is not None:
            validate_name("model version", self.version)
        if self.adapter is not None:
            validate_name("adapter name", self.adapter)

    def __str__(self) -> str:
        s = self.name
        if self.version is not None:
            s += f"@{self.version}"
        if self.adapter is not None:
            s += f":{self.adapter}"
        return s

    def with_version(self, version: str) -> "ModelRef":
        """Return a copy of this reference pinned to ``version`` (ValueError if invalid)."""
        return ModelRef(self.name, version, self.adapter)


def parse_model_ref(ref: str) -> ModelRef:
    """Parse ``name``, ``name@version``, ``name:adapter`` or ``name@version:adapter``.

    Raises ValueError naming the bad part if the reference is malformed (empty parts, extra
    ``@``/``:``, invalid characters).
    """
    if not isinstance(ref, str):
        raise ValueError(f"model reference must be a string, got {type(ref).__name__}")
    if not ref:
        raise ValueError("model reference must not be empty")
    base, sep, adapter = ref.partition(":")
    if sep and not adapter:
        raise ValueError(f"model reference {ref!r}: empty adapter after ':'")
    if ":" in adapter:
        raise ValueError(f"model reference {ref!r}: more than one ':'")
    name, at, version = base.partition("@")
    if at and not version:
        raise ValueError(f"model reference {ref!r}: empty version after '@'")
    if "@" in version:
        raise ValueError(f"model reference {ref!r}: more than one '@'")
    return ModelRef(name, version if at else None, adapter if sep else None)


# ---------------------------------------------------------------------------------------------
# etcd keys. Every builder validates its parts (ValueError) so a bad name can never produce a
# key that escapes its prefix.


def models_prefix() -> str:
    """Prefix of every model key: ``/actorserve/models/``."""
    return f"{ROOT}/models/"


def model_prefix(name: str) -> str:
    """Prefix of every key of one model: ``/actorserve/models/{name}/``."""
    return f"{models_prefix()}{validate_name('model name', name)}/"


def model_versions_prefix(name: str) -> str:
    """Prefix of a model's version manifests: ``/actorserve/models/{name}/versions/``."""
    return f"{model_prefix(name)}versions/"


def model_version_key(name: str, version: str) -> str:
    """Key of one version manifest: ``/actorserve/models/{name}/versions/{version}``."""
    return f"{model_versions_prefix(name)}{validate_name('model version', version)}"


def adapters_prefix(name: str) -> str:
    """Prefix of a model's LoRA adapter records: ``/actorserve/models/{name}/adapters/``."""
    return f"{model_prefix(name)}adapters/"


def adapter_key(name: str, adapter: str) -> str:
    """Key of one adapter record: ``/actorserve/models/{name}/adapters/{adapter}`` (control/state/adapters.py)."""
    return f"{adapters_prefix(name)}{validate_name('adapter name', adapter)}"


def routing_key(name: str) -> str:
    """Key of a model's routing table: ``/actorserve/models/{name}/routing``."""
    return f"{model_prefix(name)}routing"


def tenants_prefix() -> str:
    """Prefix of every tenant key: ``/actorserve/tenants/``."""
    return f"{ROOT}/tenants/"


def tenant_key(tenant_id: str) -> str:
    """Key of one tenant record: ``/actorserve/tenants/{id}``."""
    return f"{tenants_prefix()}{validate_name('tenant id', tenant_id)}"


def all_workers_prefix() -> str:
    """Prefix of every worker lease key: ``/actorserve/workers/``."""
    return f"{ROOT}/workers/"


def workers_prefix(name: str, version: str) -> str:
    """Prefix of the workers of one model version: ``/actorserve/workers/{name}/{version}/``."""
    return (
        f"{all_workers_prefix()}{validate_name('model name', name)}/"
        f"{validate_name('model version', version)}/"
    )


def worker_key(name: str, version: str, worker_id: str) -> str:
    """Leased key of one worker: ``/actorserve/workers/{name}/{version}/{worker_id}``."""
    return f"{workers_prefix(name, version)}{validate_name('worker id', worker_id)}"


def hosts_prefix() -> str:
    """Prefix of every model-host record: ``/actorserve/hosts/`` (extension of the original map, issue [11])."""
    return f"{ROOT}/hosts/"


def host_key(host_id: str) -> str:
    """Leased record of one multi-version worker host: ``/actorserve/hosts/{host_id}`` (value: budget, free
    and resident bytes per version, evictions; actors/worker/host.py). Schedulers read it to pick the host
    with the most free memory for a version resident nowhere."""
    return f"{hosts_prefix()}{validate_name('host id', host_id)}"


def schedulers_prefix() -> str:
    """Prefix of every scheduler election key: ``/actorserve/schedulers/``."""
    return f"{ROOT}/schedulers/"


def scheduler_key(name: str, version: str) -> str:
    """Leased election key of a version's scheduler: ``/actorserve/schedulers/{name}/{version}``."""
    return (
        f"{schedulers_prefix()}{validate_name('model name', name)}/"
        f"{validate_name('model version', version)}"
    )


def controllers_prefix() -> str:
    """Prefix of the control-plane controllers' election keys: ``/actorserve/controllers/``."""
    return f"{ROOT}/controllers/"


def controller_key(kind: str) -> str:
    """Leased election key of one controller kind, e.g. ``/actorserve/controllers/rollout``."""
    return f"{controllers_prefix()}{validate_name('controller kind', kind)}"


def pools_prefix() -> str:
    """Prefix of every pool record: ``/actorserve/pools/``."""
    return f"{ROOT}/pools/"


def pool_key(pool: str) -> str:
    """Key of one accelerator pool record: ``/actorserve/pools/{pool}``."""
    return f"{pools_prefix()}{validate_name('pool name', pool)}"


def profiles_prefix() -> str:
    """Prefix of every measured throughput curve: ``/actorserve/profiles/``."""
    return f"{ROOT}/profiles/"


def profile_key(name: str, version: str, pool: str) -> str:
    """Key of one version's measured curve on one pool: ``/actorserve/profiles/{name}/{version}/{pool}``
    (tok/s against batch, TTFT against prompt length, ITL against batch; written by ``actorserve profile``)."""
    return (f"{profiles_prefix()}{validate_name('model name', name)}/"
            f"{validate_name('model version', version)}/{validate_name('pool name', pool)}")


def desired_prefix() -> str:
    """Prefix of the autoscaler's output: ``/actorserve/desired/``."""
    return f"{ROOT}/desired/"


def desired_key(kind: str, *parts: str) -> str:
    """Key of one desired replica count: ``/actorserve/desired/{kind}`` for a CPU-tier kind (``validator``,
    ``gateway``), ``/actorserve/desired/worker/{name}/{version}/{pool}`` for an accelerator pool of a version.
    Every part must be a valid name (ValueError otherwise)."""
    tail = "".join(f"/{validate_name('desired key part', p)}" for p in parts)
    return f"{desired_prefix()}{validate_name('actor kind', kind)}{tail}"


def autoscaler_prefix() -> str:
    """Prefix of the autoscaler's own records (its decision history): ``/actorserve/autoscaler/``."""
    return f"{ROOT}/autoscaler/"


def autoscaler_decisions_key() -> str:
    """Key of the bounded history of scaling decisions: ``/actorserve/autoscaler/decisions``."""
    return f"{autoscaler_prefix()}decisions"


def notices_prefix() -> str:
    """Prefix of the spot preemption notices: ``/actorserve/notices/preemption/``."""
    return f"{ROOT}/notices/preemption/"


def preemption_notice_key(worker_id: str) -> str:
    """Key of one worker's preemption notice: ``/actorserve/notices/preemption/{worker_id}`` (value
    ``{"deadline": epoch s, "reason": str}``): the worker stops taking work and migrates its sequences."""
    return f"{notices_prefix()}{validate_name('worker id', worker_id)}"


def sleep_prefix() -> str:
    """Prefix of the sleep / wake commands of workers: ``/actorserve/sleep/``."""
    return f"{ROOT}/sleep/"


def sleep_key(worker_id: str) -> str:
    """Key of one worker's sleep command: ``/actorserve/sleep/{worker_id}`` (value ``{"want": "sleep" | "wake",
    "by": str, "ts": epoch s}``; actors/worker/sleep.py): written by the supervisor and by schedulers, watched
    by the worker."""
    return f"{sleep_prefix()}{validate_name('worker id', worker_id)}"


def all_metrics_prefix() -> str:
    """Prefix of every actor's metrics endpoint key: ``/actorserve/metrics/``."""
    return f"{ROOT}/metrics/"


def metrics_key(kind: str, actor_id: str) -> str:
    """Leased key of one actor's ``/metrics`` endpoint: ``/actorserve/metrics/{kind}/{id}``
    (value ``{"url", "kind", "id", "pid"}``)."""
    return f"{all_metrics_prefix()}{validate_name('actor kind', kind)}/{validate_name('actor id', actor_id)}"


def split_key(key: str, prefix: str) -> list[str]:
    """Return the ``/``-separated parts of ``key`` after ``prefix``.

    Raises ValueError if ``key`` does not start with ``prefix``.
    """
    if not key.startswith(prefix):
        raise ValueError(f"key {key!r} is not under {prefix!r}")
    rest = key[len(prefix):]
    return [p for p in rest.split("/") if p] if rest else []
