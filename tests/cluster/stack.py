"""The cluster under test: three namespace hosts, a 3-node NATS cluster, a 3-member etcd cluster and the
actors spread over them, each process started by hand with ``ip netns exec <ns> ...``.

=====  ==========================================================================================
host   processes
=====  ==========================================================================================
h1     nats-server ``n-h1``, etcd ``e-h1``, gateway-0, validator-0, scheduler-a (active first), worker-0,
       jobs-0
h2     nats-server ``n-h2``, etcd ``e-h2``, gateway-1, validator-1, scheduler-b (standby), worker-1,
       rollout-0
h3     nats-server ``n-h3``, etcd ``e-h3``, jobs-1
load   the load generator (tests/cluster/loadgen.py)
=====  ==========================================================================================

NATS: one config per server (tests/cluster/servers.py), cluster routes between the three addresses
(route user and password), JetStream with its own store directory, and the per-role users of
bus/nats_auth.py + nats_roles.py (internal operator user, one user per actor role, the tenant's
key user). Every actor gets its role's URLs of all three servers in ``ACTORSERVE_NATS`` (environment,
never argv) and ``ACTORSERVE_JS_REPLICAS=3``, so every stream, KV bucket and object store is created with
three replicas. etcd: ``--etcd`` lists the three members, the actor's own host first. Only the pids this
module spawned are ever signalled (their process groups).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster import servers
from tests.cluster.netns import Network, ns_pids

REPO = Path(__file__).resolve().parents[2]
MODEL, VERSION = "tiny", "1"
HOSTS = ("h1", "h2", "h3")
LOAD = "load"
GATEWAY_PORT = 8000
TENANT = "cluster"


@dataclass(frozen=True)
class ActorSpec:
    """One actor process of the layout: name, host, kind, extra argv."""

    name: str
    host: str
    kind: str
    args: tuple[str, ...] = ()


def _model(*extra: str) -> tuple[str, ...]:
    return ("--model", f"{MODEL}@{VERSION}", *extra)


WORKER_ARGS = ("--kv-cache-bytes", "8000000", "--no-progress")
SCHED_ARGS = ("--max-queue-per-tenant", "1024")
# start order: workers, the active scheduler before its standby, validators, jobs, rollout, gateways
LAYOUT = (
    ActorSpec("worker-0", "h1", "worker", _model("--worker-id", "worker-0", *WORKER_ARGS)),
    ActorSpec("worker-1", "h2", "worker", _model("--worker-id", "worker-1", *WORKER_ARGS)),
    ActorSpec("scheduler-a", "h1", "scheduler", _model("--scheduler-id", "scheduler-a", *SCHED_ARGS)),
    ActorSpec("scheduler-b", "h2", "scheduler", _model("--scheduler-id", "scheduler-b", *SCHED_ARGS)),
    ActorSpec("validator-0", "h1", "validator"),
    ActorSpec("validator-1", "h2", "validator"),
    ActorSpec("jobs-0", "h1", "jobs", ("--jobs-id", "jobs-0")),
    ActorSpec("jobs-1", "h3", "jobs", ("--jobs-id", "jobs-1")),
    ActorSpec("rollout-0", "h2", "rollout", ("--controller-id", "rollout-0")),
    ActorSpec("gateway-0", "h1", "gateway", ("--port", str(GATEWAY_PORT), "--gateway-id", "gw-0")),
    ActorSpec("gateway-1", "h2", "gateway", ("--port", str(GATEWAY_PORT), "--gateway-id", "gw-1")),
)
GATEWAYS = tuple(a for a in LAYOUT if a.kind == "gateway")


@dataclass
class Proc:
    """One process of the cluster, started inside its host's namespace (own process group)."""

    name: str
    host: str
    kind: str  # nats | etcd | an actor kind
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen | None = None
    starts: int = 0

    @property
    def running(self) -> bool:
        """True while the current process has not exited."""
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        """The current pid (== process group id), None before the first start."""
        return self.popen.pid if self.popen is not None else None

    def start(self, net: Network) -> None:
        """Spawn ``argv`` inside the host's namespace, output appended to ``log``."""
        with open(self.log, "ab") as f:
            f.write(f"\n=== {time.strftime('%H:%M:%S')} start {self.name}\n".encode())
            f.flush()
            self.popen = subprocess.Popen(net.exec_prefix(self.host) + self.argv, cwd=REPO, env=self.env,
                                          stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.starts += 1

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group of the current process (if it still runs)."""
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, wait_s: float = 5.0) -> None:
        """SIGKILL and reap (bounded)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, n: int = 3000) -> str:
        """The end of the log."""
        try:
            return self.log.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""


def http_json(url: str, timeout: float = 1.0, ctx=None):
    """GET ``url`` (``ctx``: the ssl context of an https URL) and decode JSON; None when it does not
    answer (any status, any error)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:  # noqa: S310 - test network only
            return json.loads(r.read())
    except Exception:  # noqa: BLE001
        return None


@dataclass
class Cluster:
    """The whole test cluster under ``base`` (see the module docstring). ``tls``: everything over TLS
    (``actorserve certs`` in ``<base>/tls``): etcd client and peer ports with client certificates and
    per-role RBAC users (``actorserve etcd-auth``), NATS client connections and routes, the gateways'
    HTTPS; every process gets its role's certificate in ``ACTORSERVE_TLS_*``."""

    base: Path
    tls: bool = True
    net: Network = field(default_factory=lambda: Network(hosts=(*HOSTS, LOAD)))
    procs: dict[str, Proc] = field(default_factory=dict)
    key: str = ""
    auth: servers.Auth | None = None

    @property
    def tls_dir(self) -> Path | None:
        """The certificates' directory (None without TLS)."""
        return self.base / "tls" if self.tls else None

    def tls_files(self, role: str = "root"):
        """``bus.tls.TlsFiles`` of ``role`` (None without TLS)."""
        from bus.tls import TlsFiles

        return TlsFiles.in_dir(self.tls_dir, role) if self.tls else None

    def client_ssl(self):
        """An ``ssl.SSLContext`` trusting the cluster's CA with the root client certificate (None: no TLS)."""
        return self.tls_files().client_context() if self.tls else None

    # -- addresses ------------------------------------------------------------------------------

    def addr(self, host: str) -> str:
        """The host's address."""
        return self.net.addr(host)

    def gateway_urls(self) -> list[str]:
        """Base URLs of the gateways, in LAYOUT order (https with TLS)."""
        scheme = "https" if self.tls else "http"
        return [f"{scheme}://{self.addr(g.host)}:{GATEWAY_PORT}" for g in GATEWAYS]

    def gateway_host(self, index: int) -> str:
        """The host of gateway ``index``."""
        return GATEWAYS[index].host

    def etcd_urls(self, first: str | None = None) -> str:
        """The three members' client URLs (comma-separated), ``first``'s member first."""
        order = sorted(HOSTS, key=lambda h: h != first)
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{self.addr(h)}:{servers.ETCD_PORT}" for h in order)

    def nats_urls(self, role: str | None = None, first: str | None = None) -> str:
        """The three servers' client URLs with ``role``'s credentials (None: the internal user)."""
        order = sorted(HOSTS, key=lambda h: h != first)
        return ",".join(self.auth.url(role, self.addr(h), "tls" if self.tls else "nats") for h in order)

    # -- start / stop -----------------------------------------------------------------------------

    def _env(self, host: str, extra: dict[str, str] | None = None, kind: str | None = None) -> dict[str, str]:
        """A process's environment: no inherited ``ACTORSERVE_*``, the replicas, its own state dir, with TLS
        the certificate files of ``kind``'s role (root for None: CLI verbs, servers, the load generator)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORSERVE_")}
        env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), ACTORSERVE_JS_REPLICAS="3",
                   ACTORSERVE_STATE_DIR=str(self.base / host))
        if self.tls:
            from control.ops.tls_stack import child_tls_env

            env.update(child_tls_env(self.tls_dir, kind) if kind else self.tls_files().env())
        env.update(extra or {})
        return env

    def start(self, ready_timeout_s: float = 150.0) -> "Cluster":
        """Network, etcd, model and tenant, NATS, actors; blocks until every gateway serves a probe."""
        from tests.engine_fixtures import write_tiny_llama_gguf

        self.base.mkdir(parents=True, exist_ok=True)
        self.net.up()
        for h in (*HOSTS, LOAD):
            (self.base / h).mkdir(exist_ok=True)
        self.gguf = str(self.base / "tiny.gguf")
        write_tiny_llama_gguf(self.gguf)
        self.auth = servers.Auth.create(self.base / "secrets")
        if self.tls:  # one CA, server certificates naming the three addresses, a client certificate per role
            self.cli("h1", "certs", "--out", str(self.tls_dir), *(a for h in HOSTS for a in ("--host", self.addr(h))))
        for h in HOSTS:
            self._add(Proc(f"etcd-{h}", h, "etcd", servers.etcd_argv(self, h), self._env(h),
                           self.base / h / "etcd.log"))
        self._start_and_wait([p for p in self.procs.values() if p.kind == "etcd"], self.etcd_healthy, 30)
        if self.tls:  # per-role etcd users and RBAC roles, then auth on (root client certificate)
            self.cli("h1", "etcd-auth", "--etcd", self.etcd_urls("h1"), "--tls-dir", str(self.tls_dir))
        self.cli("h1", "models", "register-default", "--model-file", self.gguf, "--model-name", MODEL,
                 "--model-version", VERSION)
        self.key = self.cli("h1", "tenants", "create", TENANT, "--allow-models", MODEL).strip().splitlines()[-1]
        self.auth.tenant_users = asyncio.run(servers.tenant_users(self.etcd_urls(), self.tls_files()))
        for h in HOSTS:
            conf = servers.write_nats_config(self, h)
            self._add(Proc(f"nats-{h}", h, "nats", [servers.binary("nats-server"), "-c", str(conf)],
                           self._env(h), self.base / h / "nats.log"))
        self._start_and_wait([p for p in self.procs.values() if p.kind == "nats"], self.nats_healthy, 30)
        for spec in LAYOUT:
            self._add(self._actor_proc(spec))
        for spec in LAYOUT:
            self.procs[spec.name].start(self.net)
            if spec.name == "scheduler-a":  # active before the standby starts campaigning
                self.wait_for(lambda: self.active_scheduler() is not None, 60, "scheduler-a active")
        self.wait_for(lambda: self.steady_problem() is None, ready_timeout_s, "cluster ready",
                      problem=self.steady_problem)
        return self

    def _add(self, p: Proc) -> None:
        self.procs[p.name] = p

    def _actor_proc(self, spec: ActorSpec) -> Proc:
        from control.ops.nats_roles import role_of_kind

        argv = [sys.executable, "-m", "control.ops.cli", "actor", spec.kind, "--etcd", self.etcd_urls(spec.host),
                *spec.args]
        if spec.kind == "gateway":
            argv += ["--host", self.addr(spec.host)]
        env = self._env(spec.host, {"ACTORSERVE_NATS": self.nats_urls(role_of_kind(spec.kind), spec.host)},
                        kind=spec.kind)
        return Proc(spec.name, spec.host, spec.kind, argv, env, self.base / spec.host / f"{spec.name}.log")

    def _start_and_wait(self, procs: list[Proc], healthy, timeout_s: float) -> None:
        for p in procs:
            p.start(self.net)
        self.wait_for(lambda: all(healthy(p.host) for p in procs), timeout_s,
                      ", ".join(p.name for p in procs) + " healthy", procs=procs)

    def wait_for(self, cond, timeout_s: float, what: str, procs: list[Proc] = (), problem=None) -> float:
        """Poll ``cond()`` every 0.2 s until true; AssertionError naming ``what`` (and the last problem,
        and the log tails of ``procs`` that died) after ``timeout_s``. Returns the seconds waited."""
        t0 = time.monotonic()
        while not cond():
            dead = [p for p in procs if not p.running]
            if dead or time.monotonic() - t0 > timeout_s:
                tails = "\n".join(f"--- {p.name}:\n{p.tail()}" for p in (dead or procs))
                raise AssertionError(f"{what}: not within {timeout_s:.0f} s"
                                     f"{' (' + problem() + ')' if problem else ''}\n{tails}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def cli(self, host: str, *args: str, timeout: float = 60.0) -> str:
        """Run ``actorserve <args>`` inside ``host``'s namespace against the cluster; its stdout."""
        argv = self.net.exec_prefix(host) + [sys.executable, "-m", "control.ops.cli", *args]
        env = self._env(host, {"ACTORSERVE_ETCD": self.etcd_urls(host)})
        r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"actorserve {' '.join(args[:2])} failed ({r.returncode}):\n{r.stderr[-2000:]}"
        return r.stdout

    def stop(self) -> None:
        """SIGTERM every actor (2 s), then SIGKILL everything, then remove the network."""
        actors = [p for p in self.procs.values() if p.kind not in ("nats", "etcd")]
        for p in actors:
            p.signal(signal.SIGTERM)
        t_end = time.monotonic() + 2.0
        for p in actors:
            if p.popen is not None:
                try:
                    p.popen.wait(max(0.0, t_end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs.values():
            p.kill()
        self.net.down()

    # -- faults -------------------------------------------------------------------------------------

    def host_procs(self, host: str) -> list[Proc]:
        """Every process of ``host``, servers first (their start order)."""
        return [p for p in self.procs.values() if p.host == host]

    def kill_host(self, host: str) -> list[str]:
        """SIGKILL every process of ``host`` (nats, etcd, actors); returns their names. Asserts that no
        process is left in the host's namespace."""
        procs = [p for p in self.host_procs(host) if p.running]
        for p in procs:
            p.signal(signal.SIGKILL)
        for p in procs:
            p.kill()
        left = ns_pids(self.net.ns(host))
        assert not left, f"processes left in {host} after SIGKILL: {left}"
        return [p.name for p in procs]

    def restart_host(self, host: str, late_wait_s: float = 15.0) -> None:
        """Start the processes of ``host`` again (same argv, same data): its etcd member, nats-server,
        gateway and the other light actors at once (they reach the other members and servers until their
        own host's are back: every URL list names all three); the heavy starts -- workers (torch, the
        model) and the rollout controller -- once the host's gateway serves (at most ``late_wait_s`` s),
        so that on two cores client service comes back first, as an operator would restore it."""
        late = ("worker", "rollout")
        order = {"etcd": 0, "nats": 1, "gateway": 2}
        for p in sorted(self.host_procs(host), key=lambda p: order.get(p.kind, 3)):
            if p.kind not in late:
                p.start(self.net)
        gateways = [i for i, g in enumerate(GATEWAYS) if g.host == host]
        t_end = time.monotonic() + late_wait_s
        while gateways and not all(self.gateway_ready(i) for i in gateways) and time.monotonic() < t_end:
            time.sleep(0.2)
        for p in self.host_procs(host):
            if p.kind in late:
                p.start(self.net)

    def restart(self, name: str) -> None:
        """Start process ``name`` again (same argv, same data)."""
        self.procs[name].start(self.net)

    # -- health -------------------------------------------------------------------------------------

    def etcd_healthy(self, host: str) -> bool:
        """The host's etcd member answers ``/health`` with health true (it has a leader)."""
        scheme = "https" if self.tls else "http"
        body = http_json(f"{scheme}://{self.addr(host)}:{servers.ETCD_PORT}/health", ctx=self.client_ssl())
        return isinstance(body, dict) and str(body.get("health")) == "true"

    def nats_healthy(self, host: str) -> bool:
        """The host's nats-server answers ``/healthz`` ok (JetStream current with the cluster)."""
        body = http_json(f"http://{self.addr(host)}:{servers.NATS_MONITOR_PORT}/healthz")
        return isinstance(body, dict) and body.get("status") == "ok"

    def gateway_ready(self, index: int) -> bool:
        """Gateway ``index`` answers ``/readyz`` 200."""
        try:
            with urllib.request.urlopen(self.gateway_urls()[index] + "/readyz", timeout=1.0,  # noqa: S310
                                        context=self.client_ssl()) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    def active_scheduler(self) -> dict | None:
        """The election key's value of the active scheduler, None if none or etcd does not answer."""
        try:
            return asyncio.run(servers.registry_state(self.etcd_urls(), self.tls_files()))[0]
        except Exception:  # noqa: BLE001
            return None

    def steady_problem(self) -> str | None:
        """None when everything is back: every process running, every etcd member and nats-server
        healthy, an active scheduler that is one of ours, both workers registered (their current pids),
        every gateway ready and answering a probe completion; else what is still wrong."""
        for p in self.procs.values():
            if not p.running:
                return f"{p.name} not running"
        for h in HOSTS:
            if not self.etcd_healthy(h):
                return f"etcd on {h} not healthy"
            if not self.nats_healthy(h):
                return f"nats on {h} not healthy"
        try:
            holder, workers = asyncio.run(servers.registry_state(self.etcd_urls(), self.tls_files()))
        except Exception as e:  # noqa: BLE001
            return f"registry: {e!r}"
        ours = {p.pid for p in self.procs.values() if p.kind == "scheduler"}
        if holder is None or holder.get("pid") not in ours:
            return f"no live active scheduler ({holder})"
        live = {p.pid for p in self.procs.values() if p.kind == "worker"}
        registered = {w.get("pid") for w in workers.values()}
        if not live <= registered:
            return f"workers {sorted(live - registered)} not registered"
        for i in range(len(GATEWAYS)):
            problem = servers.probe(self.gateway_urls()[i], self.key, MODEL, verify=self.client_ssl())
            if problem:
                return f"gateway-{i}: {problem}"
        return None
