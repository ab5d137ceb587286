"""What ``actorserve up`` runs: :class:`StackConfig`, the validated configuration of one supervised stack
(control/ops/supervisor.py). Built by the CLI's ``up`` verb (control/ops/up.py), tests and benches."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from control.ops.deploy import DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION


def usable_cores() -> int:
    """CPUs this process may run on (its affinity where the OS tells it, else the CPU count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class StackConfig:
    """The stack one supervisor runs. ValueError on bad values; normalised in ``__post_init__``
    (``state_dir`` absolute, ``cores`` and ``max_workers`` resolved, ``python`` set, the autoscaler off
    with ``multi_model`` unless ``lend``).

    ``state_dir`` (created if missing); ``host``/``port`` of the first gateway (gateway *n* listens on
    ``port + n``; ``port=0`` picks free ports); ``gateways``; ``workers`` (per model version, unless its
    manifest's extra key ``workers`` says otherwise); ``model_file`` (a GGUF file or a Hugging Face
    directory; default: the shipped SmolLM2), ``model_name``, ``model_version``, ``context_length``
    (override) of the version registered at start; ``log_level`` (passed to every actor); ``actor_args`` (extra argv per kind, e.g.
    ``{"worker": ["--kv-cache-bytes", "8000000"]}``); ``env`` (extra environment of the actors);
    ``echo_worker_log`` (copy worker-0's log to ``echo_stream`` while waiting for readiness: its loading
    progress bar); ``supervise`` (restart actors, etcd and nats-server that die after readiness, at most
    ``max_restarts`` per ``restart_window_s`` seconds each); ``stop_timeout_s`` (one deadline for a stop,
    s, then SIGKILL); ``python`` (the actors' interpreter; default this one); ``watch_registry`` (start and
    drain model versions as the registry changes, polled every ``registry_poll_s`` s, and carry out the
    desired replica counts); ``tls`` (certificates in ``<state-dir>/tls/``, TLS everywhere);
    ``autoscaler`` (also run the autoscaler actor, floors = today's counts, ceilings = ``cores``);
    ``pool`` (the pool workers are started for); ``cores`` (default: the CPUs this process may use);
    ``max_workers`` (no scale-up beyond that many workers in all; default ``max(workers, cores)``);
    ``multi_model`` (workers are multi-version hosts, actors/worker/host.py; no autoscaler then, unless
    ``lend``: the autoscaler then runs on the hosts -- versions to zero when idle, sleeping and waking them
    itself, lending a sleeping version's host to a version short of replicas; hosts are not started or
    stopped by counts: actors/autoscaler/lend_carry.py).
    """

    state_dir: str | os.PathLike[str] = ".actorserve"
    host: str = "127.0.0.1"
    port: int = 8000
    gateways: int = 1
    workers: int = 1
    model_file: str | os.PathLike[str] | None = None
    model_name: str = DEFAULT_MODEL_NAME
    model_version: str = DEFAULT_MODEL_VERSION
    context_length: int | None = None
    log_level: str | None = None
    actor_args: Mapping[str, Sequence[str]] | None = field(default_factory=dict)
    env: Mapping[str, str] | None = field(default_factory=dict)
    echo_worker_log: bool = False
    echo_stream: TextIO | None = None
    supervise: bool = True
    max_restarts: int = 5
    restart_window_s: float = 60.0
    stop_timeout_s: float = 15.0  # > a worker's default --drain-timeout (10 s) plus its close
    python: str | None = None
    watch_registry: bool = True
    registry_poll_s: float = 0.5
    tls: bool = False
    autoscaler: bool = False
    pool: str = "local"
    cores: int | None = None
    max_workers: int | None = None
    multi_model: bool = False
    lend: bool = False  # with multi_model: the autoscaler lends hosts across versions (docs/autoscaling.md)
    # > 0: a worker scaled down sleeps instead of exiting while its pool's count was this high within the last
    # sleep_horizon_s seconds, and a sleeper idle that long exits (actors/worker/sleep.py; 0: scale-down exits)
    sleep_horizon_s: float = 0.0

    def __post_init__(self) -> None:
        from control.state.names import validate_name

        if self.gateways < 1:
            raise ValueError("gateways must be >= 1")
        if self.workers < 0:
            raise ValueError("workers must be >= 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        validate_name("model name", self.model_name)
        validate_name("model version", self.model_version)
        validate_name("pool name", self.pool)
        cores = int(self.cores) if self.cores is not None else usable_cores()
        if cores < 1 or (self.max_workers is not None and self.max_workers < 0):
            raise ValueError("cores must be >= 1 and max_workers >= 0")
        if not 0 <= float(self.sleep_horizon_s) <= 7 * 86400:
            raise ValueError(f"sleep_horizon_s must be in 0..604800 s, not {self.sleep_horizon_s}")
        if self.lend and not self.multi_model:
            raise ValueError("lend: lending hosts across versions needs multi_model (the workers are hosts)")
        if self.max_restarts < 0 or self.restart_window_s <= 0 or self.stop_timeout_s <= 0 or self.registry_poll_s <= 0:
            raise ValueError("max_restarts must be >= 0; restart_window_s, stop_timeout_s and registry_poll_s > 0")
        fix = {"state_dir": Path(self.state_dir).expanduser().resolve(), "port": int(self.port),
               "gateways": int(self.gateways), "workers": int(self.workers), "cores": cores,
               "max_workers": int(self.max_workers) if self.max_workers is not None else max(int(self.workers), cores),
               "actor_args": {k: list(v) for k, v in (self.actor_args or {}).items()}, "env": dict(self.env or {}),
               "python": self.python or sys.executable, "max_restarts": int(self.max_restarts),
               "restart_window_s": float(self.restart_window_s), "stop_timeout_s": float(self.stop_timeout_s),
               "registry_poll_s": float(self.registry_poll_s), "watch_registry": bool(self.watch_registry),
               "tls": bool(self.tls), "multi_model": bool(self.multi_model),
               "sleep_horizon_s": float(self.sleep_horizon_s),
               "lend": bool(self.lend),
               "autoscaler": bool(self.autoscaler) and (not self.multi_model or bool(self.lend))}
        for k, v in fix.items():
            object.__setattr__(self, k, v)

    @property
    def model_ref(self) -> str:
        """``name@version`` of the model version registered at start."""
        return f"{self.model_name}@{self.model_version}"

    @property
    def logs_dir(self) -> Path:
        """``<state-dir>/logs``."""
        return Path(self.state_dir) / "logs"
