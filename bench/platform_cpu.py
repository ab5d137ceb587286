"""What ``actorserve bench platform`` reads from the machine: CPU of each stack process from ``/proc``, etcd
requests by gRPC method from etcd's ``/metrics``, NATS message counters from nats-server's monitoring port.

CPU of a process = ``utime + stime + cutime + cstime`` of ``/proc/<pid>/stat`` (fields 14-17, clock ticks;
proc(5)): its own threads plus its children that exited and were waited for; live descendants that are not
themselves named are added to their nearest named ancestor (``/proc/<pid>/task/<tid>/children``).
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import orjson

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")  # seconds per clock tick of /proc/<pid>/stat


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime + cutime + cstime of ``pid`` (s); None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) * TICK_S


def children(pid: int) -> list[int]:
    """Live child pids of ``pid`` (every thread's children); [] when gone."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def stack_cpu_s(named: dict[str, int]) -> dict[str, float]:
    """{name: CPU s} of each named process plus its live descendants that are not named themselves."""
    own = set(named.values())
    out: dict[str, float] = {}
    for name, pid in named.items():
        total, todo = 0.0, [pid]
        while todo:
            p = todo.pop()
            total += proc_cpu_s(p) or 0.0
            todo += [c for c in children(p) if c not in own]
        out[name] = total
    return out


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback URLs of our own stack)
        return r.read()


_GRPC = re.compile(r'^grpc_server_handled_total\{([^}]*)\}\s+([0-9.e+]+)', re.M)


def etcd_requests(etcd_url: str) -> dict[str, float]:
    """{"Service/Method": calls handled so far} from etcd's Prometheus ``/metrics`` ({} when unreachable)."""
    try:
        text = _get(etcd_url.split(",")[0].rstrip("/") + "/metrics").decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for labels, value in _GRPC.findall(text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = f"{lab.get('grpc_service', '?').rsplit('.', 1)[-1]}/{lab.get('grpc_method', '?')}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def nats_counters(monitor_url: str) -> dict[str, float]:
    """nats-server totals from ``/varz``: in_msgs, out_msgs, in_bytes, out_bytes ({} when unreachable)."""
    try:
        v = orjson.loads(_get(monitor_url.rstrip("/") + "/varz"))
    except (OSError, ValueError):
        return {}
    return {k: float(v.get(k, 0)) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}


def jetstream_counters(monitor_url: str) -> dict[str, float]:
    """nats-server JetStream totals from ``/jsz?streams=true`` ({} when unreachable): ``js_stored`` (messages
    ever stored, the sum of every stream's ``last_seq``: stream publishes and KV puts/deletes, each one write to
    the store) and ``js_api`` (JetStream API calls: message gets and deletes, consumer pulls, infos)."""
    try:
        v = orjson.loads(_get(monitor_url.rstrip("/") + "/jsz?streams=true"))
    except (OSError, ValueError):
        return {}
    stored = sum(float((st.get("state") or {}).get("last_seq", 0))
                 for acc in v.get("account_details") or [] for st in acc.get("stream_detail") or [])
    return {"js_stored": stored, "js_api": float((v.get("api") or {}).get("total", 0))}


def nats_monitor_url(state_dir: Path) -> str | None:
    """The embedded nats-server's monitoring URL from ``<state_dir>/nats.conf`` (``http: "HOST:PORT"``)."""
    try:
        m = re.search(r'^http:\s*"([^"]+)"', (state_dir / "nats.conf").read_text(), re.M)
    except OSError:
        return None
    return f"http://{m.group(1)}" if m else None


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """after - before per key (keys of ``after``; missing in ``before`` count from 0), zero deltas dropped."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
