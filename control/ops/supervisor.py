"""``actorserve up``: the embedded stack and one OS process per actor, supervised.

:class:`Supervisor` does the work; the CLI's ``up`` verb (control/ops/up.py ``main_up``) wraps it with
signal handling and terminal output; control/ops/deploy.py has the model registration it performs. Tests
use the class directly::

    sup = Supervisor(StackConfig(tmp_path / "state", port=free_port(), model_file=tiny_gguf,
                                 actor_args={"worker": ["--kv-cache-bytes", "8000000"]}))
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

Built from parts, each with its collaborators declared: :class:`StackConfig` (control/ops/stack_config.py,
what runs), ``procs`` (:class:`ProcessTable`, supervisor_processes.py: the lock, the actor table,
spawning, the restart budget, ``pids.json``, the events), ``factory`` (``ActorFactory``, stack_actors.py:
each actor's argv and environment), ``health`` (``HealthMonitor``, supervisor_health.py: readiness,
restarts), ``versions`` (``VersionReconciler``, supervisor_versions.py: the registry watch, versions
started and drained) and ``scaling`` (``ScalingReconciler``, supervisor_scaling.py: desired replica counts
carried out). This module starts and stops them in order.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from control.ops.deploy import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, _run_coro,  # noqa: F401 (re-exported)
                                ensure_dev_tenant, manifest_fingerprint, model_manifest,
                                register_model, start_nats_user_sync, version_worker_count)
from control.ops import supervisor_processes as processes
from control.ops.embedded_server import tail_file  # noqa: F401 (re-exported)
from control.ops.stack_actors import MODEL_KINDS, START_ORDER, ActorFactory  # noqa: F401 (re-exported)
from control.ops.stack_config import StackConfig
from control.ops.supervisor_health import HealthMonitor
from control.ops.supervisor_scaling import ScalingReconciler, clear_desired, seed_desired, started_counts
from control.ops.supervisor_processes import (PIDS_FILE, STOP_ORDER, STOP_WAVES,  # noqa: F401 (re-exported)
                                              ActorProcess, ProcessTable, SupervisorError, http_status, pid_alive,
                                              probe_host, stop_rank, url_host)
from control.ops.supervisor_versions import VersionReconciler

log = logging.getLogger("actorserve.supervisor")


class Supervisor:
    """Starts, watches and stops the embedded stack and one process per actor, as ``config`` says
    (:class:`StackConfig`).

    With ``watch_registry``, a thread polls the registry every ``registry_poll_s`` seconds and, for every
    active version it does not run yet, starts its scheduler and workers (as many as the manifest's extra
    key ``workers``, else ``workers``); a version that becomes retired or disabled, is deleted, or whose
    manifest changes, has its processes drained (SIGTERM, SIGKILL after ``stop_timeout_s``) and, if still
    active, started again. Other actors are never restarted for a registry edit. The same watch carries
    out the desired replica counts in etcd (validators, workers per version and pool) whoever wrote them.
    With ``supervise``, actors and embedded servers that die after :meth:`wait_ready` are restarted
    within their budget. ``pids.json`` is rewritten on every change.
    """

    def __init__(self, config: StackConfig) -> None:
        if not isinstance(config, StackConfig):
            raise TypeError(f"Supervisor takes a StackConfig, not {type(config).__name__}")
        self.cfg = config
        self.stack: Any = None  # control.ops.embedded.EmbeddedStack once started
        self.gateway_ports: list[int] = []
        self.tls_dir: Path | None = None  # `up --tls`: certificates in <state-dir>/tls/ (control/ops/tls_stack.py)
        self.manifest: dict[str, Any] | None = None
        self.dev_api_key: str | None = None  # key of tenant "dev" (also <state_dir>/dev-api-key), after start()
        self._stop_requested = threading.Event()
        self._threads: list[threading.Thread] = []
        self._user_sync: Any = None
        self._stop_logged = False
        self.factory = ActorFactory(config, self)
        self.procs = ProcessTable(config.state_dir, self.factory.env, self._servers, config.stop_timeout_s,
                                  config.max_restarts, config.restart_window_s)
        self.health = HealthMonitor(config, self.procs, self, self._stop_requested)
        self.versions = VersionReconciler(config, self.procs, self.factory, self, self._stop_requested)
        self.scaling = ScalingReconciler(config, self.procs, self.factory, self.versions.running,
                                         lambda: self.health.ready)

    # -- properties ------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        """The state directory (absolute)."""
        return Path(self.cfg.state_dir)

    @property
    def logs_dir(self) -> Path:
        """``<state-dir>/logs``."""
        return self.cfg.logs_dir

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
        return f"{'https' if self.cfg.tls else 'http'}://{url_host(self.cfg.host)}:{self.gateway_ports[n]}"

    @property
    def model_ref(self) -> str:
        """``name@version`` of the registered model version."""
        return self.cfg.model_ref

    @property
    def actors(self) -> list[ActorProcess]:
        """The actor processes (running, or kept stopped)."""
        return self.procs.actors

    @property
    def pids(self) -> dict[str, int]:
        """``{"nats": pid, "etcd": pid, "gateway-0": pid, ...}`` of the live processes."""
        return self.procs.pids()

    @property
    def events(self) -> list[str]:
        """Human-readable supervision events (restarts, give-ups, versions, scaling), oldest first."""
        return list(self.procs.events)

    def actor(self, name: str) -> ActorProcess:
        """The ActorProcess called ``name`` (e.g. ``"worker-0"``); KeyError if unknown."""
        return self.procs.actor(name)

    def _servers(self) -> tuple:
        """The embedded servers (for ``pids.json``), none before the start."""
        return () if self.stack is None else (self.stack.nats, self.stack.etcd)

    # -- what the parts do, at the supervisor's surface ----------------------------------------

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until every gateway's ``GET /readyz`` answers 200 (``HealthMonitor.wait_ready``: raises
        SupervisorError when an actor exits, ``timeout`` s pass or a stop is requested)."""
        self.health.wait_ready(timeout)

    @property
    def stopped_by_operator(self) -> list[str]:
        """Names of the actors stopped by the operator and therefore not restarted (``HealthMonitor``)."""
        return self.health.stopped_by_operator

    def start_stopped(self, names: list[str] | None = None) -> list[str]:
        """Start again the actors stopped by the operator (``HealthMonitor.start_stopped``; SIGHUP of ``up``)."""
        return self.health.start_stopped(names)

    def reconcile(self, models: Any) -> tuple[list[str], list[str]]:
        """Make the running model versions match the registry listing ``models`` (``VersionReconciler``)."""
        return self.versions.reconcile(models)

    @property
    def running_versions(self) -> list[str]:
        """``name@version`` of every model version whose processes run, sorted."""
        return self.versions.running_versions

    def scaling_round(self, desired_records: Any, ready_records: Any, now: float | None = None,
                      notices: Any = None) -> bool:
        """One round of desired replica counts (``ScalingReconciler.round``); True when anything changed."""
        return self.scaling.round(desired_records, ready_records, now, notices)

    @property
    def scaling_log(self) -> list[dict[str, Any]]:
        """Every scale action, oldest first (``ScalingReconciler.log``)."""
        return self.scaling.log

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

        cfg = self.cfg
        if cfg.port == 0:
            self.gateway_ports = free_ports(cfg.gateways, probe_host(cfg.host))
            return
        self.gateway_ports = [cfg.port + i for i in range(cfg.gateways)]
        busy = [p for p in self.gateway_ports if port_open(p, probe_host(cfg.host))]
        if busy:
            raise SupervisorError(f"port(s) {', '.join(map(str, busy))} on {cfg.host} already in use; "
                                  f"pass another --port")

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

        cfg = self.cfg
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._check_not_running()
        try:
            self._choose_ports()
            self.manifest = model_manifest(cfg.model_name, cfg.model_version, cfg.model_file,
                                           context_length=cfg.context_length)
            self._check_abort()
            if cfg.tls:
                from control.ops.tls_stack import prepare_tls
                self.tls_dir = prepare_tls(self.state_dir, cfg.host)
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
            with self.procs.lock:
                self.procs.actors = self.factory.initial()
            _run_coro(seed_desired(self.stack.etcd_url, started_counts(self.procs.actors, cfg.model_ref, cfg.pool)))
            for a in self.procs.actors:
                self.procs.spawn(a)
            self.versions.adopt(self.model_ref, manifest_fingerprint(self.manifest))
            self.procs.write_pids()
        except BaseException:
            self.stop()
            raise
        if cfg.watch_registry:
            self._start_thread("actorserve-registry-watch", lambda: self.versions.watch(self.scaling))
        if cfg.supervise:
            self._start_thread("actorserve-supervisor", self.health.run)
        return self

    def _start_thread(self, name: str, target: Any) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def request_stop(self) -> None:
        """Ask a waiting :meth:`wait_ready` / :meth:`wait` to return; safe from signal handlers."""
        self._stop_requested.set()

    @property
    def stop_requested(self) -> bool:
        """True once :meth:`request_stop` or :meth:`stop` was called."""
        return self._stop_requested.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`request_stop` is called (True) or ``timeout`` passes (False)."""
        return self._stop_requested.wait(timeout)

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the actors in waves (STOP_WAVES: rollout, gateways and jobs first so that no new work
        enters, then validator and schedulers, then workers; every process of a wave SIGTERMed at once,
        the next wave when the earlier ones exited or 1 s later), all within one ``stop_timeout_s``
        deadline before SIGKILL; then NATS and etcd. Idempotent."""
        self._stop_requested.set()
        procs = self.procs
        with procs.lock:
            procs.stopping = True  # the registry watch and the monitor start nothing from here on
        t0 = time.monotonic()
        me = threading.current_thread()
        monitor = [t for t in self._threads if t.name == "actorserve-supervisor" and t is not me]
        for t in monitor:
            t.join(timeout=5)
        with procs.lock:
            group = sorted(procs.actors, key=stop_rank)
        procs.terminate(group)  # without waiting for the watch first: its poll must not delay the drain
        for t in self._threads:
            if t.name == "actorserve-registry-watch" and t is not me:
                t.join(timeout=self.cfg.stop_timeout_s + 15)  # it finishes a version drain it began
        with procs.lock:
            left = [a for a in procs.draining if a.running]
        if left:
            procs.terminate(sorted(left, key=stop_rank))
        t_actors = time.monotonic()
        if self._user_sync is not None:
            self._user_sync.stop()
        if self.stack is not None:
            self.stack.stop()
        processes.remove_own_pids(self.state_dir)
        if any(a.proc is not None for a in group) and not self._stop_logged:
            self._stop_logged = True
            log.info("stopped the actors in %.1f s, then nats and etcd in %.1f s", t_actors - t0,
                     time.monotonic() - t_actors)

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
