"""A 3-member etcd cluster with mutual TLS (``actorserve certs`` files, control/ops/embedded.py
``etcd_tls_flags``) and the per-role RBAC of control/ops/etcd_auth.py, reached through the registry's
multi-member https URL: a role's certificate reads and writes its prefixes only, a client without a
certificate of the CA gets nothing, and losing a member changes neither (docs/security.md).

Cost: about 5-7 s (certificates, three etcd processes, auth setup).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.tls import TlsFiles
from control.ops.certs import ensure_certs
from control.ops.embedded import _https_health, etcd_tls_flags
from control.ops.etcd_auth import enable_rbac
from control.state.registry import Registry
from tests.integration.test_etcd_cluster import EtcdCluster


@pytest.fixture
def tls_cluster(tmp_path):
    certs = ensure_certs(tmp_path / "tls").directory
    c = EtcdCluster(tmp_path, extra_args=etcd_tls_flags(certs), scheme="https").start()
    try:
        deadline = time.monotonic() + 20
        while not all(_https_health(f"{c.client_url(i)}/health", certs) for i in range(c.n)):
            assert time.monotonic() < deadline, "TLS etcd cluster did not become healthy in 20 s"
            assert all(p.poll() is None for p in c.procs), "an etcd member exited at start"
            time.sleep(0.1)
        yield c, certs
    finally:
        c.stop()


async def _wait_for_leader(cluster, certs, timeout_s: float = 20.0) -> None:
    """Until the members left answer ``/health`` true (they have a leader again). Killing member 1 may kill
    the raft leader; on a loaded 2-core CI machine the election can outlast a 3 s request, and the server then
    ends reads with "context deadline exceeded". That latency is test_etcd_cluster.py's subject; this test's
    is what the certificates and roles may do with a member gone."""
    deadline = time.monotonic() + timeout_s
    alive = [i for i, p in enumerate(cluster.procs) if p is not None and p.poll() is None]
    while not all([await asyncio.to_thread(_https_health, f"{cluster.client_url(i)}/health", certs)
                   for i in alive]):
        assert time.monotonic() < deadline, f"the members left had no leader {timeout_s:g} s after the kill"
        await asyncio.sleep(0.1)


async def _denied(aw) -> bool:
    try:
        await aw
    except Exception as e:
        return "permission denied" in str(e)
    return False


@pytest.mark.asyncio
async def test_rbac_over_mutual_tls_survives_a_member_loss(tls_cluster):
    cluster, certs = tls_cluster
    root = TlsFiles.in_dir(certs, "root")
    assert await enable_rbac(cluster.url, root) is True
    assert await enable_rbac(cluster.url, root) is False  # already on: nothing to do
    async with Registry.connect(cluster.url, tls=root) as reg:
        await reg.put_json("/actorserve/tenants/t1", {"keys": []})
        await reg.put_json("/actorserve/models/m/versions/1", {"format": "gguf"})

    with pytest.raises(Exception):  # the CA but no client certificate: the handshake fails
        async with Registry.connect(cluster.url, tls=TlsFiles(ca=root.ca), timeout=2.0) as reg:
            await reg.get_json("/actorserve/models/m/versions/1")

    async with Registry.connect(cluster.url, tls=TlsFiles.in_dir(certs, "worker"), timeout=3.0) as w, \
            Registry.connect(cluster.url, tls=TlsFiles.in_dir(certs, "gateway"), timeout=3.0) as g:
        for phase in ("all members", "one member killed"):
            assert await w.get_json("/actorserve/models/m/versions/1") == {"format": "gguf"}, phase
            lease = await w.register_worker("m", "1", "w0", {"pool": "cpu"}, ttl=2)
            assert set(await g.list_workers("m", "1")) == {"w0"}, phase
            await lease.revoke()
            assert await _denied(w.list_tenants()), phase  # a worker never reads tenants (API key hashes)
            assert await _denied(w.put_json("/actorserve/models/m/routing", {"stable": "1"})), phase
            assert await _denied(g.put_json("/actorserve/tenants/t1", {"keys": ["x"]})), phase
            assert set(await g.list_tenants()) == {"t1"}, phase
            if phase == "all members":
                cluster.kill(1)
                await _wait_for_leader(cluster, certs)
