"""Health of the stack ``actorserve up`` runs: readiness (every gateway's ``GET /readyz``) before, and
after it the monitor that restarts dead actors and embedded servers within their restart budget.

The restart rule: an actor that exits with a status of :data:`control.ops.supervisor_processes.REQUESTED_STOP_STATUSES`
(0 after the drain a SIGTERM / SIGINT asked for, 143 / 130 after a second signal, -15 / -2 when the
signal came before its handler) was stopped on purpose — by the operator, since the supervisor
removes the processes it stops itself first — and is not restarted ("stopped by operator" in
``actorserve status`` and ``pids.json``); any other exit (1, SIGKILL, SIGSEGV, ...) is a crash and is
restarted within the budget. Embedded servers are always restarted.

:class:`HealthMonitor` is the supervisor's part that does this, over its
:class:`control.ops.supervisor_processes.ProcessTable`.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from control.ops.embedded_server import tail_file
from control.ops.stack_config import StackConfig
from control.ops.supervisor_processes import (ActorProcess, ProcessTable, SupervisorError, http_status,
                                              log_follower, probe_host, stopped_on_request, url_host)

log = logging.getLogger("actorserve.supervisor")


class RunningStack(Protocol):
    """What the health monitor reads of the running stack (``Supervisor`` implements it)."""

    stack: Any  # control.ops.embedded.EmbeddedStack once started (its ``etcd`` and ``nats`` servers), else None
    gateway_ports: list[int]  # port of gateway n


class HealthMonitor:
    """Readiness (:meth:`wait_ready`) and, after it, the restart monitor (:meth:`run`) of one stack; also
    :meth:`start_stopped` (SIGHUP of ``up``). ``ready`` is True once every gateway answered ready.
    ``stop_requested`` (set by the supervisor) ends the waits and the monitor."""

    def __init__(self, cfg: StackConfig, procs: ProcessTable, running: RunningStack,
                 stop_requested: threading.Event) -> None:
        self.cfg, self.procs, self.running, self.stop_requested = cfg, procs, running, stop_requested
        self.ready = False
        self.server_restarts: dict[str, collections.deque[float]] = {}  # embedded server -> restart times
        self.servers_given_up: set[str] = set()

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until every gateway's ``GET /readyz`` answers 200.

        Raises SupervisorError (with the tail of its log) if an actor exits meanwhile, if
        ``timeout`` seconds pass, or if ``stop_requested`` is set. Does not stop anything itself (the
        supervisor's ``stop`` does). Afterwards :meth:`run` restarts dead actors (when ``supervise``).
        """
        deadline = time.monotonic() + timeout
        echo = self._echo_source() if self.cfg.echo_worker_log else None
        pending = list(range(self.cfg.gateways))
        try:
            while True:
                if echo is not None:
                    echo()
                self._check_startup_deaths()
                pending = [n for n in pending if http_status(f"{self._probe_url(n)}/readyz") != 200]
                if not pending:
                    break
                if self.stop_requested.is_set():
                    raise SupervisorError("stop requested while waiting for readiness")
                if time.monotonic() >= deadline:
                    raise self._not_ready_error(pending, timeout)
                self.stop_requested.wait(0.25)
        finally:
            if echo is not None:
                echo(final=True)
        self.ready = True

    def _check_startup_deaths(self) -> None:
        """SupervisorError naming the first actor started with the stack that has exited already."""
        with self.procs.lock:
            for a in self.procs.actors:
                if not a.dynamic and a.proc is not None and a.proc.poll() is not None:
                    raise self._died_error(a)

    def _died_error(self, a: ActorProcess) -> SupervisorError:
        rc = a.proc.returncode if a.proc is not None else None
        return SupervisorError(
            f"{a.name} exited with status {rc} during startup; last lines of {a.log_path}:\n"
            f"{tail_file(a.log_path)}"
        )

    def _not_ready_error(self, pending: list[int], timeout: float) -> SupervisorError:
        names = ", ".join(f"gateway-{n}" for n in pending)
        tails = "\n".join(f"--- {a.name} ({a.log_path}):\n{tail_file(a.log_path, 1500)}" for a in self.procs.actors)
        return SupervisorError(f"{names} not ready within {timeout:.0f} s; actor logs:\n{tails}")

    def _probe_url(self, n: int) -> str:
        scheme = "https" if self.cfg.tls else "http"
        return f"{scheme}://{url_host(probe_host(self.cfg.host))}:{self.running.gateway_ports[n]}"

    def _echo_source(self) -> Callable[..., None] | None:
        """A function copying new bytes of worker-0's log to the echo stream (the progress bar)."""
        workers = [a for a in self.procs.actors if a.kind == "worker"]
        if not workers:
            return None
        return log_follower(workers[0].log_path, self.cfg.echo_stream or sys.stderr)

    # -- after readiness: restarts ---------------------------------------------------------------

    def run(self) -> None:
        """The monitor (a thread's target): every 0.5 s after readiness, :meth:`supervise_once`, until the
        stop."""
        while not self.stop_requested.wait(0.5):
            if not self.ready:
                continue  # before readiness a death is fatal (wait_ready reports it)
            # Embedded servers first (etcd, then NATS): actors need them. Outside the lock: a start
            # blocks up to the server's startup timeout.
            if not self.supervise_once():
                return

    def supervise_once(self) -> bool:
        """One round of the monitor: restart dead embedded servers, then dead actors (or keep them
        stopped, see the module's restart rule); rewrite ``pids.json`` on a change. False once
        :meth:`stop` began."""
        servers_changed = self.restart_servers()
        with self.procs.lock:
            if self.procs.stopping:
                return False
            changed = servers_changed
            for a in self.procs.actors:
                if a.given_up or a.stopped_by or a.proc is None or a.proc.poll() is None:
                    continue
                if stopped_on_request(a.proc.returncode):
                    changed |= self._keep_stopped(a)
                    continue
                changed |= self._restart(a)
            if changed:
                self.procs.write_pids()
        return True

    def restart_servers(self) -> bool:
        """Start an embedded server (etcd, nats-server) that died again, on the same ports with the same
        data directory (JetStream file store, etcd data), at most ``max_restarts`` per
        ``restart_window_s`` each. Returns True when one was restarted."""
        stack = self.running.stack
        if stack is None:
            return False
        changed = False
        for srv in (stack.etcd, stack.nats):
            if self.procs.stopping or srv.running or srv.pid is None or srv.name in self.servers_given_up:
                continue
            rc = srv.returncode
            history = self.server_restarts.setdefault(srv.name, collections.deque())
            if not self.procs.within_budget(srv.name, rc, history, srv.log_path):
                self.servers_given_up.add(srv.name)
                continue
            self.procs.event(f"{srv.name} exited with status {rc}; restarting on port {srv.port} (log: {srv.log_path})",
                        logging.WARNING)
            try:
                srv.start()
                changed = True
            except (RuntimeError, OSError) as e:  # retried on the next round, within the window's budget
                log.error("could not restart %s: %s", srv.name, str(e).splitlines()[0])
        return changed

    def _keep_stopped(self, a: ActorProcess) -> bool:
        """The restart rule's other half: ``a`` exited because it was asked to (SIGTERM / SIGINT from
        outside the supervisor, e.g. ``kill -TERM <pid>`` by the operator; a clean drain exits 0): it
        stays stopped, shown as "stopped by operator" by ``actorserve status``, until
        :meth:`start_stopped` (``kill -HUP`` of ``actorserve up``)."""
        a.stopped_by = "operator"
        self.procs.event(f"{a.name} exited with status {a.proc.returncode} after a stop it was asked for: not "
                    f"restarting it (stopped by operator; `kill -HUP {os.getpid()}` starts it again)")
        return True

    @property
    def stopped_by_operator(self) -> list[str]:
        """Names of the actors that exited after a stop they were asked for (e.g. ``kill -TERM`` of a
        worker) and that the supervisor therefore does not restart; see :meth:`start_stopped`."""
        with self.procs.lock:
            return [a.name for a in self.procs.actors if a.stopped_by == "operator" and not a.running]

    def start_stopped(self, names: Sequence[str] | None = None) -> list[str]:
        """Start again the actors stopped by the operator (all of them, or those in ``names``; not those
        the autoscaler scaled down); returns the names started. ``actorserve up`` calls this on SIGHUP.
        Raises OSError when a spawn fails."""
        started: list[str] = []
        with self.procs.lock:
            if self.procs.stopping:
                return started
            for a in self.procs.actors:
                if a.stopped_by == "operator" and not a.running and (names is None or a.name in names):
                    a.restarts.clear()
                    a.given_up = False
                    a.stopped_by = None
                    self.procs.spawn(a)
                    started.append(a.name)
                    self.procs.event(f"{a.name} started again on request (was stopped by the operator)")
            if started:
                self.procs.write_pids()
        return started

    def _restart(self, a: ActorProcess) -> bool:
        rc = a.proc.returncode if a.proc is not None else None
        if not self.procs.within_budget(a.name, rc, a.restarts, a.log_path):
            a.given_up = True
            return False
        self.procs.event(f"{a.name} exited with status {rc}; restarting (log: {a.log_path})", logging.WARNING)
        try:
            self.procs.spawn(a)
        except OSError as e:
            log.error("could not restart %s: %s", a.name, e)
            return False
        return True
