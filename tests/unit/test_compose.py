"""docker-compose.yml cannot run here (no container engine): check it against the CLI instead."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from control.ops.cli import ACTOR_MODULES, build_parser  # noqa: E402

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _services() -> dict:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "compose file has no services"
    return data["services"]


def _actorserve_commands() -> list[tuple[str, list[str]]]:
    out = []
    for name, svc in _services().items():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd and cmd[0] == "actorserve":
            out.append((name, [str(c) for c in cmd]))
    return out


def test_compose_has_infrastructure_and_every_actor():
    services = _services()
    assert services["nats"]["image"].startswith("nats:2.10")
    assert "-js" in services["nats"]["command"]
    assert services["etcd"]["image"].startswith("quay.io/coreos/etcd:v3.5")
    kinds = {cmd[2] for _, cmd in _actorserve_commands() if cmd[1] == "actor"}
    assert kinds == set(ACTOR_MODULES), f"missing actor services: {set(ACTOR_MODULES) - kinds}"
    for name, cmd in _actorserve_commands():
        assert services[name]["image"] == "actorserve:latest", name
    init = dict(_actorserve_commands())["init"]
    assert init[1:3] == ["models", "register-default"]


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
        # Containers must talk to the compose services, never to a local state dir.
        assert args.nats == "nats://nats:4222" and args.etcd == "http://etcd:2379", service
