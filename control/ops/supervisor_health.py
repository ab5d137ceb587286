"""Health of the stack ``actorserve up`` runs: readiness (every gateway's ``GET /readyz``) before, and
after it the monitor that restarts dead actors and embedded servers within their restart budget.

The restart rule: an actor that exits with a status of :data:`control.ops.supervisor_processes.REQUESTED_STOP_STATUSES`
(0 after the drain a SIGTERM / SIGINT asked for, 143 / 130 after a second signal, -15 / -2 when the
signal came before its handler) was stopped on purpose — by the operator, since the supervisor
removes the processes it stops itself first — and is not restarted ("stopped by operator" in
``actorserve status`` and ``pids.json``); any other exit (1, SIGKILL, SIGSEGV, ...) is a crash and is
restarted within the budget. Embedded servers are always restarted.

:class:`HealthMixin` is part of :class:`control.ops.supervisor.Supervisor`.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Callable

from control.ops.embedded_server import tail_file
from control.ops.supervisor_processes import (ActorProcess, SupervisorError, http_status, log_follower,
                                              probe_host, restart_allowed, stopped_on_request, url_host)

log = logging.getLogger("actorserve.supervisor")


class HealthMixin:
    """:meth:`wait_ready` and the restart monitor of :class:`control.ops.supervisor.Supervisor`.

    Uses the supervisor's ``_lock``, ``_stopping``, ``_stop_requested``, ``_ready``, ``actors``,
    ``stack``, ``host``, ``gateways``, ``gateway_ports``, ``echo_worker_log``, ``echo_stream``,
    ``max_restarts``, ``restart_window_s``, ``_server_restarts``, ``_servers_given_up`` and its
    ``_spawn``, ``_write_pids``, ``_event``. Also :meth:`start_stopped` (SIGHUP of ``up``).
    """

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
                self._check_startup_deaths()
                pending = [n for n in pending if http_status(f"{self._probe_url(n)}/readyz") != 200]
                if not pending:
                    break
                if self._stop_requested.is_set():
                    raise SupervisorError("stop requested while waiting for readiness")
                if time.monotonic() >= deadline:
                    raise self._not_ready_error(pending, timeout)
                self._stop_requested.wait(0.25)
        finally:
            if echo is not None:
                echo(final=True)
        self._ready = True

    def _check_startup_deaths(self) -> None:
        """SupervisorError naming the first actor started with the stack that has exited already."""
        with self._lock:
            for a in self.actors:
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
        tails = "\n".join(f"--- {a.name} ({a.log_path}):\n{tail_file(a.log_path, 1500)}" for a in self.actors)
        return SupervisorError(f"{names} not ready within {timeout:.0f} s; actor logs:\n{tails}")

    def _probe_url(self, n: int) -> str:
        return f"{'https' if getattr(self, 'tls', False) else 'http'}://{url_host(probe_host(self.host))}:{self.gateway_ports[n]}"

    def _echo_source(self) -> Callable[..., None] | None:
        """A function copying new bytes of worker-0's log to the echo stream (the progress bar)."""
        workers = [a for a in self.actors if a.kind == "worker"]
        if not workers:
            return None
        return log_follower(workers[0].log_path, self.echo_stream or sys.stderr)

    # -- after readiness: restarts ---------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while not self._stop_requested.wait(0.5):
            if not self._ready:
                continue  # before readiness a death is fatal (wait_ready reports it)
            # Embedded servers first (etcd, then NATS): actors need them. Outside the lock: a start
            # blocks up to the server's startup timeout.
            if not self._supervise_once():
                return

    def _supervise_once(self) -> bool:
        """One round of the monitor: restart dead embedded servers, then dead actors (or keep them
        stopped, see the module's restart rule); rewrite ``pids.json`` on a change. False once
        :meth:`stop` began."""
        servers_changed = self._restart_servers()
        with self._lock:
            if self._stopping:
                return False
            changed = servers_changed
            for a in self.actors:
                if a.given_up or a.stopped_by or a.proc is None or a.proc.poll() is None:
                    continue
                if stopped_on_request(a.proc.returncode):
                    changed |= self._keep_stopped(a)
                    continue
                changed |= self._restart(a)
            if changed:
                self._write_pids()
        return True

    def _within_budget(self, name: str, rc: Any, history: collections.deque[float], log_path: Any) -> bool:
        """Spend one restart of ``name`` from its budget; False (logged, kept in events) once spent."""
        if restart_allowed(history, time.monotonic(), self.restart_window_s, self.max_restarts):
            return True
        self._event(f"{name} exited with status {rc}; restarted {len(history)} times in the last "
                    f"{self.restart_window_s:.0f} s: giving up on it (log: {log_path})", logging.ERROR)
        return False

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
            if not self._within_budget(srv.name, rc, history, srv.log_path):
                self._servers_given_up.add(srv.name)
                continue
            self._event(f"{srv.name} exited with status {rc}; restarting on port {srv.port} (log: {srv.log_path})",
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
        self._event(f"{a.name} exited with status {a.proc.returncode} after a stop it was asked for: not "
                    f"restarting it (stopped by operator; `kill -HUP {os.getpid()}` starts it again)")
        return True

    @property
    def stopped_by_operator(self) -> list[str]:
        """Names of the actors that exited after a stop they were asked for (e.g. ``kill -TERM`` of a
        worker) and that the supervisor therefore does not restart; see :meth:`start_stopped`."""
        with self._lock:
            return [a.name for a in self.actors if a.stopped_by == "operator" and not a.running]

    def start_stopped(self, names: Sequence[str] | None = None) -> list[str]:
        """Start again the actors stopped by the operator (all of them, or those in ``names``; not those
        the autoscaler scaled down); returns the names started. ``actorserve up`` calls this on SIGHUP.
        Raises OSError when a spawn fails."""
        started: list[str] = []
        with self._lock:
            if self._stopping:
                return started
            for a in self.actors:
                if a.stopped_by == "operator" and not a.running and (names is None or a.name in names):
                    a.restarts.clear()
                    a.given_up = False
                    a.stopped_by = None
                    self._spawn(a)
                    started.append(a.name)
                    self._event(f"{a.name} started again on request (was stopped by the operator)")
            if started:
                self._write_pids()
        return started

    def _restart(self, a: ActorProcess) -> bool:
        rc = a.proc.returncode if a.proc is not None else None
        if not self._within_budget(a.name, rc, a.restarts, a.log_path):
            a.given_up = True
            return False
        self._event(f"{a.name} exited with status {rc}; restarting (log: {a.log_path})", logging.WARNING)
        try:
            self._spawn(a)
        except OSError as e:
            log.error("could not restart %s: %s", a.name, e)
            return False
        return True
