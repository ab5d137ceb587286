"""Children that do not outlive their parent: every process ``actorserve up`` (or a test fixture) starts —
actors, nats-server, etcd — stops when that parent dies, even by SIGKILL.

Two mechanisms, both Linux:

* :func:`popen` starts the child with ``PR_SET_PDEATHSIG`` (``prctl(2)`` through ctypes, set by a
  small exec wrapper in the child, see ``_WRAPPER``): the kernel sends the child ``SIGTERM`` when its parent dies. The kernel means the
  parent *thread*: a child forked by a thread that later exits (an ``asyncio.to_thread`` worker, the
  supervisor's monitor) would be signalled then. So every fork goes through one spawner thread that
  lives as long as the process (:class:`_Spawner`); the caller's thread does not matter. Right after
  ``prctl`` the child checks that its parent is still the one that forked it (the parent may have died
  in between) and signals itself if not.
* Python actors also watch their parent (``ACTORSERVE_PARENT_PID``, set by
  control/ops/supervisor_processes.py ``spawn``): actors/runtime.py polls it and drains as after a
  SIGTERM when the parent is gone. This covers platforms without ``prctl``.

nats-server and etcd shut down on SIGTERM; actors drain (bounded by their drain timeouts) and exit.
:func:`live_stack` is the check ``up`` makes before starting: a stack left behind on the same state
directory (its pids alive, or the ports of its ``endpoints.json`` answering).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

log = logging.getLogger("actorserve.lifeline")

from actors.runtime import ENV_PARENT_PID  # noqa: E402,F401 (re-exported: set by supervisor_processes.spawn)

_PR_SET_PDEATHSIG = 1
SPAWN_TIMEOUT_S = 30.0  # bound on one fork + exec through the spawner thread


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.prctl
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        return None


_PRCTL = _load_prctl()

# The child sets its own death signal in a tiny exec wrapper (a fresh interpreter that imports nothing of
# ours and no gRPC), then execs the real program: PR_SET_PDEATHSIG survives execve(2). A preexec_fn
# instead would make subprocess fork() the supervisor, whose live gRPC threads (aetcd) then crashed about
# 1 child in 25 at birth (SIGABRT/SIGSEGV, "epoll_wait error: Bad file descriptor"); without a
# preexec_fn subprocess uses vfork/posix_spawn, which runs no fork handlers. argv: signal, parent pid,
# program, args. Right after prctl it checks that its parent is still the one that started it (the
# parent may have died in between) and signals itself if not.
_WRAPPER = (
    "import ctypes,os,sys\n"
    "sig,ppid=int(sys.argv[1]),int(sys.argv[2])\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,sig,0,0,0)\n"
    "os.getppid()==ppid or os.kill(os.getpid(),sig)\n"
    "os.execvp(sys.argv[3],sys.argv[3:])\n")


def _wrapped(argv: list[str], sig: int, parent_pid: int, env: dict | None) -> list[str]:
    """``argv`` behind the death-signal exec wrapper. Raises FileNotFoundError at once when the program
    cannot be found (as Popen would), since the wrapper's own exec failure would only show as exit 1."""
    prog = argv[0]
    path = (env or os.environ).get("PATH", os.defpath)
    if shutil.which(prog, path=path) is None and not (os.sep in prog and os.access(prog, os.X_OK)):
        raise FileNotFoundError(2, "No such file or directory", prog)
    return [sys.executable, "-I", "-S", "-c", _WRAPPER, str(sig), str(parent_pid), *argv]


class _Spawner:
    """One daemon thread, alive until the process exits, that runs every :func:`popen` (the parent
    thread ``PR_SET_PDEATHSIG`` watches)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="actorserve-spawner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, fut = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future[Any] = Future()
        self._q.put((fn, fut))
        return fut.result(timeout=timeout)


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _get_spawner() -> _Spawner:
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner._thread.is_alive():
            _spawner = _Spawner()
        return _spawner


def popen(argv: list[str], *, death_signal: int = signal.SIGTERM, **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` whose child gets ``death_signal`` when this process dies
    (Linux ``PR_SET_PDEATHSIG``; elsewhere a plain Popen). Forks from the long-lived spawner thread.
    Raises what Popen raises (OSError, ...); TimeoutError if the spawner does not answer within
    ``SPAWN_TIMEOUT_S`` seconds."""
    if _PRCTL is None:
        return subprocess.Popen(argv, **kwargs)
    if "preexec_fn" in kwargs:
        raise ValueError("popen must not take a preexec_fn (it would fork a process with live gRPC threads)")
    wrapped = _wrapped(list(argv), int(death_signal), os.getpid(), kwargs.get("env"))
    return _get_spawner().call(lambda: subprocess.Popen(wrapped, **kwargs), SPAWN_TIMEOUT_S)


# -- a stack left behind --------------------------------------------------------------------------


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return None


def _ours(pid: int, state_dir: Path) -> bool:
    """True when process ``pid`` is alive and (where /proc exists) its argv names ``state_dir`` (every
    actor gets ``--state-dir``, nats-server and etcd their data directories under it): a reused pid
    of some other program does not count."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    try:
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    if not Path("/proc").is_dir():  # pragma: no cover - not Linux
        return True
    cmd = _cmdline(pid)
    return cmd is not None and str(state_dir) in cmd


def _port_answers(url: str, timeout: float = 0.3) -> bool:
    import socket

    try:
        u = urlparse(url)
        host, port = u.hostname, u.port
    except ValueError:
        return False
    if not host or not port:
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def live_stack(state_dir: str | os.PathLike[str], own_pid: int | None = None) -> str | None:
    """A one-line description of a stack still running on ``state_dir`` (another supervisor, or actors /
    servers whose supervisor died, named by ``pids.json``; or ``endpoints.json`` URLs that still accept
    connections), with the command that stops it; None when there is none. Only a ``pids.json`` left
    behind (an ``up`` that did not stop cleanly) is looked into: a clean stop removes it, and the ports of
    its ``endpoints.json`` may belong to anything since. ``own_pid``: this process (never reported)."""
    state = Path(state_dir).resolve()
    own = os.getpid() if own_pid is None else own_pid
    try:
        pids = json.loads((state / "pids.json").read_text())
    except FileNotFoundError:  # the last `up` stopped cleanly (it removes pids.json): nothing left behind
        return None
    except (OSError, ValueError):
        pids = {}
    if not isinstance(pids, dict):
        pids = {}
    live: dict[str, int] = {}
    for name, pid in pids.items():
        if not isinstance(pid, int) or pid == own or pid <= 1:
            continue
        if name == "supervisor":
            try:
                os.kill(pid, 0)
                live[name] = pid
            except (ProcessLookupError, PermissionError):
                pass
        elif _ours(pid, state):
            live[name] = pid
    if live:
        sup = live.get("supervisor")
        names = ", ".join(f"{n} {p}" for n, p in live.items())
        if sup is not None:
            how = f"stop it with `kill -TERM {sup}` (its `actorserve up`)"
        else:
            how = "its `actorserve up` is gone; stop them with `kill -TERM " + " ".join(
                f"-- -{p}" if i == 0 else f"-{p}" for i, p in enumerate(live.values())) + "`"
        return f"a stack is still running on state dir {state} (pids: {names}); {how}"
    try:
        eps = json.loads((state / "endpoints.json").read_text())
    except (OSError, ValueError):
        eps = {}
    if isinstance(eps, dict):
        from bus.nats_auth import redact_url

        answering = [f"{k} {redact_url(eps[k])}" for k in ("nats_url", "etcd_url", "http_url")
                     if isinstance(eps.get(k), str) and _port_answers(eps[k])]
        if answering:
            shown = ", ".join(answering)
            return (f"the endpoints in {state / 'endpoints.json'} still answer ({shown}): a stack from an earlier "
                    f"`actorserve up` seems to be running; stop it (see `actorserve status --state-dir {state}` "
                    f"for its pids), or delete {state / 'pids.json'} if those ports are not the stack's")
    return None
