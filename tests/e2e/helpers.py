"""Helpers shared by the end-to-end tests: a tiny-model deployment and a worker-statistics probe."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from bus import subjects
from bus.messages import WorkerStats
from bus.nats_bus import NatsBus


@contextlib.contextmanager
def tiny_deployment(state_dir, tiny_gguf: str, actor_args: dict, ready_s: float = 120, **kwargs) -> Iterator:
    """A Supervisor stack serving the tiny model as ``tiny`` (no restarts); stopped on exit. ``kwargs`` go to
    the Supervisor (e.g. ``env``)."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    sup = Supervisor(StackConfig(state_dir, port=0, supervise=False, model_file=tiny_gguf, model_name="tiny",
                                 actor_args=actor_args, **kwargs))
    sup.start()
    try:
        sup.wait_ready(timeout=ready_s)
        yield sup
    finally:
        sup.stop()


async def latest_worker_stats(nats_url: str, worker_id: str = "worker-0", timeout: float = 10.0) -> WorkerStats:
    """The next statistics message of ``worker_id`` (published about once a second)."""
    bus = await NatsBus.connect(nats_url, name="test-stats")
    got: list[WorkerStats] = []
    ev = asyncio.Event()

    async def on(msg):
        got.append(WorkerStats.decode(msg.data))
        ev.set()
    sub = await bus.subscribe(subjects.stats(worker_id), on)
    try:
        async with asyncio.timeout(timeout):
            await ev.wait()
    finally:
        await sub.unsubscribe()
        await bus.close()
    return got[-1]
