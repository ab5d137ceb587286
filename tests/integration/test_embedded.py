import asyncio
import json
import os
import socket
import urllib.request

import pytest

from control.ops.embedded import EmbeddedEtcd, EmbeddedNats, read_endpoints, write_endpoints
from control.ops.ports import free_port, free_ports, port_open


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_free_port_is_bindable():
    p = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
    ports = free_ports(3)
    assert len(set(ports)) == 3


async def test_session_stack_answers(infra):
    import nats

    nc = await nats.connect(infra.nats_url, connect_timeout=5)
    try:
        js = nc.jetstream()
        info = await js.account_info()
        assert info is not None
        sub = await nc.subscribe("as.test.ping")
        await nc.publish("as.test.ping", b"hi")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"hi"
    finally:
        await nc.close()
    with urllib.request.urlopen(f"{infra.etcd_url}/health", timeout=5) as r:
        assert json.loads(r.read())["health"] == "true"
    eps = read_endpoints(infra.state_dir)
    assert eps["nats_url"] == infra.nats_url and eps["etcd_url"] == infra.etcd_url
    assert infra.nats_url.startswith("nats://127.0.0.1:")
    assert infra.etcd_url.startswith("http://127.0.0.1:")


async def test_start_stop_restart_leaves_no_process(tmp_path):
    nats_srv = EmbeddedNats(tmp_path)
    etcd_srv = EmbeddedEtcd(tmp_path)
    async with nats_srv, etcd_srv:
        nats_pid, etcd_pid = nats_srv.pid, etcd_srv.pid
        assert port_open(nats_srv.port)
        assert (tmp_path / "nats.pid").read_text().strip() == str(nats_pid)
        ports = (list(nats_srv.ports), list(etcd_srv.ports))
        # restart keeps ports and data
        await etcd_srv.arestart()
        await nats_srv.arestart()
        assert (nats_srv.ports, etcd_srv.ports) == tuple(ports)
        assert _pid_gone(nats_pid) and _pid_gone(etcd_pid)
        nats_pid, etcd_pid = nats_srv.pid, etcd_srv.pid
        with urllib.request.urlopen(f"{etcd_srv.url}/health", timeout=5) as r:
            assert json.loads(r.read())["health"] == "true"
        assert (tmp_path / "etcd").is_dir() and (tmp_path / "nats").is_dir()
    assert _pid_gone(nats_pid) and _pid_gone(etcd_pid)
    assert not nats_srv.running and not etcd_srv.running
    assert not (tmp_path / "nats.pid").exists()
    assert not port_open(nats_srv.port) and not port_open(etcd_srv.port)


def test_sync_api_and_kill(tmp_path):
    srv = EmbeddedNats(tmp_path)
    srv.start()
    try:
        pid = srv.pid
        srv.kill()
        assert _pid_gone(pid)
        srv.start()  # same port again after a crash
        assert port_open(srv.port)
    finally:
        srv.stop()
    assert _pid_gone(srv.pid)
    srv.stop()  # idempotent


def test_startup_failure_reports_log_tail(tmp_path):
    srv = EmbeddedEtcd(tmp_path, startup_timeout=10)
    srv.ports = [free_port(), free_port()]
    # Occupy the client port so etcd cannot bind it: restart-style start does not pick new ports.
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", srv.ports[0]))
        blocker.listen()
        with pytest.raises(RuntimeError, match="etcd") as ei:
            srv.start()
    assert "log tail" in str(ei.value)
    assert not srv.running


def test_endpoints_roundtrip(tmp_path):
    write_endpoints(tmp_path, "nats://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3")
    assert read_endpoints(tmp_path) == {
        "nats_url": "nats://127.0.0.1:1",
        "etcd_url": "http://127.0.0.1:2",
        "http_url": "http://127.0.0.1:3",
    }
    (tmp_path / "endpoints.json").write_text("[1]")
    with pytest.raises(ValueError):
        read_endpoints(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_endpoints(tmp_path / "nope")
