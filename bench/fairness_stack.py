"""Stack control for ``actorserve bench fairness`` (bench/fairness_bench.py): its tenants and weights in etcd,
replacing the scheduler (fair <-> FCFS) and the resident memory of every process the stack started."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import fairness_workload as wl

MODEL = "smollm2-135m-instruct"
TENANTS = ("bench-a", "bench-b", "bench-c")


async def setup_tenants(etcd_url: str, tenants: tuple[str, ...] = TENANTS[:2]) -> dict[str, str]:
    """Create ``tenants`` (allowed: the default model, weight 1); return their keys. Tenants left in the
    state directory by an earlier run are reused with a fresh key and weight 1, so the bench can be run
    again after a failed run."""
    from control.state.registry import Registry
    from control.state.tenants import TenantAdmin
    async with Registry.connect(etcd_url) as reg:
        admin = TenantAdmin(reg)
        return {t: await _bench_tenant(admin, t) for t in tenants}


async def _bench_tenant(admin, tenant_id: str) -> str:
    """A new API key of ``tenant_id``, created (or reset: model access, weight 1) for this run."""
    from control.state.tenants import TenantError
    try:
        return (await admin.create(tenant_id, allowed_models=[MODEL]))[2]
    except TenantError:
        await admin.allow_models(tenant_id, [MODEL])
        await admin.set_weight(tenant_id, 1.0)
        return (await admin.add_key(tenant_id))[1]


async def _set_weights(etcd_url: str, weights: dict[str, float]) -> None:
    from control.state.registry import Registry
    from control.state.tenants import TenantAdmin
    async with Registry.connect(etcd_url) as reg:
        for t, w in weights.items():
            await TenantAdmin(reg).set_weight(t, w)


def set_weights(etcd_url: str, weights: dict[str, float]) -> None:
    """Write tenant weights and wait 3 s (schedulers re-read tenants every 2 s)."""
    asyncio.run(_set_weights(etcd_url, weights))
    time.sleep(3)


def replace_scheduler(sup, current: subprocess.Popen | None, fcfs: bool, log_dir: Path) -> subprocess.Popen:
    """Stop the running scheduler (supervisor's or ours) and start one with or without ``--fcfs``."""
    proc = sup.actor("scheduler-0").proc if current is None else current
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    cmd = [sys.executable, "-m", "control.ops.cli", "actor", "scheduler", "--model", f"{MODEL}@1",
           "--nats", sup.nats_url, "--etcd", sup.etcd_url] + (["--fcfs"] if fcfs else [])
    log = open(log_dir / f"bench-scheduler-{'fcfs' if fcfs else 'fair'}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    asyncio.run(wait_active(sup.etcd_url, proc.pid))
    return proc


async def wait_active(etcd_url: str, pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the scheduler process ``pid`` holds the version's election key (it is then subscribed
    and has listed the workers once). RuntimeError after ``timeout_s``."""
    from control.state.names import scheduler_key
    from control.state.registry import Registry
    async with Registry.connect(etcd_url) as reg:
        t_end = time.monotonic() + timeout_s
        while ((await reg.get_json(scheduler_key(MODEL, "1"))) or {}).get("pid") != pid:
            if time.monotonic() > t_end:
                raise RuntimeError(f"scheduler {pid} did not become active in {timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # its first credit heartbeats (4 Hz) arrive


def stack_rss_kib(pids: dict[str, int]) -> dict[str, int]:
    """VmRSS (KiB) of each named process and of its live descendants (named ``<name>/<pid>``)."""
    out: dict[str, int] = {}
    todo = list(pids.items())
    while todo:
        name, pid = todo.pop()
        try:
            rss = wl.vm_rss_kib(Path(f"/proc/{pid}/status").read_text())
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        if rss is not None:
            out[name] = rss
        todo += [(f"{name.split('/')[0]}/{c}", int(c)) for c in children]
    return out
