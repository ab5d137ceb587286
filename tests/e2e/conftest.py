"""End-to-end fixtures: the whole platform as real OS processes (``control.ops.supervisor.Supervisor``).

``stack``: one session-wide deployment serving the default model (SmolLM2-135M-Instruct), real
nats-server and etcd on free loopback ports. Every process it starts is recorded and stopped at the
end of the session; tests that kill a process kill only pids they started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_fixtures import write_tiny_llama_gguf


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """The default deployment: 1 gateway, validator, scheduler, worker (SmolLM2)."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    # watch_registry=False: tests on this stack register tiny@1 and start its actors themselves.
    sup = Supervisor(StackConfig(
        tmp_path_factory.mktemp("e2e-state"), port=0, supervise=False, watch_registry=False,
        # float32 pinned: texts asserted here (e.g. "Paris") sit on near-ties of the default
        # bfloat16+int4 path (first token: float32 top-2 gap 0.09; decision 0028)
        actor_args={"worker": ["--kv-cache-bytes", str(128 * 1024 * 1024), "--dtype", "float32",
                               "--quantization", "none"]}))
    sup.start()
    try:
        sup.wait_ready(timeout=240)
        yield sup
    finally:
        sup.stop()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a tiny random-weight Llama GGUF (fast to load; output is noise)."""
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_tiny_llama_gguf(path)
    return path


class ActorProcs:
    """Extra actor processes started by one test; ``stop_all`` ends exactly those (recorded pids)."""

    def __init__(self, sup, log_dir: Path) -> None:
        self.sup, self.log_dir, self.procs = sup, log_dir, {}

    def start(self, label: str, *argv: str) -> subprocess.Popen:
        """``python -m control.ops.cli actor ...`` against the stack's NATS and etcd."""
        cmd = [sys.executable, "-m", "control.ops.cli", "actor", *argv, "--nats", self.sup.nats_url,
               "--etcd", self.sup.etcd_url]
        log = open(self.log_dir / f"{label}.log", "wb")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ})
        self.procs[label] = p
        return p

    def stop_all(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        t_end = time.time() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, t_end - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def actor_procs(stack, tmp_path):
    procs = ActorProcs(stack, tmp_path)
    yield procs
    procs.stop_all()
