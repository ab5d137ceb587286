"""``actorserve up`` as a user runs it: ready, README curl example answers, SIGTERM leaves no process; an
actor the operator SIGTERMs stays stopped (``status`` says so); stopping is bounded (parallel drain)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from control.ops.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _procs_mentioning(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (the unique state dir of this test)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in d.joinpath("cmdline").read_bytes().decode(errors="replace") and _alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def test_up_then_sigterm_leaves_nothing(tmp_path, tiny_gguf):
    state, port = tmp_path / "state", free_port()
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "control.ops.cli", "up", "--state-dir", str(state), "--port", str(port),
                           "--model-file", tiny_gguf, "--model-name", "tiny"], cwd=REPO, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t_end = time.time() + 120
        while not _ready(port):
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.time() < t_end, "not ready in 120 s"
            time.sleep(0.5)
        pids = json.loads((state / "pids.json").read_text())
        assert {"nats", "etcd"} <= set(pids) and any(k.startswith("worker") for k in pids)
        assert json.loads((state / "endpoints.json").read_text())["http_url"] == f"http://127.0.0.1:{port}"
        # The operator SIGTERMs the worker: it drains, exits 0 and is not restarted (issue 21, item 4).
        worker = pids["worker-0"]
        os.kill(worker, signal.SIGTERM)
        t_end = time.time() + 20
        while "worker-0" not in (json.loads((state / "pids.json").read_text()).get("stopped") or {}):
            assert time.time() < t_end, "worker-0 not recorded as stopped by the operator within 20 s"
            time.sleep(0.2)
        time.sleep(1.5)  # three monitor rounds: still not restarted
        now = json.loads((state / "pids.json").read_text())
        assert "worker-0" not in now and now["stopped"]["worker-0"] == {"by": "operator", "status": 0}
        st = subprocess.run([sys.executable, "-m", "control.ops.cli", "status", "--state-dir", str(state)], cwd=REPO,
                            capture_output=True, text=True, timeout=30)
        assert "worker-0" in st.stdout and "stopped by operator" in st.stdout, st.stdout
        # Stopping drains every actor in parallel waves: at most stop_timeout_s (15 s) + the servers.
        t0 = time.monotonic()
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        took = time.monotonic() - t0
        print(f"up stopped in {took:.1f} s")
        assert took <= 15 + 5, f"stopping took {took:.1f} s"
        time.sleep(0.5)
        assert [n for n, pid in pids.items() if _alive(pid)] == []
        assert _procs_mentioning(str(state)) == []
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_readme_curl_example_answers(stack):
    readme = (REPO / "README.md").read_text()
    cmd = next(line for line in readme.splitlines() if line.startswith("curl http://127.0.0.1:8000/v1/chat"))
    # The README exports OPENAI_API_KEY from <state-dir>/dev-api-key; the stack's state dir is not .actorserve.
    assert (stack.state_dir / "dev-api-key").read_text().strip() == stack.dev_api_key
    argv = [a.replace("$OPENAI_API_KEY", stack.dev_api_key)
            for a in shlex.split(cmd.replace("http://127.0.0.1:8000", stack.http_url))]
    assert any(a == f"Authorization: Bearer {stack.dev_api_key}" for a in argv)
    out = subprocess.run(argv + ["-sS", "--max-time", "60"], capture_output=True, text=True, check=True).stdout
    body = json.loads(out)
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
