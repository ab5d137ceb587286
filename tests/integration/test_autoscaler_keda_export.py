"""The desired counts KEDA follows, live (issue [27] item 3): two ``actorserve actor autoscaler`` processes against
real nats-server + etcd; a desired record changed in etcd shows on the leader's ``/metrics`` as
``actorserve_autoscaler_desired_replicas{tier="worker",model,version,pool}`` (what the rendered ScaledObjects
query), follows each change, and never appears on the standby's; after the leader stops, the standby takes over
and exports the same count. ~10-20 s (two interpreter starts on a loaded machine)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from control.state import names

ROOT = Path(__file__).resolve().parents[2]
MODEL, VERSION, POOL = "kedalive", "1", "local"  # a version nobody registers: no policy decides for it
SERIES = re.compile(r'^actorserve_autoscaler_desired_replicas\{([^}]*)\} (\S+)$', re.M)


def start(infra, cid: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "ACTORSERVE_NATS": infra.nats_url, "ACTORSERVE_ETCD": infra.etcd_url,
           "PYTHONPATH": str(ROOT), "ACTORSERVE_LOG_LEVEL": "INFO"}
    argv = [sys.executable, "-m", "control.ops.cli", "actor", "autoscaler", "--controller-id", cid,
            "--metrics-port", "0", "--tick-s", "0.2", "--worker-limits", "0:8", "--lease-ttl", "2"]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        return resp.read().decode()


def desired_of(text: str) -> dict[tuple[str, str, str], float]:
    out = {}
    for labels, value in SERIES.findall(text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if lab.get("tier") == "worker":
            out[(lab["model"], lab["version"], lab["pool"])] = float(value)
    return out


def is_leader(text: str) -> bool:
    return re.search(r"^actorserve_autoscaler_leader 1\.0$", text, re.M) is not None


async def until(pred, timeout: float, what: str):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            got = pred()
        except OSError:
            got = None
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s: {what}")


async def test_the_leader_exports_the_desired_count_and_the_standby_nothing(infra, registry, tmp_path):
    key = names.desired_key("worker", MODEL, VERSION, POOL)
    await registry.delete(key)
    procs = {cid: start(infra, cid, tmp_path / f"{cid}.log") for cid in ("keda-a", "keda-b")}
    try:
        urls: dict[str, str] = {}

        async def registered() -> bool:
            for cid in procs:
                info = await registry.get_json(names.metrics_key("autoscaler", cid))
                if info:
                    urls[cid] = info["url"]
            return len(urls) == 2
        logs = lambda: [f.read_text()[-2000:] for f in tmp_path.glob("*.log")]  # noqa: E731
        t_end = time.monotonic() + 60.0
        while not await registered():
            assert time.monotonic() < t_end, logs()
            assert all(p.poll() is None for p in procs.values()), logs()
            await asyncio.sleep(0.2)

        def roles():
            texts = {cid: scrape(url) for cid, url in urls.items()}
            leaders = [cid for cid, t in texts.items() if is_leader(t)]
            return (leaders[0], texts) if len(leaders) == 1 else None
        leader, _ = await until(roles, 30.0, "one leader")
        standby = next(cid for cid in urls if cid != leader)

        for count in (3, 7, 0, 1):
            await registry.put_json(key, {"count": count, "ts": time.time(), "reason": "live test", "by": "test"})
            got = await until(lambda: desired_of(scrape(urls[leader])).get((MODEL, VERSION, POOL)) == count,
                              10.0, f"the leader's /metrics shows {count}")
            assert got
            standby_text = scrape(urls[standby])
            assert not is_leader(standby_text)
            assert SERIES.findall(standby_text) == [], "a standby exports no desired count at all"
            print(f"desired {count}: on the leader's /metrics; the standby exports no series")

        procs[leader].send_signal(signal.SIGTERM)  # resigns: the standby takes over and exports the same count
        assert procs[leader].wait(timeout=30) is not None
        await until(lambda: is_leader(scrape(urls[standby])), 15.0, "the standby takes over")
        await until(lambda: desired_of(scrape(urls[standby])).get((MODEL, VERSION, POOL)) == 1, 10.0,
                    "the new leader exports the count")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        await registry.delete(key)
