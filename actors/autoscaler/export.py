"""The autoscaler's desired counts as a Prometheus gauge, for an orchestrator to carry out (issue [27] item 3).

``actorserve_autoscaler_desired_replicas`` has one series per target the active replica knows, with the labels

* ``target``: ``validator``, ``gateway`` or ``worker/<name>/<version>/<pool>`` (as in the decision log),
* ``tier``: ``validator``, ``gateway`` or ``worker``,
* ``model``, ``version``, ``pool``: the worker target's parts (absent on the CPU tier).

Value: the target's desired count (``/actorserve/desired/...``, re-read each tick and updated at once when this
replica writes one), else, with no record, the replicas the last tick observed: an absent record means "keep
today's count" (docs/autoscaling.md), and exporting the observed count keeps an orchestrator that follows the
gauge (KEDA, deploy/k8s/keda, docs/deployment.md) where it is.

A worker pool's value is **running + sleeping** (issue [28]): a sleeping worker (actors/worker/sleep.py) is a pod
that stays; its sleep and its wake travel as etcd records (actors/autoscaler/sleep_carry.py), not as pod changes.
Added to the desired (awake) count: the pool's sleepers the last tick saw, less those the sleeping tier's plan
lets exit and those told to wake (the desired count holds them), plus the workers told to sleep whose records do
not say so yet.

**Only the leader exports.** A standby (and a replica that lost its lease) exports no series at all, so a query
``max(actorserve_autoscaler_desired_replicas{...})`` over every autoscaler pod sees the leader's values only, and
no series (Prometheus marks them stale) while no replica leads: KEDA then keeps the current replica count.

Pure: :func:`desired_samples` reads plain attributes of an :class:`~actors.autoscaler.service.Autoscaler` (or
any object with ``is_leader``, ``state.desired`` and ``snapshot``); it runs in the scraping thread.
"""

from __future__ import annotations

from typing import Any

METRIC = "actorserve_autoscaler_desired_replicas"
DESCRIPTION = ("Desired replicas per target, exported by the active autoscaler only (its desired record in etcd, "
               "else the replicas observed at the last tick).")


def target_labels(key: str) -> dict[str, str]:
    """The labels of a target key: ``validator`` / ``gateway`` (CPU tier) or ``name/version/pool`` (a worker
    pool). ValueError on anything else."""
    parts = key.split("/")
    if len(parts) == 1 and parts[0]:
        return {"target": key, "tier": key}
    if len(parts) == 3 and all(parts):
        name, version, pool = parts
        return {"target": f"worker/{key}", "tier": "worker", "model": name, "version": version, "pool": pool}
    raise ValueError(f"{key!r} is no autoscaler target (KIND or NAME/VERSION/POOL)")


def _count(value: Any) -> int | None:
    count = getattr(value, "count", value)
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def desired_counts(scaler: Any) -> dict[str, int]:
    """``{target key: count}`` the active replica exports; ``{}`` on a standby."""
    if not getattr(scaler, "is_leader", False):
        return {}
    snap = getattr(scaler, "snapshot", None) or {}
    out: dict[str, int] = {}
    for section in ("cpu", "pools"):
        for key, signals in (snap.get(section) or {}).items():
            n = _count((signals or {}).get("replicas")) if isinstance(signals, dict) else None
            if n is not None:
                out[key] = n
    state = getattr(scaler, "state", None)
    records = getattr(state, "desired", None)
    if records is None:
        records = snap.get("desired") or {}
    for key, value in dict(records).items():
        n = _count(value)
        if n is not None:
            out[key] = n
    for key in out:
        if key.count("/") == 2:
            out[key] += sleepers_kept(scaler, key)
    return out


def sleepers_kept(scaler: Any, key: str) -> int:
    """Sleeping workers of pool ``key`` that stay (module docstring): counted in the exported replicas."""
    snap = getattr(scaler, "snapshot", None) or {}
    sleeping = _count(((snap.get("pools") or {}).get(key) or {}).get("sleeping")) or 0
    plan = (snap.get("sleep") or {}).get(key) or {}
    carrier = getattr(scaler, "carrier", None)
    to_sleep = carrier.pending(key, "sleep") if carrier is not None else 0
    waking = carrier.pending(key, "wake") if carrier is not None else 0
    return max(0, sleeping - len(plan.get("exit") or ()) - waking) + to_sleep


def desired_samples(scaler: Any) -> list[tuple[float, dict[str, str]]]:
    """The gauge's ``(value, labels)`` pairs: one per target while ``scaler`` leads, none otherwise."""
    out = []
    for key, n in sorted(desired_counts(scaler).items()):
        try:
            out.append((float(n), target_labels(key)))
        except ValueError:
            continue
    return out


def register(scaler: Any) -> None:
    """Register the gauge on this process's ``/metrics`` (actors/metrics.py)."""
    from actors.metrics import observable_gauge

    observable_gauge(METRIC, DESCRIPTION, "1", lambda: desired_samples(scaler))
