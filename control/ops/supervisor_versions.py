"""Model versions come and go live under ``actorserve up``: the registry watch of
:class:`control.ops.supervisor.Supervisor` and its reconciliation of the running schedulers and workers
with the registry's active versions.

:func:`desired_versions` is the rule (which versions should run, with how many workers);
:class:`VersionReconciler` applies it to the supervisor's processes and runs the registry watch, whose
every round also hands the desired replica counts to the scaling reconciler (supervisor_scaling.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from control.ops.deploy import manifest_fingerprint, version_worker_count
from control.ops.stack_config import StackConfig
from control.ops.supervisor_processes import (STOP_ORDER, STOP_WAVES, ActorProcess,  # noqa: F401 (re-exported)
                                              ProcessTable, stop_rank)

log = logging.getLogger("actorserve.supervisor")

Models = Mapping[str, Mapping[str, Mapping[str, Any]]]  # {name: {version: manifest}}


def desired_versions(models: Models, default_workers: int, reported: set[str]) -> dict[str, tuple[str, int]]:
    """``{"name@version": (manifest fingerprint, worker count)}`` of every valid active version in
    ``models`` (a manifest's ``status`` defaults to active; its extra key ``workers`` overrides
    ``default_workers``). An invalid active manifest is skipped and logged once: ``reported`` holds the
    refs already logged (updated; a ref that became valid again is forgotten)."""
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
                if ref not in reported:
                    log.error("not starting %s: invalid manifest: %s", ref, e)
                    reported.add(ref)
                continue
            reported.discard(ref)
            desired[ref] = (manifest_fingerprint(manifest), version_worker_count(manifest, default_workers))
    return desired


class VersionActors(Protocol):
    """How the reconciler gets a version's processes (``ActorFactory`` implements it)."""

    def version_actors(self, ref: str, workers: int) -> list[ActorProcess]:
        """The scheduler and ``workers`` workers of version ``ref`` (not started)."""


class RegistrySide(Protocol):
    """What the registry watch reads of the running stack (``Supervisor`` implements it)."""

    stack: Any  # control.ops.embedded.EmbeddedStack once started (its ``etcd_url``)
    dev_api_key: str | None  # key of tenant "dev" once set up: new model names are allowed for it


class ScalingRound(Protocol):
    """What each round of the watch hands the desired counts to (``ScalingReconciler`` implements it)."""

    def wants_ready_records(self) -> bool:
        """True while a replica has not been seen ready (the watch then reads the readiness records)."""

    def round(self, desired_records: Mapping[str, Any], ready_records: Mapping[str, Any] | None,
              now: float | None = None, notices: Mapping[str, Any] | None = None) -> bool:
        """Carry out one round of desired counts; True when anything changed."""

    def take_commands(self) -> list[tuple[str, dict]]:
        """The sleep / wake commands of the rounds since the last call ((etcd key, value), oldest first)."""

    def observe_sleep(self, records: Mapping[str, Any]) -> None:
        """The sleep records read from etcd after a round (a scheduler may have woken a sleeper)."""


class VersionReconciler:
    """The registry watch (:meth:`watch`) and :meth:`reconcile` of one supervisor: ``running`` maps each
    model version whose processes run (``name@version``) to its manifest's fingerprint."""

    def __init__(self, cfg: StackConfig, procs: ProcessTable, actors: VersionActors, side: RegistrySide,
                 stop_requested: threading.Event) -> None:
        self.cfg, self.procs, self.actors, self.side, self.stop_requested = cfg, procs, actors, side, stop_requested
        self.running: dict[str, str] = {}  # "name@version" running -> fingerprint of its manifest
        self.bad_manifests: set[str] = set()  # invalid active versions already reported

    def adopt(self, ref: str, fingerprint: str) -> None:
        """Count version ``ref`` (manifest ``fingerprint``), started by the supervisor itself, as running."""
        with self.procs.lock:
            self.running[ref] = fingerprint

    def watch(self, scaling: ScalingRound) -> None:
        """The registry watch (a thread's target; its own event loop) until the stop; ``scaling`` carries
        out the desired counts each round. Errors are logged, never raised."""
        try:
            asyncio.run(self._watch_registry(scaling))
        except Exception:  # pragma: no cover - logged, the rest of the stack keeps running
            log.exception("registry watch stopped")

    async def _watch_registry(self, scaling: ScalingRound) -> None:
        """Poll the registry every ``registry_poll_s`` s (one connection, reopened after errors) and
        reconcile the running model versions with it, then the replica counts with the desired prefix
        (control/ops/supervisor_scaling.py; readiness read from the workers' and the metrics records
        while a replica is not ready yet), until :meth:`stop`. A watch of the desired prefix on the same
        connection starts the next round at once when a count is written (no poll delay)."""
        from control.state.registry import Registry

        reg = None
        wake, waker = asyncio.Event(), None
        allowed: set[str] | None = None  # model names the dev tenant was given (start() did the first)
        warned = False
        try:
            while not self.stop_requested.is_set():
                try:
                    if reg is None:
                        reg = await Registry.open(self.side.stack.etcd_url, timeout=3.0)
                        waker = asyncio.ensure_future(self._wake_on_desired(reg, wake))
                    models = await reg.list_models()
                    desired, ready, notices = await self._read_scaling(reg, scaling.wants_ready_records())
                    warned = False
                except Exception as e:
                    if not warned and not self.stop_requested.is_set():
                        log.warning("registry watch: cannot read the registry (%r); retrying", e)
                        warned = True
                    if reg is not None:
                        waker = await _cancelled(waker)
                        await reg.close()
                        reg = None
                    await asyncio.sleep(self.cfg.registry_poll_s)
                    continue
                allowed = await self._allow_new_models(reg, models, allowed)
                # Spawning is quick; draining may wait up to stop_timeout_s: keep it off the loop.
                await asyncio.to_thread(self.reconcile, models)
                await asyncio.to_thread(scaling.round, desired, ready, None, notices)
                await self._carry_sleep(reg, scaling)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.cfg.registry_poll_s)
                wake.clear()
        finally:
            await _cancelled(waker)
            if reg is not None:
                await reg.close()

    async def _carry_sleep(self, reg: Any, scaling: ScalingRound) -> None:
        """Write the round's sleep / wake commands (control/ops/supervisor_sleep.py) and hand the sleep records
        back (a scheduler may have woken a sleeper). An etcd error is logged; the commands of a failed write are
        lost and the next round decides again."""
        from control.state.names import sleep_prefix

        try:
            for key, value in scaling.take_commands():
                await reg.put_json(key, value)
            scaling.observe_sleep(await reg.get_prefix_json(sleep_prefix()))
        except Exception as e:  # noqa: BLE001 - the watch goes on; the worker keeps its state until the next command
            log.warning("registry watch: sleep commands not written (%r)", e)

    async def _wake_on_desired(self, reg: Any, wake: asyncio.Event) -> None:
        """Set ``wake`` on every change under ``desired_prefix()`` (until cancelled; the poll goes on if the
        watch fails)."""
        from control.state.names import desired_prefix

        try:
            async for _ in reg.watch_prefix(desired_prefix()):
                wake.set()
        except Exception as e:  # the 0.5 s poll still carries the counts out
            log.debug("registry watch: the desired-count watch ended (%r)", e)

    async def _read_scaling(self, reg: Any, with_ready: bool) -> tuple[dict[str, Any], dict[str, Any] | None,
                                                                        dict[str, Any]]:
        """The records under ``desired_prefix()``, (only ``with_ready``: while a replica is not seen ready
        yet) those under the workers' and the metrics prefixes (else None), and the preemption notices."""
        from control.state.names import all_metrics_prefix, all_workers_prefix, desired_prefix, notices_prefix

        desired = await reg.get_prefix_json(desired_prefix())
        notices = await reg.get_prefix_json(notices_prefix())
        if not with_ready:
            return desired, None, notices
        ready = await reg.get_prefix_json(all_workers_prefix())
        ready.update(await reg.get_prefix_json(all_metrics_prefix()))
        return desired, ready, notices

    async def _allow_new_models(self, reg: Any, models: Models, allowed: set[str] | None) -> set[str]:
        """Add model names that appeared since the last round to the dev tenant; returns the names allowed."""
        if allowed is None:
            return set(models)
        new_names = set(models) - allowed
        if new_names and self.side.dev_api_key:
            try:
                from control.state.tenants import TenantAdmin

                await TenantAdmin(reg).ensure_dev_tenant(self.cfg.state_dir, sorted(new_names))
                allowed |= new_names
            except Exception as e:
                log.warning("registry watch: could not allow %s for the dev tenant: %r",
                            ", ".join(sorted(new_names)), e)
        return allowed

    def reconcile(self, models: Models) -> tuple[list[str], list[str]]:
        """Make the running model versions match the registry listing ``models``
        (``{name: {version: manifest}}``, as :meth:`control.state.registry.Registry.list_models` returns).

        Starts the scheduler and workers of every valid active version not running yet; drains (and
        forgets) those of versions that are gone, no longer active or whose manifest changed (a
        changed active one is then started again). Returns ``(started, stopped)`` refs. Called by the
        registry watch; safe to call from any thread. Does nothing once :meth:`stop` began.
        """
        desired = desired_versions(models, self.cfg.workers, self.bad_manifests)
        procs = self.procs
        with procs.lock:
            if procs.stopping:
                return [], []
            stop_refs, draining = self._forget_versions(desired)
        if draining:
            procs.terminate(sorted(draining, key=stop_rank))
            with procs.lock:
                gone = {id(a) for a in draining}
                procs.draining = [a for a in procs.draining if id(a) not in gone]
        with procs.lock:
            started = [] if procs.stopping else self._start_versions(desired)
        return started, stop_refs

    def _forget_versions(self, desired: Mapping[str, tuple[str, int]]) -> tuple[list[str], list[ActorProcess]]:
        """Under the lock: move the processes of running versions not in ``desired`` (or changed) to
        ``draining``; returns those refs and processes."""
        procs = self.procs
        stop_refs = [r for r, fp in self.running.items() if r not in desired or desired[r][0] != fp]
        draining: list[ActorProcess] = []
        for ref in stop_refs:
            del self.running[ref]
            group = [a for a in procs.actors if a.model == ref]
            procs.actors = [a for a in procs.actors if a.model != ref]
            draining += group
            procs.event(f"{ref} left the registry's active versions (or changed): draining "
                        + (", ".join(a.name for a in group) or "nothing"))
        procs.draining += draining
        if draining:
            procs.write_pids()
        return stop_refs, draining

    def _start_versions(self, desired: Mapping[str, tuple[str, int]]) -> list[str]:
        """Under the lock: spawn the scheduler and workers of every desired version not running yet."""
        started: list[str] = []
        for ref, (fp, workers) in sorted(desired.items()):
            if ref in self.running:
                continue
            group = self.actors.version_actors(ref, workers)
            for a in group:
                a.dynamic = True
                self.procs.actors.append(a)
                try:
                    self.procs.spawn(a)
                except OSError as e:
                    log.error("could not start %s: %s", a.name, e)
            self.running[ref] = fp
            started.append(ref)
            self.procs.event(f"{ref} registered: started " + ", ".join(a.name for a in group))
        if started:
            self.procs.write_pids()
        return started

    @property
    def running_versions(self) -> list[str]:
        """``name@version`` of every model version whose processes this supervisor runs, sorted."""
        with self.procs.lock:
            return sorted(self.running)


async def _cancelled(task: asyncio.Future | None) -> None:
    """Cancel ``task`` (if any) and wait for it; returns None (the caller's new handle)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    return None
