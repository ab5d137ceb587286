"""The actor processes of ``actorserve up`` before they start: each one's name, argv, log file and
environment (:class:`ActorFactory`), for the processes the supervisor starts with the stack, those of a
model version registered later and the replicas a desired count adds.

Every actor runs as ``python -m control.ops.cli actor KIND ...`` in its own process group. The version
registered at start keeps the names ``scheduler-0`` / ``worker-<n>``; any other gets
``scheduler-<name>-<version>`` / ``worker-<name>-<version>-<n>`` (also the worker ids).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from control.ops import supervisor_scaling as scaling
from control.ops.stack_config import StackConfig
from control.ops.supervisor_processes import ActorProcess

# Start order: the slow loaders first, the edges last. A kind missing from actors.kinds.ACTOR_MODULES
# (e.g. "rollout" before its actor exists) is skipped.
START_ORDER = ("worker", "scheduler", "validator", "jobs", "rollout", "autoscaler", "gateway")
# Actors that serve one model version (started and drained as versions come and go).
MODEL_KINDS = ("scheduler", "worker")

_REPO_ROOT = Path(__file__).resolve().parents[2]


class StackEndpoints(Protocol):
    """What the factory reads of the running stack (``Supervisor`` implements it)."""

    stack: Any  # control.ops.embedded.EmbeddedStack once started (etcd_url, nats_url, nats.role_url), else None
    gateway_ports: list[int]  # port of gateway n
    tls_dir: Path | None  # `up --tls`: the certificates, else None


class ActorFactory:
    """Builds (never starts) the :class:`ActorProcess` entries of one stack (module docstring)."""

    def __init__(self, cfg: StackConfig, endpoints: StackEndpoints) -> None:
        self.cfg, self.endpoints = cfg, endpoints

    def base_argv(self, kind: str) -> list[str]:
        """``python -m control.ops.cli actor KIND --etcd URL --state-dir DIR [--log-level L]``."""
        argv = [self.cfg.python, "-m", "control.ops.cli", "actor", kind,
                "--etcd", self.endpoints.stack.etcd_url, "--state-dir", str(self.cfg.state_dir)]
        if self.cfg.log_level:
            argv += ["--log-level", self.cfg.log_level]
        return argv

    def initial(self) -> list[ActorProcess]:
        """The actors started with the stack, in START_ORDER: the registered version's workers and scheduler,
        a validator, jobs (and rollout), the autoscaler when asked for, the gateways."""
        from actors.kinds import ACTOR_MODULES

        cfg, actors = self.cfg, []
        for kind in START_ORDER:
            if kind not in ACTOR_MODULES:
                continue
            if kind in MODEL_KINDS:
                actors += [a for a in self.version_actors(cfg.model_ref, cfg.workers) if a.kind == kind]
            elif kind == "validator":
                actors.append(self.validator(0))
            elif kind == "autoscaler":
                if cfg.autoscaler:
                    actors.append(self.actor(kind, 0, self.base_argv(kind) + scaling.autoscaler_limits_argv(
                        cfg.cores, cfg.workers, cfg.gateways, pool=cfg.pool, hosts=cfg.multi_model)))
            elif kind in ("jobs", "rollout"):
                actors.append(self.actor(kind, 0, self.base_argv(kind)))
            else:
                for n in range(cfg.gateways):
                    argv = self.base_argv(kind) + ["--host", cfg.host, "--port", str(self.endpoints.gateway_ports[n]),
                                                   "--gateway-id", f"gw-{n}"]
                    actors.append(self.actor(kind, n, argv))
        return actors

    def actor(self, kind: str, n: int, argv: list[str]) -> ActorProcess:
        """``<kind>-<n>`` running ``argv``."""
        return self.named(f"{kind}-{n}", kind, argv)

    def named(self, name: str, kind: str, argv: list[str], model: str | None = None) -> ActorProcess:
        """``name`` running ``argv`` plus the kind's extra argv (``actor_args``), logging to ``logs/<name>.log``."""
        return ActorProcess(name, kind, argv + self.cfg.actor_args.get(kind, []), self.cfg.logs_dir / f"{name}.log",
                            model=model)

    def version_actors(self, ref: str, workers: int) -> list[ActorProcess]:
        """The scheduler and ``workers`` workers of model version ``ref``, workers first (``multi_model``: a
        version registered later gets its scheduler only; the hosts load it on demand)."""
        name, _, version = ref.partition("@")
        initial = ref == self.cfg.model_ref
        workers = 0 if self.cfg.multi_model and not initial else workers
        out = [self.worker(ref, n, self.cfg.pool) for n in range(workers)]
        sname = "scheduler-0" if initial else f"scheduler-{name}-{version}"
        out.append(self.named(sname, "scheduler", self.base_argv("scheduler") + ["--model", ref], model=ref))
        return out

    def worker_prefix(self, ref: str) -> str:
        """Name prefix of version ``ref``'s workers (``worker-`` or ``worker-<name>-<version>-``)."""
        name, _, version = ref.partition("@")
        return "worker-" if ref == self.cfg.model_ref else f"worker-{name}-{version}-"

    def worker(self, ref: str, n: int, pool: str) -> ActorProcess:
        """Worker ``n`` of version ``ref`` on ``pool``; ``--pool`` when the worker has the option."""
        wid = f"{self.worker_prefix(ref)}{n}"
        argv = self.base_argv("worker") + ["--model", ref, "--worker-id", wid] + ["--host"] * self.cfg.multi_model
        if scaling.kind_accepts("worker", "--pool"):
            argv += ["--pool", pool]
        a = self.named(wid, "worker", argv, model=ref)
        a.pool = pool
        return a

    def validator(self, n: int) -> ActorProcess:
        """Validator ``n`` (``validator-<n>``)."""
        return self.actor("validator", n, self.base_argv("validator"))

    def env(self, kind: str | None = None) -> dict[str, str]:
        """The environment of an actor of ``kind``: this one's plus ``env``, the state directory, its NATS
        role's URL (with its password: in the environment, not argv), the operator token for gateways only,
        its TLS files, and a PYTHONPATH that imports this checkout."""
        env = dict(os.environ)
        env.update(self.cfg.env)
        env["PYTHONUNBUFFERED"] = "1"
        env["ACTORSERVE_STATE_DIR"] = str(self.cfg.state_dir)
        stack = self.endpoints.stack
        if stack is not None:
            from control.ops.nats_roles import KIND_ROLES
            role = KIND_ROLES.get(kind or "")
            env["ACTORSERVE_NATS"] = stack.nats.role_url(role) if role else stack.nats_url
        from bus.nats_auth import OPERATOR_TOKEN_ENV, operator_token
        env.pop(OPERATOR_TOKEN_ENV, None)  # only gateways get the operator token (their /metrics checks it)
        if kind == "gateway":
            env[OPERATOR_TOKEN_ENV] = operator_token(self.cfg.state_dir)
        if self.endpoints.tls_dir is not None:  # the CA and the role's client certificate (gateways: + HTTPS)
            from control.ops.tls_stack import child_tls_env
            env.update(child_tls_env(self.endpoints.tls_dir, kind))
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(_REPO_ROOT) not in parts:  # `python -m control.ops.cli` imports this checkout, installed or not
            env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *parts])
        return env
