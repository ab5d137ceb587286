"""docker-compose.yml cannot run here (no container engine): check it against the CLI, the NATS roles and a
real ``nats-server -t`` instead (tests/cluster/test_compose_run.py runs it as local processes).

Cost: ~1-2 s (the CLI parser, one ``nats-server -t`` per case, no server started).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from control.ops.cli import ACTOR_MODULES, build_parser  # noqa: E402
from control.ops.embedded_server import find_binary  # noqa: E402
from control.ops.nats_roles import ROLES, role_of_kind  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


local_stack = _load("actorserve_local_stack", "deploy/compose/local_stack.py")
gen = _load("actorserve_gen_nats_conf", "deploy/gen_nats_conf.py")

VARS = {env: f"pw-{role}" for role, env in gen.password_envs().items()} | {"ACTORSERVE_OPERATOR_TOKEN": "tok"}


def _raw() -> dict:
    return local_stack.load_compose()


def _uncommented() -> str:
    return "\n".join(line for line in (ROOT / "docker-compose.yml").read_text().splitlines()
                     if not line.lstrip().startswith("#"))


def _services() -> dict:
    return local_stack.load_compose(variables=VARS)["services"]


def _actorserve_commands() -> list[tuple[str, list[str]]]:
    """(service, argv) of every `actorserve ...` run: the actorserve-image services' entrypoint + command,
    and each `actorserve` line of the init's shell script."""
    out = []
    for name, svc in _services().items():
        argv = local_stack.service_argv(svc)
        if argv[:1] == ["actorserve"]:
            out.append((name, argv))
        elif argv[:2] == ["/bin/sh", "-ec"]:
            for line in argv[2].splitlines():
                m = re.search(r"(?:^|\$\(|\s)(actorserve\s[^;>|&)]*)", line.strip())
                if m:
                    out.append((name, shlex.split(m.group(1).replace("$ACTORSERVE_TENANT", "demo"))))
    return out


def test_compose_has_infrastructure_and_every_actor():
    services = _services()
    assert services["nats"]["image"].startswith("nats:2.10")
    assert services["etcd"]["image"].startswith("quay.io/coreos/etcd:v3.5")
    kinds = {cmd[2] for _, cmd in _actorserve_commands() if cmd[1] == "actor"}
    assert kinds == set(ACTOR_MODULES), f"missing actor services: {set(ACTOR_MODULES) - kinds}"
    for name, _ in _actorserve_commands():
        assert services[name]["image"] == "actorserve:latest", name
    init = [cmd[1:] for name, cmd in _actorserve_commands() if name == "init"]
    assert ["models", "register-default"] in init
    assert any(c[:2] == ["tenants", "create"] for c in init), init
    assert local_stack.start_order(services)  # no cycle, no unknown dependency


@pytest.mark.parametrize("service,command", _actorserve_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_compose_command_parses(service, command):
    if command[1] == "actor":
        modname = ACTOR_MODULES.get(command[2])
        if modname is not None:
            try:
                importlib.import_module(modname)
            except ModuleNotFoundError as e:
                if e.name and modname.startswith(e.name):
                    pytest.skip(f"{modname} not written yet")
                raise
    try:
        args = build_parser().parse_args(command[1:])
    except SystemExit as e:
        pytest.fail(f"service {service!r}: `{' '.join(command)}` is rejected by the CLI (exit {e.code})")
    assert callable(args.func)
    if command[1] == "actor":
        # Containers talk to the compose services; the NATS URL (with the role's password) is in the environment.
        assert args.nats is None and args.etcd == "http://etcd:2379", service
        assert getattr(args, "metrics_port", None) == 9100, service


def test_actors_connect_as_their_role_user_from_the_environment():
    raw = _raw()["services"]
    for name, svc in _services().items():
        argv = local_stack.service_argv(svc)
        if argv[:2] != ["actorserve", "actor"]:
            continue
        role = role_of_kind(argv[2])
        env_var = gen.password_env(role)
        assert svc["environment"]["ACTORSERVE_NATS"] == f"nats://actorserve-{role}:pw-{role}@nats:4222", name
        # the password only ever comes from .env: a required (`:?`) compose variable, never a literal
        assert f"${{{env_var}:?" in raw[name]["environment"]["ACTORSERVE_NATS"], name
        assert not any("pw-" in a for a in argv), f"{name}: a password in argv"
    for var in gen.password_envs().values():  # nats-server resolves $VAR in nats.conf from its environment
        assert f"${{{var}:?" in raw["nats"]["environment"][var]


def test_no_secret_in_the_compose_file_in_clear():
    text = _uncommented()
    found = re.findall(r"^\s*([A-Z_]*(?:PASSWORD|TOKEN)[A-Z_]*):\s*(\S+)", text, re.M)
    assert len(found) >= len(ROLES) + 2
    for key, value in found:
        assert value.startswith("${"), f"{key} is set in clear: {value}"


def test_make_env_writes_every_secret_compose_needs():
    out = subprocess.run(["sh", str(ROOT / "deploy/compose/make-env.sh")], capture_output=True, text=True,
                         check=True, timeout=10).stdout
    env = dict(line.split("=", 1) for line in out.splitlines())
    needed = set(re.findall(r"\$\{([A-Z_]+):\?", _uncommented()))
    assert needed <= set(env), needed - set(env)
    # URL-safe (they go into nats:// URLs) and starting with a letter: nats-server parses a variable's value as
    # a config token, so "2026-..." would be a date and "12e4..." a number (see the nats-server test below)
    assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{23,}", env[k]) for k in needed), "weak, not URL-safe or digit-led"
    again = dict(line.split("=", 1) for line in subprocess.run(
        ["sh", str(ROOT / "deploy/compose/make-env.sh")], capture_output=True, text=True, timeout=10).stdout.splitlines())
    assert all(env[k] != again[k] for k in needed), "make-env.sh must draw fresh secrets"


def test_nats_conf_is_generated_from_the_roles():
    assert gen.COMPOSE_CONF not in gen.stale(), "deploy/compose/nats.conf is stale: run deploy/gen_nats_conf.py"
    conf = gen.COMPOSE_CONF.read_text()
    for role in ROLES:
        assert f'"actorserve-{role}"' in conf and f"${gen.password_env(role)}" in conf
    assert "max_payload: 8MB" in conf and "jetstream {" in conf


def _nats_test(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([find_binary("nats-server"), "-t", *argv[1:]], env=env, capture_output=True, text=True,
                          timeout=10)


def test_nats_service_command_and_config_are_valid_for_nats_server(tmp_path):
    stack = local_stack.LocalCompose(tmp_path, VARS)
    argv = stack.command("nats")
    env = stack.environment("nats")
    ok = _nats_test(argv, env)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    # the check can fail: the old command line (a config-file key given as a flag), a missing password
    assert "flag provided but not defined" not in ok.stderr
    bad = _nats_test(["nats-server", "-js", "-sd", str(tmp_path), "--max_payload", "8MB"], env)
    assert "flag provided but not defined: -max_payload" in bad.stderr  # (nats-server exits 0 there)
    missing = _nats_test(argv, {k: v for k, v in env.items() if k != gen.password_env("worker")})
    assert missing.returncode != 0 and gen.password_env("worker") in missing.stderr + missing.stdout
    # the passwords make-env.sh draws parse as strings; a digit-led one would not (why make-env.sh starts with a letter)
    drawn = dict(line.split("=", 1) for line in subprocess.run(
        ["sh", str(ROOT / "deploy/compose/make-env.sh")], capture_output=True, text=True, timeout=10).stdout.splitlines())
    real = _nats_test(argv, {**env, **{k: v for k, v in drawn.items() if k in env}})
    assert real.returncode == 0, real.stderr + real.stdout
    digit_led = _nats_test(argv, {**env, gen.password_env("worker"): "2026-01-01x"})
    assert digit_led.returncode != 0


def test_interpolation_and_loopback_rewrite(tmp_path):
    interp = local_stack.interpolate
    assert interp("a$$b ${X} $X ${Y:-d} ${Y-e}", {"X": "1"}) == "a$b 1 1 d e"
    assert interp("${Y:-d}", {"Y": ""}) == "d" and interp("${Y-d}", {"Y": ""}) == ""
    with pytest.raises(ValueError, match="Z"):
        interp("${Z:?set Z}", {})
    stack = local_stack.LocalCompose(tmp_path, VARS)
    gw = stack.command("gateway")
    assert gw[gw.index("--host") + 1] == "127.0.0.1"
    assert gw[gw.index("--port") + 1] == str(stack.port("gateway", 8000))
    assert stack.environment("gateway")["ACTORSERVE_NATS"] == (
        f"nats://actorserve-gateway:pw-gateway@127.0.0.1:{stack.port('nats', 4222)}")
    assert f"--store_dir {tmp_path}/volumes/nats-data" in " ".join(stack.command("nats"))
    assert str(stack.port("nats", 4222)) in stack.command("nats")
    ports = [stack.port(s, p) for s, p in stack.ports]
    assert len(ports) == len(set(ports)), "two services share a loopback port"


def test_gateway_is_published_on_loopback_only():
    for name, svc in _services().items():
        for p in svc.get("ports") or []:
            assert str(p).startswith("127.0.0.1:"), f"{name} publishes {p} beyond loopback"
    assert [str(p) for p in _services()["gateway"]["ports"]] == ["127.0.0.1:8000:8000"]
