"""A real 3-member etcd cluster on loopback ports and the registry's multi-member URL
(``http://a,http://b,http://c``; control/state/etcd_client.py): when one member dies (here the
leader, the harder case: the cluster also elects a new one), put/get, a watch that was open on it,
a lease keepalive and an election's holder all carry on without the caller doing anything.

Cost: about 5-8 s (three etcd processes, a 1 s election timeout).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from control.ops.embedded_server import find_binary
from control.ops.ports import LOOPBACK, free_ports
from control.state.election import campaign
from control.state.etcd_client import parse_etcd_urls
from control.state.registry import Registry


class EtcdCluster:
    """``n`` etcd members on loopback (own process groups, data under ``root``); ``kill(i)`` SIGKILLs one."""

    def __init__(self, root, n: int = 3, extra_args: list[str] | None = None, scheme: str = "http") -> None:
        self.root, self.n, self.scheme = root, n, scheme
        ports = free_ports(2 * n)
        self.client_ports, self.peer_ports = ports[:n], ports[n:]
        self.extra_args = extra_args or []
        self.procs: list[subprocess.Popen | None] = [None] * n

    def client_url(self, i: int) -> str:
        return f"{self.scheme}://{LOOPBACK}:{self.client_ports[i]}"

    @property
    def url(self) -> str:
        """Every member's client URL, comma-separated."""
        return ",".join(self.client_url(i) for i in range(self.n))

    def start(self) -> "EtcdCluster":
        binary = find_binary("etcd")
        peers = ",".join(f"m{i}={self.scheme}://{LOOPBACK}:{p}" for i, p in enumerate(self.peer_ports))
        for i in range(self.n):
            peer = f"{self.scheme}://{LOOPBACK}:{self.peer_ports[i]}"
            argv = [binary, "--name", f"m{i}", "--data-dir", str(self.root / f"m{i}"),
                    "--listen-client-urls", self.client_url(i), "--advertise-client-urls", self.client_url(i),
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", peers, "--initial-cluster-state", "new",
                    "--initial-cluster-token", "test-cluster",
                    "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn",
                    *self.extra_args]
            log = open(self.root / f"m{i}.log", "ab")
            self.procs[i] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        return self

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        self.procs[i] = None

    def stop(self) -> None:
        for i in range(self.n):
            self.kill(i)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=0.5) as r:  # noqa: S310 (loopback)
            return b'"true"' in r.read()
    except OSError:
        return False


@pytest.fixture
def cluster(tmp_path):
    c = EtcdCluster(tmp_path).start()
    try:
        deadline = time.monotonic() + 20
        while not all(_healthy(c.client_url(i)) for i in range(c.n)):
            assert time.monotonic() < deadline, "etcd cluster did not become healthy in 20 s"
            assert all(p.poll() is None for p in c.procs), "an etcd member exited at start"
            time.sleep(0.1)
        yield c
    finally:
        c.stop()


async def _leader_index(cluster: EtcdCluster) -> int:
    """Index of the member that is the raft leader (member names are m0, m1, ...)."""
    async with Registry.connect(cluster.url, timeout=3.0) as reg:
        st = await reg.client.status()
    assert st.leader is not None, "the cluster has no leader"
    return int(st.leader.name[1:])


def test_parse_multi_member_urls():
    e = parse_etcd_urls("http://10.0.0.1:2379, http://10.0.0.2:2379,http://10.0.0.3:2379")
    assert e.members == (("10.0.0.1", 2379), ("10.0.0.2", 2379), ("10.0.0.3", 2379))
    assert e.grpc_target() == "ipv4:10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    assert parse_etcd_urls("https://a:1,https://b:2").tls
    assert parse_etcd_urls("localhost:2379").grpc_target() == "dns:///localhost:2379"
    assert parse_etcd_urls("http://[::1]:2379,http://[::1]:2380").grpc_target() == "ipv6:[::1]:2379,[::1]:2380"
    for bad, what in (("http://a:1,https://b:2", "mixes"), ("ftp://a:1", "scheme"), ("http://a", "host:port"),
                      (" , ", "no member"), ("", "empty")):
        with pytest.raises(ValueError, match=what):
            parse_etcd_urls(bad)


@pytest.mark.asyncio
async def test_registry_survives_losing_the_leader_member(cluster):
    async with Registry.connect(cluster.url, timeout=5.0) as reg:
        await reg.put_json("/actorserve/test/a", {"n": 1})
        assert await reg.get_json("/actorserve/test/a") == {"n": 1}

        events: asyncio.Queue = asyncio.Queue()

        async def watch():
            async for ev in reg.watch_prefix("/actorserve/test/w/", retry_delay=0.1, max_retry_delay=0.3):
                await events.put(ev)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.sleep(0.3)
            await reg.put_json("/actorserve/test/w/1", {"n": 1})
            assert await asyncio.wait_for(events.get(), 5) == ("put", "/actorserve/test/w/1", {"n": 1})
            lease = await reg.put_leased("/actorserve/test/leased", {"w": 1}, ttl=2)
            held = await asyncio.wait_for(campaign(reg, "/actorserve/test/elect", {"id": "me"}, ttl=2), 5)

            victim = await _leader_index(cluster)
            cluster.kill(victim)
            t0 = time.monotonic()

            # put/get right away: no caller-side retry (the channel's retries and round robin do it)
            await reg.put_json("/actorserve/test/a", {"n": 2})
            assert await reg.get_json("/actorserve/test/a") == {"n": 2}
            first_write_s = time.monotonic() - t0
            await reg.put_json("/actorserve/test/w/2", {"n": 2})
            assert await asyncio.wait_for(events.get(), 8) == ("put", "/actorserve/test/w/2", {"n": 2})

            await asyncio.sleep(2.5)  # more than a lease TTL: the keepalives must have reached a live member
            assert not lease.lost.is_set() and not held.lost.is_set()
            assert (await reg.get_json_lease("/actorserve/test/leased"))[1] == lease.lease_id
            value, lease_id = await reg.get_json_lease("/actorserve/test/elect")
            assert value == {"id": "me"} and lease_id == held.lease_id
            assert first_write_s < 5.0, f"first write after the member loss took {first_write_s:.1f} s"
            await lease.revoke()
            await held.revoke()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
