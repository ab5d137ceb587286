"""A version resident nowhere asks a multi-version worker host to load it (issue [11] item 1).

While the scheduler's version has queued requests and no live worker, every ``period_s`` it reads the host
records (``/actorserve/hosts/``, actors/worker/host.py) and asks hosts in :func:`rank_hosts` order
(``as.int.host.<host_id>.load``, HostLoad) until one accepts. The queued requests keep waiting within their
deadlines while the host loads (the deadline sweep ends the late ones with 503 ``deadline_exceeded``). When
hosts exist and every one refuses (the version cannot fit any host's budget, or is not active), the queued
requests end at once with 503 ``model_not_resident`` and Retry-After. Without host records nothing happens
here: the version waits for a worker of its own (``actorserve up``, the autoscaler).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from bus import subjects
from bus.base import BusError
from bus.host_messages import HostLoad, HostLoadAck

log = logging.getLogger("actorserve.scheduler")


def rank_hosts(hosts: Mapping[str, Mapping[str, Any]], ref: str) -> list[str]:
    """Host ids to ask for ``ref`` (``name@version``), best first: a host where it is resident (draining or
    paused) or already asked for, then the most free bytes; ties by id. ``hosts``: ``{host_id: record}``."""
    def key(item: tuple[str, Mapping[str, Any]]) -> tuple:
        rec = item[1]
        holds = any(r.get("model") == ref for r in rec.get("resident", [])) or ref in rec.get("asked", [])
        return (not holds, -int(rec.get("free_bytes", 0)), item[0])
    return [host_id for host_id, _ in sorted(((h, r) for h, r in hosts.items() if isinstance(r, Mapping)), key=key)]


async def ask_hosts(reg, bus, name: str, version: str, queue_len: int,
                    timeout_s: float = 2.0) -> tuple[bool | None, list[str]]:
    """Ask the hosts in rank order until one accepts. ``(True, [])``: accepted; ``(False, reasons)``: hosts
    exist and each refused; ``(None, reasons)``: no host record, or no host answered."""
    async with asyncio.timeout(3.0):
        hosts = await reg.list_hosts()
    ref, reasons, refused = f"{name}@{version}", [], 0
    order = rank_hosts(hosts, ref)
    for host_id in order:
        try:
            msg = await bus.request(subjects.host_load(host_id), HostLoad(name, version, queue_len).encode(),
                                    timeout=timeout_s)
            ack = HostLoadAck.decode(msg.data)
        except (BusError, ValueError, TimeoutError) as exc:
            reasons.append(f"{host_id}: {exc!r}")
            continue
        if ack.accepted:
            return True, []
        refused += 1
        reasons.append(f"{host_id}: {ack.reason}")
    return (False if order and refused == len(order) else None), reasons


async def follow_hosts(reg, bus, svc, name: str, version: str, period_s: float = 0.5, look_s: float = 0.05) -> None:
    """The scheduler's loop (module docstring): looks every ``look_s`` (local state only), asks at once when
    requests wait with no live worker, then at most every ``period_s`` while they still do. Runs until
    cancelled; a failing round is retried."""
    last = -period_s
    while True:
        await asyncio.sleep(look_s)
        now = asyncio.get_running_loop().time()
        if svc.load.live_workers() > 0 or not len(svc.queue) or now - last < period_s:
            continue
        last = now
        try:
            verdict, reasons = await ask_hosts(reg, bus, name, version, len(svc.queue))
        except Exception as exc:  # etcd slow or away: ask at the next round
            log.debug("host ask for %s@%s failed: %r", name, version, exc)
            continue
        if verdict is False:
            await svc.fail_queued(f"no worker host can hold {name}@{version}: " + "; ".join(reasons),
                                  "model_not_resident")

