"""OS processes of ``actorserve up``: one supervised actor process, spawning it in its own process group,
stopping a group of them in waves, the restart budget, ``pids.json``, and :class:`ProcessTable`, the
supervisor's table of its actor processes (the lock, spawning, the restart budget, the pid file, the
events); plus the small probes the CLI's ``status`` uses.

Used by control/ops/supervisor.py (:class:`control.ops.supervisor.Supervisor` and its reconcilers) and
control/ops/cli.py. Only the process groups this code started are ever signalled, never anything found by
name.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from actors import lifeline

log = logging.getLogger("actorserve.supervisor")

PIDS_FILE = "pids.json"


class SupervisorError(RuntimeError):
    """The stack could not be started (an actor died during startup, readiness timed out, ...)."""


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """HTTP status of ``GET url`` (loopback), or None if the server does not answer."""
    try:
        from control.ops.tls_stack import probe_context  # https (`up --tls`): verified against the stack's CA
        with urllib.request.urlopen(url, timeout=timeout, context=probe_context(url)) as resp:  # noqa: S310
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True while a process ``pid`` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def probe_host(host: str) -> str:
    """Address to probe a server bound on ``host`` (wildcards are probed on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def url_host(host: str) -> str:
    """``host`` as written in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def restart_allowed(history: collections.deque[float], now: float, window_s: float, max_restarts: int) -> bool:
    """The restart budget: forget restarts older than ``window_s`` seconds, then, when fewer than
    ``max_restarts`` remain, record ``now`` and return True (False: the budget is spent)."""
    while history and now - history[0] > window_s:
        history.popleft()
    if len(history) >= max_restarts:
        return False
    history.append(now)
    return True


@dataclass
class ActorProcess:
    """One supervised actor process: its identity, argv, log file and restart history."""

    name: str  # e.g. "gateway-0"
    kind: str  # gateway | validator | scheduler | worker | jobs | rollout
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: collections.deque[float] = field(default_factory=collections.deque)
    given_up: bool = False
    model: str | None = None  # "name@version" for schedulers and workers
    dynamic: bool = False  # started by the registry watch (its death is not fatal during wait_ready)
    stopped_by: str | None = None  # "operator": exited after a stop it was asked for; "autoscaler": scaled
    # down (SIGTERMed by the supervisor to carry out a desired count); neither is restarted
    pool: str | None = None  # workers: the accelerator pool it was started for (its --pool)
    spawned_at: float | None = None  # epoch s of the current process's start
    ready_at: float | None = None  # epoch s it was first seen ready (control/ops/supervisor_scaling.py)
    term_sent_at: float | None = None  # epoch s of the SIGTERM of a scale-down (None: not leaving)
    sleeping_since: float | None = None  # workers: epoch s a scale-down put it to sleep (None: awake)

    @property
    def pid(self) -> int | None:
        """Pid (== process group id) of the current process, or None before the first start."""
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        """True while the current process has not exited."""
        return self.proc is not None and self.proc.poll() is None


def spawn(a: ActorProcess, cwd: Path, env: Mapping[str, str]) -> None:
    """Start ``a.argv`` as the leader of a new process group, stdout and stderr appended to ``a.log_path``
    (after a ``=== <time> starting: <argv>`` line); sets ``a.proc``. Raises OSError when it cannot."""
    with open(a.log_path, "ab") as logf:
        logf.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {shlex.join(a.argv)}\n".encode())
        logf.flush()
        # SIGTERM (drain) when this process dies, even by SIGKILL (actors/lifeline.py); the actor also
        # watches ACTORSERVE_PARENT_PID.
        a.proc = lifeline.popen(a.argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                cwd=str(cwd), env={**env, lifeline.ENV_PARENT_PID: str(os.getpid())},
                                start_new_session=True, close_fds=True)
    a.stopped_by = None
    a.spawned_at, a.ready_at, a.term_sent_at = time.time(), None, None
    log.info("started %s (pid %s)", a.name, a.proc.pid)


def _killpg(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_actor(a: ActorProcess, sig: signal.Signals) -> None:
    """Send ``sig`` to ``a``'s process group (nothing when it has no process; a gone group is ignored)."""
    if a.proc is not None:
        _killpg(a.proc.pid, sig)


# Seconds between two stop waves when the earlier one has not exited yet (its processes keep draining).
WAVE_GAP_S = 1.0


def terminate(group: list[ActorProcess], timeout_s: float, waves: Sequence[Sequence[str]] = (),
              gap_s: float = WAVE_GAP_S) -> None:
    """Stop ``group``'s live processes in waves sharing one deadline, so that stopping takes at most
    ``timeout_s`` seconds however many processes run.

    ``waves`` lists actor kinds per wave (a kind in none of them joins the last wave; no waves: one
    wave). Every process of a wave gets SIGTERM (its process group) at once; the next wave follows
    when the earlier ones have exited or ``gap_s`` seconds later, whichever comes first (earlier waves
    keep draining meanwhile). A process already draining after a scale-down's SIGTERM
    (``term_sent_at`` set) is not signalled again (a second SIGTERM would cut its drain short), only
    waited for. Whatever still runs ``timeout_s`` seconds after the first SIGTERM gets SIGKILL; then
    whatever is left in each process group is SIGKILLed."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    buckets: list[list[ActorProcess]] = [[] for _ in range(max(1, len(waves)))]
    for a in group:
        idx = next((i for i, kinds in enumerate(waves) if a.kind in kinds), len(buckets) - 1)
        buckets[idx].append(a)
    signalled: list[ActorProcess] = []
    for i, wave in enumerate(buckets):
        live = [a for a in wave if a.proc is not None and a.proc.poll() is None]
        for a in live:
            if a.term_sent_at is None:
                _killpg(a.proc.pid, signal.SIGTERM)
        signalled += live
        if i < len(buckets) - 1 and live:
            next_at = min(deadline, time.monotonic() + gap_s)
            while time.monotonic() < next_at and any(a.proc.poll() is None for a in signalled):
                time.sleep(0.05)
    for a in signalled:
        try:
            a.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %s) did not exit within %.0f s of the stop; sending SIGKILL",
                        a.name, a.proc.pid, timeout_s)
            _killpg(a.proc.pid, signal.SIGKILL)
            try:
                a.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                log.error("%s (pid %s) survived SIGKILL", a.name, a.proc.pid)
    for a in group:
        if a.proc is not None:  # reap anything left in the actor's own group (it should be empty)
            _killpg(a.proc.pid, signal.SIGKILL)
    if signalled:
        log.info("stopped %d process(es) in %.1f s", len(signalled), time.monotonic() - t0)


# Stop order: the rollout controller and the autoscaler first (no decisions while the stack goes away),
# then the edges (no new traffic), then the pipeline front to back.
STOP_ORDER = ("rollout", "autoscaler", "gateway", "jobs", "validator", "scheduler", "worker")
# The same order as waves: every process of a wave is SIGTERMed at once, the next wave follows when the
# earlier ones exited or a short gap later (``terminate``), all within one deadline. Edges first (no new
# work enters; gateways keep waiting for their streams), then the validator and the schedulers (the queue
# is still dispatched to running workers for a moment), then the workers (they finish what they run within
# their drain timeout).
STOP_WAVES = (("rollout", "autoscaler", "gateway", "jobs"), ("validator", "scheduler"), ("worker",))


def stop_rank(a: ActorProcess) -> int:
    """Position of ``a``'s kind in STOP_ORDER (unknown kinds last): sort key of a group to stop."""
    return STOP_ORDER.index(a.kind) if a.kind in STOP_ORDER else len(STOP_ORDER)


# Exit statuses of an actor that stopped because it was asked to (SIGTERM / SIGINT: a clean drain
# exits 0; a second signal during the drain 143 / 130; killed by the signal before its handler was
# installed -15 / -2). The supervisor does not restart such an actor (supervisor_health.py).
REQUESTED_STOP_STATUSES = frozenset({0, 128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT})


def stopped_on_request(returncode: int | None) -> bool:
    """True when ``returncode`` (``Popen.returncode``) is that of an actor that stopped because it was
    asked to (:data:`REQUESTED_STOP_STATUSES`); False for a crash (1, a fatal signal such as SIGKILL or
    SIGSEGV) or a process still running (None)."""
    return returncode is not None and returncode in REQUESTED_STOP_STATUSES


# -- pids.json ------------------------------------------------------------------------------------


def read_pids(state_dir: Path) -> dict[str, Any] | None:
    """``<state_dir>/pids.json`` as a dict, or None when it is missing or not a JSON object."""
    try:
        data = json.loads((state_dir / PIDS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_pids(state_dir: Path, pids: Mapping[str, int], stopped: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Atomically write ``pids.json``: ``{"supervisor": <this pid>, **pids}`` plus, when any, ``"stopped":
    {name: {"by": "operator" | "autoscaler", "status": exit status}}`` of actors that stay stopped (a
    scaled-down one still draining: ``"status": None, "draining": True``; a failure is logged)."""
    path = state_dir / PIDS_FILE
    tmp = path.with_name(f".{PIDS_FILE}.{os.getpid()}.tmp")
    data: dict[str, Any] = {"supervisor": os.getpid(), **pids}
    if stopped:
        data["stopped"] = {k: dict(v) for k, v in stopped.items()}
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # pragma: no cover - state dir removed under us
        log.warning("could not write %s: %s", path, e)


def other_supervisor(state_dir: Path) -> int | None:
    """Pid of another live supervisor named by ``pids.json``, else None."""
    pid = (read_pids(state_dir) or {}).get("supervisor")
    return pid if isinstance(pid, int) and pid != os.getpid() and pid_alive(pid) else None


def remove_own_pids(state_dir: Path) -> None:
    """Remove ``pids.json`` if this process wrote it: an ``up`` refused because another supervisor runs
    on the state dir must leave that one's file (the guard against a second ``up``, and ``status``)."""
    if (read_pids(state_dir) or {}).get("supervisor") == os.getpid():
        (state_dir / PIDS_FILE).unlink(missing_ok=True)


# -- a log followed on a terminal -----------------------------------------------------------------


def _run_start(path: Path) -> int:
    """Offset in ``path`` just after the last ``=== ... starting`` header line (the end if none)."""
    try:
        text = path.read_bytes()
    except OSError:
        return 0
    idx = text.rfind(b"\n=== ")
    nl = text.find(b"\n", idx + 1) if idx >= 0 else -1
    return nl + 1 if nl >= 0 else len(text)


def log_follower(path: Path, stream: TextIO) -> Callable[..., None]:
    """A function copying the bytes appended to ``path`` since the current run's header to ``stream``
    (its binary buffer when it has one, so a progress bar's carriage returns pass); ``final=True``
    ends an unfinished line."""
    out = getattr(stream, "buffer", None)
    state = {"offset": _run_start(path)}

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


# -- the supervisor's table of processes ------------------------------------------------------------


class ProcessTable:
    """The actor processes of one supervisor and what every change to them shares: ``lock`` (an RLock held
    by every reader and writer of the table, from the monitor, the registry watch and the caller's
    thread), ``actors`` (running, or kept stopped), ``draining`` (taken out of ``actors``, being stopped),
    ``stopping`` (set once a stop began: nothing starts after it), spawning (``spawn``: each kind's
    environment from ``env_of``), stopping (``terminate``: STOP_WAVES within ``stop_timeout_s`` s), the
    restart budget (``within_budget``), ``pids.json`` (``write_pids``; the embedded servers' pids from
    ``servers``) and the human-readable ``events``.
    """

    def __init__(self, state_dir: Path, env_of: Callable[[str | None], Mapping[str, str]],
                 servers: Callable[[], Iterable[Any]], stop_timeout_s: float = 15.0, max_restarts: int = 5,
                 restart_window_s: float = 60.0) -> None:
        self.state_dir, self.env_of, self.servers = state_dir, env_of, servers
        self.stop_timeout_s, self.max_restarts, self.restart_window_s = stop_timeout_s, max_restarts, restart_window_s
        self.lock = threading.RLock()
        self.actors: list[ActorProcess] = []
        self.draining: list[ActorProcess] = []
        self.stopping = False
        self.events: list[str] = []

    def event(self, msg: str, level: int = logging.INFO) -> None:
        """Log ``msg`` and keep it in ``events``."""
        log.log(level, msg)
        self.events.append(msg)

    def actor(self, name: str) -> ActorProcess:
        """The ActorProcess called ``name`` (e.g. ``"worker-0"``); KeyError if unknown."""
        for a in self.actors:
            if a.name == name:
                return a
        raise KeyError(name)

    def spawn(self, a: ActorProcess) -> None:
        """Start ``a`` (module ``spawn``) in the state directory with its kind's environment; OSError when
        it cannot."""
        spawn(a, self.state_dir, self.env_of(a.kind))

    def terminate(self, group: list[ActorProcess]) -> None:
        """Stop ``group`` in the waves of STOP_WAVES (every wave concurrent, one ``stop_timeout_s`` deadline)."""
        terminate(group, self.stop_timeout_s, STOP_WAVES)

    def pids(self) -> dict[str, int]:
        """``{"nats": pid, "etcd": pid, "gateway-0": pid, ...}`` of the live processes."""
        out: dict[str, int] = {}
        for srv in self.servers():
            if srv.running and srv.pid is not None:
                out[srv.name] = srv.pid
        with self.lock:
            for a in self.actors:
                if a.running and a.pid is not None:
                    out[a.name] = a.pid
        return out

    def write_pids(self) -> None:
        """Rewrite ``pids.json``: the live processes, and those kept stopped (module ``write_pids``)."""
        with self.lock:
            stopped = {a.name: {"by": a.stopped_by, "status": a.proc.returncode if a.proc is not None else None}
                       for a in self.actors if a.stopped_by and not a.running}
            stopped.update({a.name: {"by": a.stopped_by, "status": None, "draining": True} for a in self.actors
                            if a.stopped_by and a.running})  # scaled down, still draining
        write_pids(self.state_dir, self.pids(), stopped)

    def within_budget(self, name: str, rc: Any, history: collections.deque[float], log_path: Any) -> bool:
        """Spend one restart of ``name`` (exit status ``rc``) from its budget ``history`` (restart times,
        monotonic s); False, logged and kept in ``events``, once spent."""
        if restart_allowed(history, time.monotonic(), self.restart_window_s, self.max_restarts):
            return True
        self.event(f"{name} exited with status {rc}; restarted {len(history)} times in the last "
                   f"{self.restart_window_s:.0f} s: giving up on it (log: {log_path})", logging.ERROR)
        return False
