"""Supervisor restarts a dead embedded server (etcd, nats-server) on its ports, within the restart budget
(``HealthMonitor.restart_servers``, control/ops/supervisor_health.py); fakes stand in for the server processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from control.ops.supervisor import Supervisor
from control.ops.stack_config import StackConfig


class FakeServer:
    """What restart_servers reads of a control.ops.embedded server: name, port, pid, running, start()."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.port, self.pid, self.running, self.fail = name, 4222, 123, True, fail
        self.log_path = Path(f"/nonexistent/{name}.log")
        self.returncode = -9
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        if self.fail:
            raise RuntimeError("port taken\nmore")
        self.running = True


def supervisor(tmp_path, **kw) -> Supervisor:
    sup = Supervisor(StackConfig(tmp_path, port=0, **kw))
    sup.stack = SimpleNamespace(etcd=FakeServer("etcd"), nats=FakeServer("nats"))
    return sup


def test_dead_server_restarted_live_one_left_alone(tmp_path):
    sup = supervisor(tmp_path)
    assert sup.health.restart_servers() is False
    sup.stack.nats.running = False
    assert sup.health.restart_servers() is True
    assert (sup.stack.nats.starts, sup.stack.etcd.starts) == (1, 0)
    assert any("nats exited with status -9; restarting on port 4222" in e for e in sup.events)


def test_restart_budget_then_give_up(tmp_path):
    sup = supervisor(tmp_path, max_restarts=2, restart_window_s=60)
    sup.stack.etcd.fail = True
    sup.stack.etcd.running = False
    for _ in range(4):
        assert sup.health.restart_servers() is False
    assert sup.stack.etcd.starts == 2
    assert "etcd" in sup.health.servers_given_up and any("giving up on it" in e for e in sup.events)


def test_nothing_while_stopping(tmp_path):
    sup = supervisor(tmp_path)
    sup.stack.nats.running = False
    sup.procs.stopping = True
    assert sup.health.restart_servers() is False and sup.stack.nats.starts == 0
