"""Process hardening of ``actorserve up`` (issue 21 item 4), the cheap parts, without a stack:

* children die with their parent, even by SIGKILL, even when the thread that started them exited
  (actors/lifeline.py: ``PR_SET_PDEATHSIG`` from one long-lived spawner thread); a real
  nats-server too; a Python actor also watches ``ACTORSERVE_PARENT_PID`` (actors/runtime.py);
* ``up`` refuses to start over a stack left behind (live pids of ``pids.json``, or answering
  ``endpoints.json`` ports), in one line saying how to stop it;
* stopping runs in parallel waves under one deadline (control/ops/supervisor_processes.py ``terminate``);
* the restart rule: an actor that exits after a stop it was asked for stays stopped, a crash restarts.

Cost: about 6 s in all (process starts and bounded waits). Only processes these tests start are signalled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors import lifeline
from control.ops.supervisor_processes import ActorProcess, stopped_on_request, terminate

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pid: int, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not _alive(pid):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


_PARENT = r"""
import sys, threading, time
sys.path.insert(0, {repo!r})
from actors import lifeline
out = {{}}
def spawn():  # from a thread that exits right after: PDEATHSIG must not fire then
    out["p"] = lifeline.popen(["sleep", "60"], start_new_session=True)
t = threading.Thread(target=spawn); t.start(); t.join()
{extra}
print(out["p"].pid, flush=True)
time.sleep(60)
"""


def _parent(extra: str = "") -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", _PARENT.format(repo=str(REPO), extra=extra)],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = p.stdout.readline()
    assert line.strip(), "parent printed no child pid"
    return p, int(line.split()[0])


def test_child_survives_its_spawning_thread_and_dies_with_its_parent():
    parent, child = _parent()
    try:
        time.sleep(0.3)
        assert _alive(child), "the child died when the thread that started it exited"
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait(5)
        assert _wait_gone(child, 3.0) is not None, "child outlived its SIGKILLed parent"
    finally:
        for pid in (parent.pid, child):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_embedded_nats_server_dies_with_its_parent(tmp_path):
    extra = (f"from control.ops.embedded_nats import EmbeddedNats\n"
             f"import asyncio\nsrv = EmbeddedNats({str(tmp_path)!r})\nasyncio.run(srv.astart())\n"
             f"print(srv.pid, flush=True)")
    parent, _sleep = _parent(extra)
    nats_pid = None
    try:
        nats_pid = int(parent.stdout.readline().split()[0])
        assert _alive(nats_pid)
        parent.kill()
        parent.wait(5)
        assert _wait_gone(nats_pid, 5.0) is not None, "nats-server outlived its SIGKILLed parent"
    finally:
        for pid in (parent.pid, _sleep, nats_pid):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def test_actor_runtime_drains_when_its_parent_is_gone(monkeypatch):
    """ACTORSERVE_PARENT_PID names a process that is not our parent: the run loop drains within ~1 s."""
    from actors import runtime

    monkeypatch.setenv(runtime.ENV_PARENT_PID, str(os.getppid() + 1 if os.getppid() > 1 else 999999))
    monkeypatch.setattr(runtime, "PARENT_POLL_S", 0.1)
    monkeypatch.setattr(runtime, "setup_logging", lambda *a, **k: None)
    drained = []

    async def main(_args):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            drained.append(True)
            raise

    t0 = time.monotonic()
    assert runtime.run_actor_main(main, argparse.Namespace(log_level="WARNING"), kind="t") == 0
    assert drained and time.monotonic() - t0 < 3


# -- up over a stack left behind ------------------------------------------------------------------


def test_up_refuses_over_orphaned_processes(tmp_path):
    from control.ops.supervisor import Supervisor, SupervisorError
    from control.ops.stack_config import StackConfig

    state = tmp_path / "state"
    state.mkdir()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--state-dir", str(state)],
                              start_new_session=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (state / "pids.json").write_text(json.dumps({"supervisor": dead.pid, "worker-0": orphan.pid,
                                                      "gateway-0": os.getpid()}))
        sup = Supervisor(StackConfig(state, port=0))
        with pytest.raises(SupervisorError) as err:
            sup.start()
        sup.stop()
        msg = str(err.value)
        assert "\n" not in msg and f"worker-0 {orphan.pid}" in msg and f"kill -TERM -- -{orphan.pid}" in msg
        assert "gateway-0" not in msg  # a live pid whose argv does not name the state dir is not ours
        assert _alive(orphan.pid)  # nothing was signalled
        # via the CLI: exit status 1, one line on stderr
        out = subprocess.run([sys.executable, "-m", "control.ops.cli", "up", "--state-dir", str(state), "--port", "0"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("actorserve: startup failed")]
        assert len(lines) == 1 and "still running" in lines[0] and "kill -TERM" in lines[0], out.stderr
    finally:
        orphan.kill()
        orphan.wait()


def test_up_refuses_when_the_endpoints_still_answer(tmp_path):
    from control.ops.supervisor import Supervisor, SupervisorError
    from control.ops.stack_config import StackConfig

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "pids.json").write_text(json.dumps({"supervisor": dead.pid, "nats": dead.pid}))  # left by a SIGKILL
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        endpoints = json.dumps({"nats_url": f"nats://op:secret@127.0.0.1:{port}", "etcd_url": "http://127.0.0.1:1"})
        (tmp_path / "endpoints.json").write_text(endpoints)
        clean = tmp_path / "clean"
        clean.mkdir()
        (clean / "endpoints.json").write_text(endpoints)
        assert lifeline.live_stack(clean) is None  # no pids.json: the last up stopped cleanly, ports not looked at
        sup = Supervisor(StackConfig(tmp_path, port=0))
        with pytest.raises(SupervisorError, match="still answer") as err:
            sup.start()
        sup.stop()
        assert "secret" not in str(err.value) and "\n" not in str(err.value)
    assert lifeline.live_stack(tmp_path) is None  # once the port closed


# -- parallel stop ---------------------------------------------------------------------------------

_DRAINS_1S = 'trap "sleep 1; exit 0" TERM; while true; do sleep 0.05; done'
_IGNORES_TERM = 'trap "" TERM; while true; do sleep 0.05; done'


def _procs(tmp_path, script: str, kinds: list[str]) -> list[ActorProcess]:
    out = []
    for i, kind in enumerate(kinds):
        a = ActorProcess(f"{kind}-{i}", kind, ["sh", "-c", script], tmp_path / f"{i}.log")
        a.proc = subprocess.Popen(a.argv, start_new_session=True)
        out.append(a)
    time.sleep(0.3)  # the traps are set
    return out


def test_stop_drains_every_process_of_a_wave_at_once(tmp_path):
    group = _procs(tmp_path, _DRAINS_1S, ["worker"] * 8)
    t0 = time.monotonic()
    terminate(group, 10.0, (("gateway",), ("worker",)))
    took = time.monotonic() - t0
    assert all(a.proc.returncode == 0 for a in group)
    assert took < 3.0, f"8 processes draining 1 s each took {took:.1f} s (one after another: 8 s)"


def test_stop_takes_at_most_the_deadline_however_many_waves(tmp_path):
    group = _procs(tmp_path, _IGNORES_TERM, ["gateway", "gateway", "scheduler", "validator", "worker", "worker"])
    t0 = time.monotonic()
    terminate(group, 2.0, (("gateway",), ("validator", "scheduler"), ("worker",)), gap_s=1.5)
    took = time.monotonic() - t0
    assert all(a.proc.returncode == -signal.SIGKILL for a in group)
    assert took < 3.0, f"stop took {took:.1f} s with a 2 s deadline"


# -- the restart rule ------------------------------------------------------------------------------


def test_restart_rule_statuses():
    assert stopped_on_request(0) and stopped_on_request(143) and stopped_on_request(-signal.SIGTERM)
    assert not stopped_on_request(1) and not stopped_on_request(-signal.SIGKILL)
    assert not stopped_on_request(-signal.SIGSEGV) and not stopped_on_request(None)


def test_supervisor_keeps_an_operator_stopped_actor_stopped_and_restarts_a_crash(tmp_path):
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    sup = Supervisor(StackConfig(tmp_path, port=0, watch_registry=False))
    stopped = ActorProcess("worker-0", "worker", [sys.executable, "-c", "pass"], tmp_path / "w0.log")
    crashed = ActorProcess("worker-1", "worker", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path / "w1.log")
    spawned = []
    sup.procs.spawn = lambda a: spawned.append(a.name) or setattr(a, "proc", subprocess.Popen(["sleep", "30"]))
    sup.procs.actors = [stopped, crashed]
    try:
        for a in sup.actors:
            a.proc = subprocess.Popen(a.argv)
            a.proc.wait(10)
        assert sup.health.supervise_once()
        assert spawned == ["worker-1"] and stopped.stopped_by == "operator" and crashed.stopped_by is None
        assert sup.stopped_by_operator == ["worker-0"]
        pids = json.loads((tmp_path / "pids.json").read_text())
        assert pids["stopped"] == {"worker-0": {"by": "operator", "status": 0}} and "worker-1" in pids
        assert sup.health.supervise_once() and spawned == ["worker-1"]  # still not restarted
        assert any("stopped by operator" in e for e in sup.events)
        assert sup.start_stopped() == ["worker-0"] and spawned == ["worker-1", "worker-0"]
        assert sup.stopped_by_operator == []
    finally:
        for a in sup.actors:
            if a.proc is not None and a.proc.poll() is None:
                a.proc.kill()
                a.proc.wait()
        (tmp_path / "pids.json").unlink(missing_ok=True)
