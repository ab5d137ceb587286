"""A scheduler SIGTERMed during its start-up exits (a version registered and retired at once; found by a
fresh-user trial: the scheduler went on to become active and never exited, and ``up`` waited 15 s for it
before SIGKILL and before starting the next version's scheduler). On Python 3.11 ``asyncio.wait_for`` can
drop a cancel that arrives as its inner call completes (cpython#86296); the registry's calls were bounded by
it (control/state/registry.py ``_call`` now uses ``asyncio.timeout``). Before that fix 14 of 16 schedulers
SIGTERMed right at start never exited.

Real nats-server and etcd (the session's ``infra``); only the processes this test starts are signalled.
Cost: about 3 s.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_scheduler_sigtermed_at_start_exits_promptly(infra, tmp_path):
    for i in range(3):
        log = tmp_path / f"s{i}.log"
        with open(log, "w") as out:
            p = subprocess.Popen([sys.executable, "-m", "control.ops.cli", "actor", "scheduler", "--model",
                                  f"sigterm-at-start@{i}", "--etcd", infra.etcd_url, "--nats", infra.nats_url,
                                  "--state-dir", str(infra.state_dir)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            t_end = time.monotonic() + 30
            while "metrics on" not in log.read_text():  # its main task runs: the start-up steps follow
                assert time.monotonic() < t_end and p.poll() is None, log.read_text()
                await asyncio.sleep(0.01)
            p.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(p.wait, 10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        assert rc == 0, log.read_text()

