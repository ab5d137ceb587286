"""``actorserve up``: the embedded stack and one OS process per actor, supervised.

:class:`Supervisor` does the work; the CLI's ``up`` verb (control/ops/up.py ``main_up``) wraps it with
signal handling and terminal output; control/ops/deploy.py has the model registration it performs. Tests use the class directly::

    sup = Supervisor(tmp_path / "state", port=free_port(), model_file=tiny_gguf,
                     actor_args={"worker": ["--kv-cache-bytes", "8000000"]})
    sup.start()                # etcd + nats, endpoints.json, model registration, actor processes
    try:
        sup.wait_ready(120)    # every gateway's GET /readyz answers 200
        ...                    # sup.http_url, sup.nats_url, sup.etcd_url, sup.pids
    finally:
        sup.stop()             # actors in parallel waves (SIGTERM their groups, then SIGKILL), nats, etcd

Layout under the state directory: ``endpoints.json``, ``pids.json``, ``logs/<actor>-<n>.log``
(plus ``logs/nats.log``, ``logs/etcd.log``), ``nats/`` (JetStream store) and ``etcd/`` (data).

Every actor runs as ``python -m control.ops.cli actor KIND ...`` in its own process group; the
supervisor signals only those groups (and the embedded servers' groups), never anything by name.

Assembled from: this module (configuration, start, the actors' argv and environment, stop), supervisor_health.py
(readiness, restarts), supervisor_versions.py (versions started and drained as the registry changes) and
supervisor_scaling.py (desired replica counts carried out); supervisor_processes.py has the process helpers.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from control.ops.deploy import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, _run_coro,  # noqa: F401 (re-exported)
                                ensure_dev_tenant, manifest_fingerprint, model_manifest,
                                register_model, start_nats_user_sync, version_worker_count)
from control.ops import supervisor_processes as processes
from control.ops.embedded_server import tail_file  # noqa: F401 (re-exported)
from control.ops.supervisor_health import HealthMixin
from control.ops import supervisor_scaling as scaling
from control.ops.supervisor_scaling import ScalingMixin, autoscaler_limits_argv, clear_desired, seed_desired
from control.ops.supervisor_processes import (PIDS_FILE, ActorProcess, SupervisorError,  # noqa: F401 (re-exported)
                                              http_status, pid_alive, probe_host, url_host)
from control.ops.supervisor_versions import STOP_ORDER, STOP_WAVES, VersionsMixin, stop_rank  # noqa: F401

log = logging.getLogger("actorserve.supervisor")

# Start order: the slow loaders first, the edges last. A kind missing from actors.kinds.ACTOR_MODULES
# (e.g. "rollout" before its actor exists) is skipped.
START_ORDER = ("worker", "scheduler", "validator", "jobs", "rollout", "autoscaler", "gateway")
# Actors that serve one model version (started and drained as versions come and go).
MODEL_KINDS = ("scheduler", "worker")

_REPO_ROOT = Path(__file__).resolve().parents[2]


class Supervisor(HealthMixin, VersionsMixin, ScalingMixin):
    """Starts, watches and stops the embedded stack and one process per actor.

    Arguments: ``state_dir`` (created if missing), ``host``/``port`` of the first gateway (gateway
    *n* listens on ``port + n``; ``port=0`` picks free ports), ``gateways``, ``workers``,
    ``model_file`` (a GGUF; default: the shipped SmolLM2), ``model_name``, ``model_version``,
    ``context_length`` (override), ``log_level`` (passed to every actor), ``actor_args``
    (extra argv per kind, e.g. ``{"worker": ["--kv-cache-bytes", "8000000"]}``), ``env`` (extra
    environment for the actors), ``echo_worker_log`` (copy worker-0's log to ``echo_stream``
    while waiting for readiness, so its loading progress bar shows), ``supervise`` (restart
    actors, and the embedded etcd and nats-server (same ports, same data directory), that die after
    :meth:`wait_ready` succeeded, at most ``max_restarts`` per ``restart_window_s`` each),
    ``stop_timeout_s`` (grace per kind before SIGKILL).

    ``watch_registry`` (default True): a thread polls the registry every ``registry_poll_s`` seconds
    and, for every active version it does not run yet, starts its scheduler and workers (as many as
    the manifest's extra key ``workers``, else ``workers``; named ``scheduler-<name>-<version>`` and
    ``worker-<name>-<version>-<n>``, while the version registered by :meth:`start` keeps
    ``scheduler-0`` / ``worker-<n>``); a version that becomes retired or disabled, is deleted, or
    whose manifest changes, has its processes drained (SIGTERM, SIGKILL after ``stop_timeout_s``)
    and, if still active, started again. Other actors are never restarted for a registry edit.
    ``pids.json`` is rewritten on every change; new model names are added to the dev tenant.

    The same watch carries out the desired replica counts in etcd (validators, workers per version
    and pool; control/ops/supervisor_scaling.py) whoever wrote them. ``autoscaler`` (``up``'s default,
    off here so that tests get fixed counts): also run the autoscaler actor (when its kind exists) with
    floors = today's counts and ceilings = ``cores`` (default: the CPUs this process may use).
    ``pool``: the pool workers are started for (``--pool``, when the worker has the option);
    ``max_workers``: no scale-up beyond that many workers in all (default ``max(workers, cores)``).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] = ".actorserve",
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        gateways: int = 1,
        workers: int = 1,
        model_file: str | os.PathLike[str] | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        model_version: str = DEFAULT_MODEL_VERSION,
        context_length: int | None = None,
        log_level: str | None = None,
        actor_args: Mapping[str, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
        echo_worker_log: bool = False,
        echo_stream: TextIO | None = None,
        supervise: bool = True,
        max_restarts: int = 5,
        restart_window_s: float = 60.0,
        stop_timeout_s: float = 15.0,  # > a worker's default --drain-timeout (10 s) plus its close
        python: str | None = None,
        watch_registry: bool = True,
        registry_poll_s: float = 0.5,
        tls: bool = False,
        autoscaler: bool = False,
        pool: str = "local",
        cores: int | None = None,
        max_workers: int | None = None,
        multi_model: bool = False,
    ) -> None:
        from control.state.names import validate_name

        if gateways < 1:
            raise ValueError("gateways must be >= 1")
        if workers < 0:
            raise ValueError("workers must be >= 0")
        validate_name("model name", model_name)
        validate_name("model version", model_version)
        validate_name("pool name", pool)
        self.cores = int(cores) if cores is not None else len(os.sched_getaffinity(0)) if hasattr(
            os, "sched_getaffinity") else (os.cpu_count() or 1)
        if self.cores < 1 or (max_workers is not None and max_workers < 0):
            raise ValueError("cores must be >= 1 and max_workers >= 0")
        self.multi_model = bool(multi_model)  # workers are hosts (actors/worker/host.py); no autoscaler then
        self.autoscaler, self.pool = bool(autoscaler) and not self.multi_model, pool
        self.max_workers = int(max_workers) if max_workers is not None else max(int(workers), self.cores)
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.host = host
        self.port = int(port)
        self.gateways = int(gateways)
        self.workers = int(workers)
        self.model_file = model_file
        self.model_name = model_name
        self.model_version = model_version
        self.context_length = context_length
        self.log_level = log_level
        self.actor_args = {k: list(v) for k, v in (actor_args or {}).items()}
        self.env = dict(env or {})
        self.echo_worker_log = echo_worker_log
        self.echo_stream = echo_stream
        self.supervise = supervise
        self.max_restarts = int(max_restarts)
        self.restart_window_s = float(restart_window_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.python = python or sys.executable
        self.watch_registry = bool(watch_registry)
        self.tls = bool(tls)  # `up --tls`: certificates in <state-dir>/tls/, TLS everywhere (control/ops/tls_stack.py)
        self.tls_dir: Path | None = None
        self.registry_poll_s = float(registry_poll_s)

        self.stack: Any = None  # control.ops.embedded.EmbeddedStack once started
        self.gateway_ports: list[int] = []
        self.actors: list[ActorProcess] = []
        self.manifest: dict[str, Any] | None = None
        self.dev_api_key: str | None = None  # key of tenant "dev" (also <state_dir>/dev-api-key), after start()
        self._lock = threading.RLock()
        self._stop_requested = threading.Event()
        self._stopping = False
        self._ready = False
        self._monitor: threading.Thread | None = None
        self._events: list[str] = []
        self._watcher: threading.Thread | None = None
        self._versions: dict[str, str] = {}  # "name@version" running -> fingerprint of its manifest
        self._draining: list[ActorProcess] = []  # removed from self.actors, being stopped
        self._bad_manifests: set[str] = set()  # invalid active versions already reported
        self._server_restarts: dict[str, collections.deque[float]] = {}  # embedded server -> restart times
        self._servers_given_up: set[str] = set()
        self._scaling_log: list[dict[str, Any]] = []  # ScalingMixin.scaling_log
        self._scale_notes: dict[str, str] = {}  # desired key / target -> last warning logged about it
        self._scale_killed: set[str] = set()  # scaled-down replicas SIGKILLed after stop_timeout_s

    # -- properties ------------------------------------------------------------------------

    @property
    def logs_dir(self) -> Path:
        """``<state-dir>/logs``."""
        return self.state_dir / "logs"

    @property
    def nats_url(self) -> str:
        """URL of the embedded NATS server (after start())."""
        return self.stack.nats_url

    @property
    def etcd_url(self) -> str:
        """URL of the embedded etcd (after start())."""
        return self.stack.etcd_url

    @property
    def http_url(self) -> str:
        """Base URL of the first gateway, ``http://HOST:PORT`` (after start())."""
        return self.gateway_url(0)

    def gateway_url(self, n: int) -> str:
        """Base URL of gateway ``n`` (0-based)."""
        return f"{'https' if self.tls else 'http'}://{url_host(self.host)}:{self.gateway_ports[n]}"

    @property
    def model_ref(self) -> str:
        """``name@version`` of the registered model version."""
        return f"{self.model_name}@{self.model_version}"

    @property
    def pids(self) -> dict[str, int]:
        """``{"nats": pid, "etcd": pid, "gateway-0": pid, ...}`` of the live processes."""
        out: dict[str, int] = {}
        if self.stack is not None:
            for srv in (self.stack.nats, self.stack.etcd):
                if srv.running and srv.pid is not None:
                    out[srv.name] = srv.pid
        with self._lock:
            for a in self.actors:
                if a.running and a.pid is not None:
                    out[a.name] = a.pid
        return out

    @property
    def events(self) -> list[str]:
        """Human-readable supervision events (restarts, give-ups), oldest first."""
        return list(self._events)

    def actor(self, name: str) -> ActorProcess:
        """The ActorProcess called ``name`` (e.g. ``"worker-0"``); KeyError if unknown."""
        for a in self.actors:
            if a.name == name:
                return a
        raise KeyError(name)

    def _event(self, msg: str, level: int = logging.INFO) -> None:
        """Log ``msg`` and keep it in :attr:`events`."""
        log.log(level, msg)
        self._events.append(msg)

    # -- start -----------------------------------------------------------------------------

    def _check_not_running(self) -> None:
        pid = processes.other_supervisor(self.state_dir)
        if pid is not None:
            raise SupervisorError(
                f"another `actorserve up` (pid {pid}) seems to be running with state dir {self.state_dir}; "
                f"stop it first or pass a different --state-dir"
            )
        from actors.lifeline import live_stack

        left = live_stack(self.state_dir)  # an orphaned stack: its supervisor died, its processes did not
        if left is not None:
            raise SupervisorError(left)

    def _choose_ports(self) -> None:
        from control.ops.ports import free_ports, port_open

        if self.port == 0:
            self.gateway_ports = free_ports(self.gateways, probe_host(self.host))
            return
        self.gateway_ports = [self.port + i for i in range(self.gateways)]
        busy = [p for p in self.gateway_ports if port_open(p, probe_host(self.host))]
        if busy:
            raise SupervisorError(
                f"port(s) {', '.join(map(str, busy))} on {self.host} already in use; pass another --port"
            )

    def _check_abort(self) -> None:
        if self._stop_requested.is_set():
            raise SupervisorError("stop requested during startup")

    def start(self) -> "Supervisor":
        """Start everything; return self once all actor processes are spawned (not yet ready).

        Creates the state directory, starts etcd and NATS on free loopback ports, writes
        ``endpoints.json``, registers the model version, spawns the actors (workers first,
        gateways last) and writes ``pids.json``. On any failure everything started so far is
        stopped and the error re-raised (SupervisorError, FileNotFoundError, ValueError, ...).
        """
        from control.ops.embedded import EmbeddedStack, write_endpoints

        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._check_not_running()
        try:
            self._choose_ports()
            self.manifest = model_manifest(
                self.model_name, self.model_version, self.model_file, context_length=self.context_length
            )
            self._check_abort()
            if self.tls:
                from control.ops.tls_stack import prepare_tls
                self.tls_dir = prepare_tls(self.state_dir, self.host)
            self.stack = EmbeddedStack(self.state_dir, nats_auth=True, tls_dir=self.tls_dir)
            self.stack.start()
            self._check_abort()
            write_endpoints(self.state_dir, self.stack.nats_url, self.stack.etcd_url, self.http_url,
                            tls_dir=self.tls_dir)
            self.manifest = _run_coro(register_model(self.stack.etcd_url, self.manifest))
            log.info("registered %s (%s)", self.model_ref, self.manifest.get("artifact"))
            self.dev_api_key = _run_coro(ensure_dev_tenant(self.stack.etcd_url, self.state_dir))
            _run_coro(clear_desired(self.stack.etcd_url))  # an earlier run's desired counts and notices do not apply
            self._user_sync = start_nats_user_sync(self.stack)
            self._check_abort()
            self._build_actors()
            _run_coro(seed_desired(self.stack.etcd_url, self._started_counts()))
            for a in self.actors:
                self._spawn(a)
            self._versions[self.model_ref] = manifest_fingerprint(self.manifest)
            self._write_pids()
        except BaseException:
            self.stop()
            raise
        if self.watch_registry:
            self._watcher = threading.Thread(target=self._watch_thread, name="actorserve-registry-watch",
                                             daemon=True)
            self._watcher.start()
        if self.supervise:
            self._monitor = threading.Thread(target=self._monitor_loop, name="actorserve-supervisor", daemon=True)
            self._monitor.start()
        return self

    def _base_argv(self, kind: str) -> list[str]:
        argv = [
            self.python, "-m", "control.ops.cli", "actor", kind,
            "--etcd", self.stack.etcd_url,
            "--state-dir", str(self.state_dir),
        ]
        if self.log_level:
            argv += ["--log-level", self.log_level]
        return argv

    def _build_actors(self) -> None:
        from actors.kinds import ACTOR_MODULES

        ref = self.model_ref
        actors: list[ActorProcess] = []
        for kind in START_ORDER:
            if kind not in ACTOR_MODULES:
                continue
            if kind == "worker":
                actors += [a for a in self._version_actors(ref, self.workers) if a.kind == "worker"]
            elif kind == "scheduler":
                actors += [a for a in self._version_actors(ref, self.workers) if a.kind == "scheduler"]
            elif kind == "validator":
                actors.append(self._validator_actor(0))
            elif kind == "autoscaler":
                if self.autoscaler:
                    actors.append(self._actor(kind, 0, self._base_argv(kind) + autoscaler_limits_argv(
                        self.cores, self.workers, self.gateways, pool=self.pool)))
            elif kind in ("jobs", "rollout"):
                actors.append(self._actor(kind, 0, self._base_argv(kind)))
            else:
                for n in range(self.gateways):
                    argv = self._base_argv(kind) + [
                        "--host", self.host, "--port", str(self.gateway_ports[n]), "--gateway-id", f"gw-{n}",
                    ]
                    actors.append(self._actor(kind, n, argv))
        self.actors = actors

    def _started_counts(self) -> dict[str, int]:
        """Desired key -> replicas (> 0) of the actors :meth:`_build_actors` set up: validators, the
        version's workers."""
        from control.state.names import desired_key

        name, _, version = self.model_ref.partition("@")
        counts = {desired_key("validator"): sum(1 for a in self.actors if a.kind == "validator")}
        for a in self.actors:
            if a.kind == "worker" and a.model in (None, self.model_ref):
                key = desired_key("worker", name, version, getattr(a, "pool", self.pool))
                counts[key] = counts.get(key, 0) + 1
        return {k: n for k, n in counts.items() if n > 0}

    def _actor(self, kind: str, n: int, argv: list[str]) -> ActorProcess:
        return self._named_actor(f"{kind}-{n}", kind, argv)

    def _named_actor(self, name: str, kind: str, argv: list[str], model: str | None = None) -> ActorProcess:
        return ActorProcess(name, kind, argv + self.actor_args.get(kind, []), self.logs_dir / f"{name}.log",
                            model=model)

    def _version_actors(self, ref: str, workers: int) -> list[ActorProcess]:
        """The scheduler and ``workers`` workers of model version ``ref`` (not started), workers first.

        The version registered by :meth:`start` keeps the names ``scheduler-0`` / ``worker-<n>``;
        any other gets ``scheduler-<name>-<version>`` / ``worker-<name>-<version>-<n>`` (also the
        worker ids)."""
        name, _, version = ref.partition("@")
        initial = ref == self.model_ref
        workers = 0 if self.multi_model and not initial else workers  # multi-model: hosts load it on demand
        out = [self._worker_actor(ref, n, self.pool) for n in range(workers)]
        sname = "scheduler-0" if initial else f"scheduler-{name}-{version}"
        out.append(self._named_actor(sname, "scheduler", self._base_argv("scheduler") + ["--model", ref], model=ref))
        return out

    def _worker_actor(self, ref: str, n: int, pool: str) -> ActorProcess:
        """Worker ``n`` of version ``ref`` on ``pool`` (not started): ``worker-<n>`` for the version of
        :meth:`start`, else ``worker-<name>-<version>-<n>``; ``--pool`` when the worker has the option."""
        name, _, version = ref.partition("@")
        wid = f"worker-{n}" if ref == self.model_ref else f"worker-{name}-{version}-{n}"
        argv = self._base_argv("worker") + ["--model", ref, "--worker-id", wid] + ["--host"] * self.multi_model
        if scaling.kind_accepts("worker", "--pool"):
            argv += ["--pool", pool]
        a = self._named_actor(wid, "worker", argv, model=ref)
        a.pool = pool
        return a

    def _validator_actor(self, n: int) -> ActorProcess:
        """Validator ``n`` (``validator-<n>``; not started)."""
        return self._actor("validator", n, self._base_argv("validator"))

    def _child_env(self, kind: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        env["ACTORSERVE_STATE_DIR"] = str(self.state_dir)
        if self.stack is not None:  # in the environment, not argv: the URL carries the role's NATS password
            from control.ops.nats_roles import KIND_ROLES
            role = KIND_ROLES.get(kind or "")
            env["ACTORSERVE_NATS"] = self.stack.nats.role_url(role) if role else self.stack.nats_url
        from bus.nats_auth import OPERATOR_TOKEN_ENV, operator_token
        env.pop(OPERATOR_TOKEN_ENV, None)  # only gateways get the operator token (their /metrics checks it)
        if kind == "gateway":
            env[OPERATOR_TOKEN_ENV] = operator_token(self.state_dir)
        if self.tls_dir is not None:  # the CA and the role's client certificate (gateways: + HTTPS certificate)
            from control.ops.tls_stack import child_tls_env
            env.update(child_tls_env(self.tls_dir, kind))
        # `python -m control.ops.cli` must import this checkout even when it is not installed.
        pp = env.get("PYTHONPATH", "")
        parts = [p for p in pp.split(os.pathsep) if p]
        if str(_REPO_ROOT) not in parts:
            env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *parts])
        return env

    def _spawn(self, a: ActorProcess) -> None:
        processes.spawn(a, self.state_dir, self._child_env(a.kind))

    def _write_pids(self) -> None:
        with self._lock:
            stopped = {a.name: {"by": a.stopped_by, "status": a.proc.returncode if a.proc is not None else None}
                       for a in self.actors if a.stopped_by and not a.running}
            stopped.update({a.name: {"by": a.stopped_by, "status": None, "draining": True} for a in self.actors
                            if a.stopped_by and a.running})  # scaled down, still draining
        processes.write_pids(self.state_dir, self.pids, stopped)

    def request_stop(self) -> None:
        """Ask a waiting :meth:`wait_ready` / :meth:`wait` to return; safe from signal handlers."""
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`request_stop` is called (True) or ``timeout`` passes (False)."""
        return self._stop_requested.wait(timeout)

    # -- stop ------------------------------------------------------------------------------

    def _terminate(self, group: list[ActorProcess]) -> None:
        """Stop ``group`` in the waves of STOP_WAVES (every wave concurrent, one ``stop_timeout_s`` deadline)."""
        processes.terminate(group, self.stop_timeout_s, STOP_WAVES)

    def stop(self) -> None:
        """Stop the actors in waves (STOP_WAVES: rollout, gateways and jobs first so that no new work
        enters, then validator and schedulers, then workers; every process of a wave SIGTERMed at once,
        the next wave when the earlier ones exited or 1 s later), all within one ``stop_timeout_s``
        deadline before SIGKILL; then NATS and etcd. Idempotent."""
        self._stop_requested.set()
        with self._lock:
            self._stopping = True
        t0 = time.monotonic()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)
        with self._lock:  # the registry watch starts nothing once _stopping is set
            group = sorted(self.actors, key=stop_rank)
        self._terminate(group)  # without waiting for the watch first: its poll must not delay the drain
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.stop_timeout_s + 15)  # it finishes a version drain it began
        with self._lock:
            left = [a for a in self._draining if a.running]
        if left:
            self._terminate(sorted(left, key=stop_rank))
        t_actors = time.monotonic()
        if getattr(self, "_user_sync", None) is not None:
            self._user_sync.stop()
        if self.stack is not None:
            self.stack.stop()
        processes.remove_own_pids(self.state_dir)
        if any(a.proc is not None for a in group) and not getattr(self, "_stop_logged", False):
            self._stop_logged = True
            log.info("stopped the actors in %.1f s, then nats and etcd in %.1f s", t_actors - t0,
                     time.monotonic() - t_actors)

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
