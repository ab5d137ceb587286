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
        sup.stop()             # actors in order (SIGTERM their groups, then SIGKILL), nats, etcd

Layout under the state directory: ``endpoints.json``, ``pids.json``, ``logs/<actor>-<n>.log``
(plus ``logs/nats.log``, ``logs/etcd.log``), ``nats/`` (JetStream store) and ``etcd/`` (data).

Every actor runs as ``python -m control.ops.cli actor KIND ...`` in its own process group; the
supervisor signals only those groups (and the embedded servers' groups), never anything by name.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from control.ops.deploy import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, _run_coro,  # noqa: F401 (re-exported)
                            ensure_dev_tenant, manifest_fingerprint, model_manifest,
                            register_model, start_nats_user_sync, version_worker_count)

log = logging.getLogger("actorserve.supervisor")

PIDS_FILE = "pids.json"

# Stop order: the rollout controller first (no decisions while the stack goes away), then the edges
# (no new traffic), then the pipeline front to back.
STOP_ORDER = ("rollout", "gateway", "jobs", "validator", "scheduler", "worker")
# Start order: the slow loaders first, the edges last. A kind missing from actors.kinds.ACTOR_MODULES
# (e.g. "rollout" before its actor exists) is skipped.
START_ORDER = ("worker", "scheduler", "validator", "jobs", "rollout", "gateway")
# Actors that serve one model version (started and drained as versions come and go).
MODEL_KINDS = ("scheduler", "worker")

_REPO_ROOT = Path(__file__).resolve().parent.parent

class SupervisorError(RuntimeError):
    """The stack could not be started (an actor died during startup, readiness timed out, ...)."""


def tail_file(path: str | os.PathLike[str], max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` of a text file (decoded leniently), or a note if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<could not read {path}: {e}>"


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """HTTP status of ``GET url`` (loopback), or None if the server does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (local URL)
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _probe_host(host: str) -> str:
    """Address to probe a server bound on ``host`` (wildcards are probed on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass
class ActorProcess:
    """One supervised actor process: its identity, argv, log file and restart history."""

    name: str  # e.g. "gateway-0"
    kind: str  # gateway | validator | scheduler | worker
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: collections.deque[float] = field(default_factory=collections.deque)
    given_up: bool = False
    model: str | None = None  # "name@version" for schedulers and workers
    dynamic: bool = False  # started by the registry watch (its death is not fatal during wait_ready)

    @property
    def pid(self) -> int | None:
        """Pid (== process group id) of the current process, or None before the first start."""
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        """True while the current process has not exited."""
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
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
    ) -> None:
        from control.state.names import validate_name

        if gateways < 1:
            raise ValueError("gateways must be >= 1")
        if workers < 0:
            raise ValueError("workers must be >= 0")
        validate_name("model name", model_name)
        validate_name("model version", model_version)
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
        return f"http://{_url_host(self.host)}:{self.gateway_ports[n]}"

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

    # -- start -----------------------------------------------------------------------------

    def _check_not_running(self) -> None:
        path = self.state_dir / PIDS_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        pid = data.get("supervisor") if isinstance(data, dict) else None
        if isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
            raise SupervisorError(
                f"another `actorserve up` (pid {pid}) seems to be running with state dir {self.state_dir}; "
                f"stop it first or pass a different --state-dir"
            )

    def _choose_ports(self) -> None:
        from control.ops.ports import free_ports, port_open

        if self.port == 0:
            self.gateway_ports = free_ports(self.gateways, _probe_host(self.host))
            return
        self.gateway_ports = [self.port + i for i in range(self.gateways)]
        busy = [p for p in self.gateway_ports if port_open(p, _probe_host(self.host))]
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
            self.stack = EmbeddedStack(self.state_dir, nats_auth=True)
            self.stack.start()
            self._check_abort()
            write_endpoints(self.state_dir, self.stack.nats_url, self.stack.etcd_url, self.http_url)
            self.manifest = _run_coro(register_model(self.stack.etcd_url, self.manifest))
            log.info("registered %s (%s)", self.model_ref, self.manifest.get("artifact"))
            self.dev_api_key = _run_coro(ensure_dev_tenant(self.stack.etcd_url, self.state_dir))
            self._user_sync = start_nats_user_sync(self.stack)
            self._check_abort()
            self._build_actors()
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
            elif kind in ("validator", "jobs", "rollout"):
                actors.append(self._actor(kind, 0, self._base_argv(kind)))
            else:
                for n in range(self.gateways):
                    argv = self._base_argv(kind) + [
                        "--host", self.host, "--port", str(self.gateway_ports[n]), "--gateway-id", f"gw-{n}",
                    ]
                    actors.append(self._actor(kind, n, argv))
        self.actors = actors

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
        out: list[ActorProcess] = []
        for n in range(workers):
            wid = f"worker-{n}" if initial else f"worker-{name}-{version}-{n}"
            argv = self._base_argv("worker") + ["--model", ref, "--worker-id", wid]
            out.append(self._named_actor(wid, "worker", argv, model=ref))
        sname = "scheduler-0" if initial else f"scheduler-{name}-{version}"
        out.append(self._named_actor(sname, "scheduler", self._base_argv("scheduler") + ["--model", ref], model=ref))
        return out

    def _child_env(self, kind: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        env["ACTORSERVE_STATE_DIR"] = str(self.state_dir)
        if self.stack is not None:  # in the environment, not argv: the URL carries the role's NATS password
            from control.ops.nats_roles import KIND_ROLES
            role = KIND_ROLES.get(kind or "")
            env["ACTORSERVE_NATS"] = self.stack.nats.role_url(role) if role else self.stack.nats_url
        # `python -m control.ops.cli` must import this checkout even when it is not installed.
        pp = env.get("PYTHONPATH", "")
        parts = [p for p in pp.split(os.pathsep) if p]
        if str(_REPO_ROOT) not in parts:
            env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *parts])
        return env

    def _spawn(self, a: ActorProcess) -> None:
        with open(a.log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {shlex.join(a.argv)}\n".encode())
            logf.flush()
            a.proc = subprocess.Popen(
                a.argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=str(self.state_dir),
                env=self._child_env(a.kind),
                start_new_session=True,
                close_fds=True,
            )
        log.info("started %s (pid %s)", a.name, a.proc.pid)

    def _write_pids(self) -> None:
        data: dict[str, Any] = {"supervisor": os.getpid(), **self.pids}
        path = self.state_dir / PIDS_FILE
        tmp = path.with_name(f".{PIDS_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:  # pragma: no cover - state dir removed under us
            log.warning("could not write %s: %s", path, e)

    # -- readiness -------------------------------------------------------------------------

    def _died_error(self, a: ActorProcess) -> SupervisorError:
        rc = a.proc.returncode if a.proc is not None else None
        return SupervisorError(
            f"{a.name} exited with status {rc} during startup; last lines of {a.log_path}:\n"
            f"{tail_file(a.log_path)}"
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until every gateway's ``GET /readyz`` answers 200.

        Raises SupervisorError (with the tail of its log) if an actor exits meanwhile, if
        ``timeout`` seconds pass, or if :meth:`request_stop` is called. Does not stop anything
        itself: call :meth:`stop`. Afterwards dead actors are restarted (when ``supervise``).
        """
        deadline = time.monotonic() + timeout
        echo = self._echo_source() if self.echo_worker_log else None
        pending = list(range(self.gateways))
        try:
            while True:
                if echo is not None:
                    echo()
                with self._lock:
                    for a in self.actors:
                        if not a.dynamic and a.proc is not None and a.proc.poll() is not None:
                            raise self._died_error(a)
                pending = [n for n in pending if http_status(f"{self._probe_url(n)}/readyz") != 200]
                if not pending:
                    break
                if self._stop_requested.is_set():
                    raise SupervisorError("stop requested while waiting for readiness")
                if time.monotonic() >= deadline:
                    names = ", ".join(f"gateway-{n}" for n in pending)
                    tails = "\n".join(
                        f"--- {a.name} ({a.log_path}):\n{tail_file(a.log_path, 1500)}" for a in self.actors
                    )
                    raise SupervisorError(f"{names} not ready within {timeout:.0f} s; actor logs:\n{tails}")
                self._stop_requested.wait(0.25)
        finally:
            if echo is not None:
                echo(final=True)
        self._ready = True

    def _probe_url(self, n: int) -> str:
        return f"http://{_url_host(_probe_host(self.host))}:{self.gateway_ports[n]}"

    def _echo_source(self) -> Callable[..., None] | None:
        """A function copying new bytes of worker-0's log to the echo stream (the progress bar)."""
        workers = [a for a in self.actors if a.kind == "worker"]
        if not workers:
            return None
        path = workers[0].log_path
        stream = self.echo_stream or sys.stderr
        out = getattr(stream, "buffer", None)
        try:
            offset = path.stat().st_size
        except OSError:
            offset = 0
        # Skip our own "=== starting" header: show from the start of this run's output.
        try:
            text = path.read_bytes()
            idx = text.rfind(b"\n=== ")
            if idx >= 0:
                nl = text.find(b"\n", idx + 1)
                offset = nl + 1 if nl >= 0 else offset
        except OSError:
            pass
        state = {"offset": offset}

        def echo(final: bool = False) -> None:
            try:
                with open(path, "rb") as f:
                    f.seek(state["offset"])
                    data = f.read()
            except OSError:
                return
            if not data:
                return
            state["offset"] += len(data)
            if out is not None:
                out.write(data)
            else:
                stream.write(data.decode("utf-8", "replace"))
            stream.flush()
            if final and not data.endswith(b"\n"):
                stream.write("\n")
                stream.flush()

        return echo

    # -- supervision -----------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while not self._stop_requested.wait(0.5):
            if not self._ready:
                continue  # before readiness a death is fatal (wait_ready reports it)
            # Embedded servers first (etcd, then NATS): actors need them. Outside the lock: a start
            # blocks up to the server's startup timeout.
            servers_changed = self._restart_servers()
            with self._lock:
                if self._stopping:
                    return
                changed = servers_changed
                for a in self.actors:
                    if a.given_up or a.proc is None or a.proc.poll() is None:
                        continue
                    changed |= self._restart(a)
                if changed:
                    self._write_pids()

    def _restart_servers(self) -> bool:
        """Start an embedded server (etcd, nats-server) that died again, on the same ports with the same
        data directory (JetStream file store, etcd data), at most ``max_restarts`` per
        ``restart_window_s`` each. Returns True when one was restarted."""
        if self.stack is None:
            return False
        changed = False
        for srv in (self.stack.etcd, self.stack.nats):
            if self._stopping or srv.running or srv.pid is None or srv.name in self._servers_given_up:
                continue
            rc = srv._proc.returncode if srv._proc is not None else None
            history = self._server_restarts.setdefault(srv.name, collections.deque())
            now = time.monotonic()
            while history and now - history[0] > self.restart_window_s:
                history.popleft()
            if len(history) >= self.max_restarts:
                self._servers_given_up.add(srv.name)
                msg = (f"{srv.name} exited with status {rc}; restarted {len(history)} times in the last "
                       f"{self.restart_window_s:.0f} s: giving up on it (log: {srv.log_path})")
                log.error(msg)
                self._events.append(msg)
                continue
            history.append(now)
            msg = f"{srv.name} exited with status {rc}; restarting on port {srv.port} (log: {srv.log_path})"
            log.warning(msg)
            self._events.append(msg)
            try:
                srv.start()
                changed = True
            except (RuntimeError, OSError) as e:  # retried on the next round, within the window's budget
                log.error("could not restart %s: %s", srv.name, str(e).splitlines()[0])
        return changed

    def _restart(self, a: ActorProcess) -> bool:
        rc = a.proc.returncode if a.proc is not None else None
        now = time.monotonic()
        while a.restarts and now - a.restarts[0] > self.restart_window_s:
            a.restarts.popleft()
        if len(a.restarts) >= self.max_restarts:
            a.given_up = True
            msg = (
                f"{a.name} exited with status {rc}; restarted {len(a.restarts)} times in the last "
                f"{self.restart_window_s:.0f} s: giving up on it (log: {a.log_path})"
            )
            log.error(msg)
            self._events.append(msg)
            return False
        a.restarts.append(now)
        msg = f"{a.name} exited with status {rc}; restarting (log: {a.log_path})"
        log.warning(msg)
        self._events.append(msg)
        try:
            self._spawn(a)
        except OSError as e:
            log.error("could not restart %s: %s", a.name, e)
            return False
        return True

    def request_stop(self) -> None:
        """Ask a waiting :meth:`wait_ready` / :meth:`wait` to return; safe from signal handlers."""
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`request_stop` is called (True) or ``timeout`` passes (False)."""
        return self._stop_requested.wait(timeout)

    # -- registry watch: versions come and go live ------------------------------------------

    def _watch_thread(self) -> None:
        try:
            asyncio.run(self._watch_registry())
        except Exception:  # pragma: no cover - logged, the rest of the stack keeps running
            log.exception("registry watch stopped")

    async def _watch_registry(self) -> None:
        """Poll the registry every ``registry_poll_s`` s (one connection, reopened after errors) and
        reconcile the running model versions with it until :meth:`stop`."""
        from control.state.registry import Registry

        reg = None
        allowed: set[str] | None = None  # model names the dev tenant was given (start() did the first)
        warned = False
        try:
            while not self._stop_requested.is_set():
                try:
                    if reg is None:
                        reg = await Registry.open(self.stack.etcd_url, timeout=3.0)
                    models = await reg.list_models()
                    warned = False
                except Exception as e:
                    if not warned and not self._stop_requested.is_set():
                        log.warning("registry watch: cannot read the registry (%r); retrying", e)
                        warned = True
                    if reg is not None:
                        await reg.close()
                        reg = None
                    await asyncio.sleep(self.registry_poll_s)
                    continue
                if allowed is None:
                    allowed = set(models)
                new_names = set(models) - allowed
                if new_names and self.dev_api_key:
                    try:
                        from control.state.tenants import TenantAdmin

                        await TenantAdmin(reg).ensure_dev_tenant(self.state_dir, sorted(new_names))
                        allowed |= new_names
                    except Exception as e:
                        log.warning("registry watch: could not allow %s for the dev tenant: %r",
                                    ", ".join(sorted(new_names)), e)
                # Spawning is quick; draining may wait up to stop_timeout_s: keep it off the loop.
                await asyncio.to_thread(self.reconcile, models)
                await asyncio.sleep(self.registry_poll_s)
        finally:
            if reg is not None:
                await reg.close()

    def reconcile(self, models: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> tuple[list[str], list[str]]:
        """Make the running model versions match the registry listing ``models``
        (``{name: {version: manifest}}``, as :meth:`control.state.registry.Registry.list_models` returns).

        Starts the scheduler and workers of every valid active version not running yet; drains (and
        forgets) those of versions that are gone, no longer active or whose manifest changed (a
        changed active one is then started again). Returns ``(started, stopped)`` refs. Called by the
        registry watch; safe to call from any thread. Does nothing once :meth:`stop` began.
        """
        from control.state.registry import ModelManifest

        desired: dict[str, tuple[str, int]] = {}
        for name, versions in models.items():
            for version, manifest in versions.items():
                if not isinstance(manifest, Mapping) or manifest.get("status", "active") != "active":
                    continue
                ref = f"{name}@{version}"
                try:
                    ModelManifest.from_dict({"name": name, "version": version, **manifest})
                except ValueError as e:
                    if ref not in self._bad_manifests:
                        log.error("not starting %s: invalid manifest: %s", ref, e)
                        self._bad_manifests.add(ref)
                    continue
                self._bad_manifests.discard(ref)
                desired[ref] = (manifest_fingerprint(manifest), version_worker_count(manifest, self.workers))
        with self._lock:
            if self._stopping:
                return [], []
            stop_refs = [r for r, fp in self._versions.items() if r not in desired or desired[r][0] != fp]
            draining: list[ActorProcess] = []
            for ref in stop_refs:
                del self._versions[ref]
                group = [a for a in self.actors if a.model == ref]
                self.actors = [a for a in self.actors if a.model != ref]
                draining += group
                msg = f"{ref} left the registry's active versions (or changed): draining " + \
                    (", ".join(a.name for a in group) or "nothing")
                log.info(msg)
                self._events.append(msg)
            self._draining += draining
            if draining:
                self._write_pids()
        if draining:
            for kind in STOP_ORDER:
                self._terminate([a for a in draining if a.kind == kind])
            with self._lock:
                gone = {id(a) for a in draining}
                self._draining = [a for a in self._draining if id(a) not in gone]
        started: list[str] = []
        with self._lock:
            if self._stopping:
                return started, stop_refs
            for ref, (fp, workers) in sorted(desired.items()):
                if ref in self._versions:
                    continue
                group = self._version_actors(ref, workers)
                for a in group:
                    a.dynamic = True
                    self.actors.append(a)
                    try:
                        self._spawn(a)
                    except OSError as e:
                        log.error("could not start %s: %s", a.name, e)
                self._versions[ref] = fp
                started.append(ref)
                msg = f"{ref} registered: started " + ", ".join(a.name for a in group)
                log.info(msg)
                self._events.append(msg)
            if started:
                self._write_pids()
        return started, stop_refs

    @property
    def running_versions(self) -> list[str]:
        """``name@version`` of every model version whose processes this supervisor runs, sorted."""
        with self._lock:
            return sorted(self._versions)

    # -- stop ------------------------------------------------------------------------------

    def _terminate(self, group: list[ActorProcess]) -> None:
        live = [a for a in group if a.proc is not None and a.proc.poll() is None]
        for a in live:
            try:
                os.killpg(a.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.stop_timeout_s
        for a in live:
            try:
                a.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %s) did not exit within %.0f s of SIGTERM; sending SIGKILL",
                            a.name, a.proc.pid, self.stop_timeout_s)
                try:
                    os.killpg(a.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    a.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                    log.error("%s (pid %s) survived SIGKILL", a.name, a.proc.pid)
        for a in group:
            if a.proc is not None:
                # Reap anything left in the actor's own group (it should be empty).
                try:
                    os.killpg(a.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self) -> None:
        """Stop the actors (gateways, validator, scheduler, workers — each kind SIGTERMed as a
        process group, SIGKILLed after ``stop_timeout_s``), then NATS and etcd. Idempotent."""
        self._stop_requested.set()
        with self._lock:
            self._stopping = True
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.stop_timeout_s + 15)
        with self._lock:
            group = self.actors + self._draining
            for kind in STOP_ORDER:
                self._terminate([a for a in group if a.kind == kind])
        if getattr(self, "_user_sync", None) is not None:
            self._user_sync.stop()
        if self.stack is not None:
            self.stack.stop()
        self._remove_own_pids()

    def _remove_own_pids(self) -> None:
        """Remove ``pids.json`` if this process wrote it: an ``up`` refused because another supervisor runs
        on the state dir must leave that one's file (the guard against a second ``up``, and ``status``)."""
        path = self.state_dir / PIDS_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(data, dict) and data.get("supervisor") == os.getpid():
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
