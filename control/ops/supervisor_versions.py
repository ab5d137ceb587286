"""Model versions come and go live under ``actorserve up``: the registry watch of
:class:`control.ops.supervisor.Supervisor` and its reconciliation of the running schedulers and workers
with the registry's active versions.

:func:`desired_versions` is the rule (which versions should run, with how many workers);
:class:`VersionsMixin` applies it to the supervisor's processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from control.ops.deploy import manifest_fingerprint, version_worker_count
from control.ops.supervisor_processes import ActorProcess

log = logging.getLogger("actorserve.supervisor")

# Stop order: the rollout controller and the autoscaler first (no decisions while the stack goes away),
# then the edges (no new traffic), then the pipeline front to back.
STOP_ORDER = ("rollout", "autoscaler", "gateway", "jobs", "validator", "scheduler", "worker")
# The same order as waves: every process of a wave is SIGTERMed at once, the next wave follows when the
# earlier ones exited or a short gap later (control/ops/supervisor_processes.py ``terminate``), all
# within one deadline. Edges first (no new work enters; gateways keep waiting for their streams), then
# the validator and the schedulers (the queue is still dispatched to running workers for a moment),
# then the workers (they finish what they run within their drain timeout).
STOP_WAVES = (("rollout", "autoscaler", "gateway", "jobs"), ("validator", "scheduler"), ("worker",))


def stop_rank(a: ActorProcess) -> int:
    """Position of ``a``'s kind in STOP_ORDER (unknown kinds last): sort key of a group to stop."""
    return STOP_ORDER.index(a.kind) if a.kind in STOP_ORDER else len(STOP_ORDER)

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


class VersionsMixin:
    """The registry watch and :meth:`reconcile` of :class:`control.ops.supervisor.Supervisor`.

    Uses the supervisor's ``_lock``, ``_stopping``, ``_stop_requested``, ``actors``, ``_versions``
    (running ref -> fingerprint), ``_draining``, ``_bad_manifests``, ``workers``, ``registry_poll_s``,
    ``dev_api_key``, ``state_dir``, ``stack`` and its ``_version_actors``, ``_spawn``, ``_terminate``,
    ``_write_pids``, ``_event``.
    """

    def _watch_thread(self) -> None:
        try:
            asyncio.run(self._watch_registry())
        except Exception:  # pragma: no cover - logged, the rest of the stack keeps running
            log.exception("registry watch stopped")

    async def _watch_registry(self) -> None:
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
            while not self._stop_requested.is_set():
                try:
                    if reg is None:
                        reg = await Registry.open(self.stack.etcd_url, timeout=3.0)
                        waker = asyncio.ensure_future(self._wake_on_desired(reg, wake))
                    models = await reg.list_models()
                    desired, ready, notices = await self._read_scaling(reg)
                    warned = False
                except Exception as e:
                    if not warned and not self._stop_requested.is_set():
                        log.warning("registry watch: cannot read the registry (%r); retrying", e)
                        warned = True
                    if reg is not None:
                        waker = await _cancelled(waker)
                        await reg.close()
                        reg = None
                    await asyncio.sleep(self.registry_poll_s)
                    continue
                allowed = await self._allow_new_models(reg, models, allowed)
                # Spawning is quick; draining may wait up to stop_timeout_s: keep it off the loop.
                await asyncio.to_thread(self.reconcile, models)
                await asyncio.to_thread(self.scaling_round, desired, ready, None, notices)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.registry_poll_s)
                wake.clear()
        finally:
            await _cancelled(waker)
            if reg is not None:
                await reg.close()

    async def _wake_on_desired(self, reg: Any, wake: asyncio.Event) -> None:
        """Set ``wake`` on every change under ``desired_prefix()`` (until cancelled; the poll goes on if the
        watch fails)."""
        from control.state.names import desired_prefix

        try:
            async for _ in reg.watch_prefix(desired_prefix()):
                wake.set()
        except Exception as e:  # the 0.5 s poll still carries the counts out
            log.debug("registry watch: the desired-count watch ended (%r)", e)

    async def _read_scaling(self, reg: Any) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """The records under ``desired_prefix()``, (only while a replica is not seen ready yet) those under
        the workers' and the metrics prefixes (else None), and the preemption notices."""
        from control.state.names import all_metrics_prefix, all_workers_prefix, desired_prefix, notices_prefix

        desired = await reg.get_prefix_json(desired_prefix())
        notices = await reg.get_prefix_json(notices_prefix())
        if not self._wants_ready_records():
            return desired, None, notices
        ready = await reg.get_prefix_json(all_workers_prefix())
        ready.update(await reg.get_prefix_json(all_metrics_prefix()))
        return desired, ready, notices

    async def _allow_new_models(self, reg: Any, models: Models, allowed: set[str] | None) -> set[str]:
        """Add model names that appeared since the last round to the dev tenant; returns the names allowed."""
        if allowed is None:
            return set(models)
        new_names = set(models) - allowed
        if new_names and self.dev_api_key:
            try:
                from control.state.tenants import TenantAdmin

                await TenantAdmin(reg).ensure_dev_tenant(self.state_dir, sorted(new_names))
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
        desired = desired_versions(models, self.workers, self._bad_manifests)
        with self._lock:
            if self._stopping:
                return [], []
            stop_refs, draining = self._forget_versions(desired)
        if draining:
            self._terminate(sorted(draining, key=stop_rank))
            with self._lock:
                gone = {id(a) for a in draining}
                self._draining = [a for a in self._draining if id(a) not in gone]
        with self._lock:
            started = [] if self._stopping else self._start_versions(desired)
        return started, stop_refs

    def _forget_versions(self, desired: Mapping[str, tuple[str, int]]) -> tuple[list[str], list[ActorProcess]]:
        """Under the lock: move the processes of running versions not in ``desired`` (or changed) to
        ``_draining``; returns those refs and processes."""
        stop_refs = [r for r, fp in self._versions.items() if r not in desired or desired[r][0] != fp]
        draining: list[ActorProcess] = []
        for ref in stop_refs:
            del self._versions[ref]
            group = [a for a in self.actors if a.model == ref]
            self.actors = [a for a in self.actors if a.model != ref]
            draining += group
            self._event(f"{ref} left the registry's active versions (or changed): draining "
                        + (", ".join(a.name for a in group) or "nothing"))
        self._draining += draining
        if draining:
            self._write_pids()
        return stop_refs, draining

    def _start_versions(self, desired: Mapping[str, tuple[str, int]]) -> list[str]:
        """Under the lock: spawn the scheduler and workers of every desired version not running yet."""
        started: list[str] = []
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
            self._event(f"{ref} registered: started " + ", ".join(a.name for a in group))
        if started:
            self._write_pids()
        return started

    @property
    def running_versions(self) -> list[str]:
        """``name@version`` of every model version whose processes this supervisor runs, sorted."""
        with self._lock:
            return sorted(self._versions)


async def _cancelled(task: asyncio.Future | None) -> None:
    """Cancel ``task`` (if any) and wait for it; returns None (the caller's new handle)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    return None
