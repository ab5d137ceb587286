"""The ``actorserve`` command line.

Verbs::

    actorserve up [--state-dir DIR] [--host H] [--port P] [--gateways N] [--workers N] [--model-file PATH]
    actorserve actor {gateway,validator,scheduler,worker} [--nats URL] [--etcd URL] [actor options]
    actorserve models {register,list,show,retire,register-default} ...   (control/ops/models_cli.py)
    actorserve adapters {register,list,retire} ...   (control/ops/adapters_cli.py)
    actorserve status [--state-dir DIR] [--json]
    actorserve tenants {create,list,show,keys,set-quota,allow-models,priority,set-weight} ...
    actorserve rollout {start,set-weight,promote,rollback,status} NAME ...   (control/ops/rollout_cli.py)
    actorserve diagnose [--state-dir DIR | --etcd URL] [--json] [--window-s S]   (control/ops/diagnose_cli.py)
    actorserve autoscaler status [--json] [--last N]   (control/ops/autoscaler_cli.py)
    actorserve pools {set,list} ...   (control/ops/pools_cli.py)
    actorserve profile NAME@VERSION [--pool P] [--batches ...] [--prompts ...]   (control/ops/profile_cli.py)
    actorserve workers {list,preempt WORKER_ID [--in-s S]}   (control/ops/workers_cli.py)
    actorserve simulate [--inputs F] [--days 7] [--seed 0] [--policies NAMES] [--json PATH] [--plots DIR]
                                                    (control/ops/simulate_cli.py)
    actorserve deploy k8s [--worker NAME@VERSION[/POOL][=F:C] ...] [--out DIR]   (control/ops/k8s_render.py)

Exit statuses (control/ops/cli_errors.py): 0 done, 1 error, 2 usage or a refused edit, 3 stack
unreachable (no endpoint, or etcd / NATS / the metrics endpoints did not answer: one line on stderr, no
traceback), 130 interrupted.

Building the parser imports no actor module (``actorserve --help`` stays fast and torch-free); the
actor verbs load their module only when that verb is parsed (or its help is shown): the module's
``add_arguments(parser)`` adds its own options and ``main(args)`` runs under
:func:`actors.runtime.run_actor_main`. The CLI itself adds the common options (``--nats``,
``--etcd``, ``--state-dir``, ``--log-level``) and, for scheduler and worker, a required
``--model NAME@VERSION``; an actor module that adds one of these again is ignored for that option.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from actors.runtime import (DEFAULT_STATE_DIR, ENV_STATE_DIR, common_arguments, log_level_type,
                            metrics_arguments, resolve_endpoints, run_actor_main, state_dir_of)
from control.ops.argtypes import non_negative_int as _non_negative_int
from control.ops.extras import extra_of_module, missing_extra, missing_extra_line
from control.ops.cli_errors import (EXIT_UNREACHABLE, EXIT_USAGE, StackUnreachable, is_unreachable, report_unreachable,
                                    stdout_closed, unreachable_line)
from bus.nats_auth import redact_url
from control.ops.status_detail import worker_detail
from control.ops.argtypes import positive_int as _positive_int

PROG = "actorserve"

from actors.kinds import ACTOR_HELP, ACTOR_MODULES, MODEL_ACTORS  # noqa: E402,F401 (re-exported)


def model_version_ref(value: str) -> str:
    """argparse type for ``--model NAME@VERSION``: validates and returns the string unchanged."""
    from control.state.names import parse_model_ref

    try:
        ref = parse_model_ref(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if ref.version is None:
        raise argparse.ArgumentTypeError(f"{value!r} names no version: use NAME@VERSION (e.g. smollm2-135m-instruct@1)")
    if ref.adapter is not None:
        raise argparse.ArgumentTypeError(f"{value!r}: an adapter cannot be given here, use NAME@VERSION")
    return value


def _port(value: str) -> int:
    n = _non_negative_int(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port")
    return n


class _SkipKnownOptions:
    """Proxy handed to an actor module's ``add_arguments``: options the CLI already defines
    (``--nats``, ``--model``, ...) are skipped instead of raising a conflict; everything else
    goes to the real parser or group."""

    def __init__(self, target: Any, root: argparse.ArgumentParser) -> None:
        self._target = target
        self._root = root

    def add_argument(self, *names: str, **kwargs: Any) -> Any:
        if names and all(n.startswith("-") for n in names):
            if any(n in self._root._option_string_actions for n in names):
                return None
        return self._target.add_argument(*names, **kwargs)

    def add_argument_group(self, *args: Any, **kwargs: Any) -> "_SkipKnownOptions":
        return _SkipKnownOptions(self._target.add_argument_group(*args, **kwargs), self._root)

    def add_mutually_exclusive_group(self, *args: Any, **kwargs: Any) -> "_SkipKnownOptions":
        return _SkipKnownOptions(self._target.add_mutually_exclusive_group(*args, **kwargs), self._root)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class ActorParser(argparse.ArgumentParser):
    """Sub-parser of ``actorserve actor KIND`` that imports the actor's module on first use.

    The module is loaded (and its ``add_arguments`` applied) when this parser parses arguments
    or formats its help, so building the whole CLI parser imports no actor code.
    """

    def __init__(self, *args: Any, actor_kind: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.actor_kind = actor_kind
        self.actor_module: Any = None

    def load_actor(self) -> Any:
        """Import the actor module once, add its options; return the module (exits on error)."""
        if self.actor_module is None:
            modname = ACTOR_MODULES[self.actor_kind]
            try:
                module = importlib.import_module(modname)
            except ImportError as e:
                self.error(f"cannot load the {self.actor_kind} actor ({modname}): {e}")
            for attr in ("add_arguments", "main"):
                if not callable(getattr(module, attr, None)):
                    self.error(f"{modname} does not define {attr}()")
            module.add_arguments(_SkipKnownOptions(self, self))
            self.set_defaults(_actor_module=module)
            self.actor_module = module
        return self.actor_module

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):  # type: ignore[override]
        self.load_actor()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.load_actor()
        return super().format_help()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("actorserve")
    except Exception:  # not installed (running from a checkout)
        return "0.1.0"


def build_parser() -> argparse.ArgumentParser:
    """Build the ``actorserve`` argument parser (no actor module is imported here)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="actorserve: multi-tenant LLM serving from actors over NATS and etcd.",
        epilog="Run `actorserve up` to start everything locally, then use the OpenAI API at http://127.0.0.1:8000/v1.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_up_command(sub)
    _add_actor_command(sub)
    from control.ops.diagnose_cli import add_diagnose_command
    from control.ops.models_cli import add_models_commands
    from control.ops.rollout_cli import add_rollout_commands
    from control.ops.tenants_cli import add_tenant_commands

    add_models_commands(sub)
    from control.ops.adapters_cli import add_adapters_commands
    add_adapters_commands(sub)
    add_tenant_commands(sub)
    add_rollout_commands(sub)
    add_diagnose_command(sub)
    from control.ops.autoscaler_cli import add_autoscaler_command  # h2: `actorserve autoscaler status`
    add_autoscaler_command(sub)
    from control.ops.certs_cli import add_certs_command  # h3: `actorserve certs`, `etcd-auth` (docs/security.md)
    add_certs_command(sub)
    from control.ops.pools_cli import add_pools_command  # [13]: `actorserve pools set|list`
    from control.ops.profile_cli import add_profile_command  # [13]: `actorserve profile NAME@VERSION`
    add_pools_command(sub)
    add_profile_command(sub)
    from control.ops.workers_cli import add_workers_commands  # D: `actorserve workers list / preempt`
    add_workers_commands(sub)
    from control.ops.usage_cli import add_usage_command  # B: `actorserve usage` (docs/budgets.md)
    add_usage_command(sub)
    from control.ops.plan_cli import add_plan_command  # [14] S2: `actorserve plan --rate R ...`
    add_plan_command(sub)
    from control.ops.simulate_cli import add_simulate_command  # [14] S1: `actorserve simulate`
    add_simulate_command(sub)
    _add_status_command(sub)
    from control.ops.bench_cli import add_bench_commands  # `actorserve bench ...` (the bench extra)
    add_bench_commands(sub)
    from control.ops.k8s_render import add_deploy_command  # [27] 3: `actorserve deploy k8s` (KEDA)
    add_deploy_command(sub)
    return parser


def _add_up_command(sub: Any) -> None:
    """``actorserve up``: the embedded stack, supervised."""
    up = sub.add_parser(
        "up",
        help="start nats, etcd and every actor locally (supervised)",
        description="Start the embedded NATS and etcd servers and one process per actor, register the "
        "model, wait until the gateway is ready, and supervise until Ctrl-C.",
    )
    up.add_argument("--state-dir", metavar="DIR", default=None,
                    help=f"state directory (data, logs, endpoints.json; default: ${ENV_STATE_DIR} or {DEFAULT_STATE_DIR})")
    up.add_argument("--host", default="127.0.0.1", help="address the gateways bind (default: 127.0.0.1)")
    up.add_argument("--port", type=_port, default=8000,
                    help="port of the first gateway; gateway n listens on PORT+n (default: 8000; 0 = free ports)")
    up.add_argument("--gateways", type=_positive_int, default=1, metavar="N", help="number of gateways (default: 1)")
    up.add_argument("--workers", type=_positive_int, default=1, metavar="N", help="number of workers (default: 1)")
    up.add_argument("--model-file", metavar="PATH", default=None,
                    help="GGUF file or Hugging Face directory (config.json, *.safetensors, tokenizer.json) to serve "
                    "instead of the shipped SmolLM2-135M-Instruct Q4_1; format inferred as `models register` does")
    up.add_argument("--model-name", default="smollm2-135m-instruct", metavar="NAME",
                    help="model name to register (default: smollm2-135m-instruct)")
    up.add_argument("--context-length", type=_positive_int, default=None, metavar="N",
                    help="override the registered context length (default: 8192 for the shipped model, "
                    "else from the GGUF or config.json)")
    up.add_argument("--ready-timeout", type=float, default=180.0, metavar="S",
                    help="seconds to wait for the gateway's /readyz (default: 180)")
    for kind in ACTOR_MODULES:
        up.add_argument(f"--{kind}-args", metavar="ARGS", default=None,
                        help=f"extra options for every {kind} process, one shell-quoted string")
    up.add_argument("--sleep-horizon-s", type=float, default=0.0, metavar="S",  # issue [28]: docs/autoscaling.md
                    help="a worker the autoscaler scales down sleeps (KV cache freed, process and weights kept; "
                         "wakes in about a second) instead of exiting, and exits after S seconds asleep (default 0: "
                         "scale-down exits)")
    up.add_argument("--no-autoscaler", action="store_true",  # issue 19: docs/autoscaling.md
                    help="do not run the autoscaler (counts stay fixed unless /actorserve/desired/ records are "
                         "written by hand)")
    up.add_argument("--multi-model", action="store_true",  # issue [11]: docs/model-loading.md
                    help="the workers are multi-version hosts: a version registered later is loaded into them on "
                         "demand, within --worker-args '--memory-budget-bytes N' (default 80%% of memory), without "
                         "a new process; the autoscaler is off unless --lend")
    up.add_argument("--lend", action="store_true",  # issue [29]: docs/autoscaling.md "Lending across models"
                    help="with --multi-model: run the autoscaler on the hosts -- an idle version sleeps, and a "
                         "version short of replicas wakes its own sleeper or is loaded on a host where another "
                         "version sleeps (lent) instead of waiting for a cold start")
    up.add_argument("--tls", action="store_true",  # h3: docs/security.md
                    help="TLS everywhere: certificates in <state-dir>/tls/ (made if missing), NATS and etcd over "
                         "TLS, etcd users per role, the gateways on HTTPS")
    up.add_argument("--log-level", default=None, metavar="LEVEL",
                    type=log_level_type,
                    help="log level of the supervisor and the actors (default: $ACTORSERVE_LOG_LEVEL or INFO)")
    up.set_defaults(func=_cmd_up)


def _add_actor_command(sub: Any) -> None:
    """``actorserve actor KIND``: one actor process (its module adds its own options)."""
    actor = sub.add_parser(
        "actor",
        help="run one actor process",
        description="Run one actor in the foreground. SIGTERM/SIGINT drain it and exit 0.",
    )
    kinds = actor.add_subparsers(dest="actor_kind", metavar="KIND", required=True, parser_class=ActorParser)
    for kind, modname in ACTOR_MODULES.items():
        p = kinds.add_parser(
            kind, help=ACTOR_HELP[kind], actor_kind=kind,
            description=f"Run the {kind} actor ({modname}): {ACTOR_HELP[kind]}.",
        )
        if kind in MODEL_ACTORS:
            p.add_argument("--model", required=True, type=model_version_ref, metavar="NAME@VERSION",
                           help="model version this actor serves, e.g. smollm2-135m-instruct@1")
        common_arguments(p)
        metrics_arguments(p)
        p.add_argument("--traces", type=_traces_exporter, default=None, metavar="EXPORTER",
                       help="OpenTelemetry traces: none, console, otlp or file:PATH "
                            "(default: $ACTORSERVE_TRACES, else none)")
        p.set_defaults(func=_cmd_actor)


def _add_status_command(sub: Any) -> None:
    """``actorserve status``: endpoints, processes, models, live workers."""
    st = sub.add_parser("status", help="show endpoints, processes, models and live workers")
    common_arguments(st)
    st.add_argument("--json", action="store_true", help="print machine-readable JSON")
    st.set_defaults(func=_cmd_status)


# ---------------------------------------------------------------------------------------------
# verbs


def _cmd_up(args: argparse.Namespace) -> int:
    from control.ops.up import main_up

    return main_up(args)


def _traces_exporter(value: str) -> str:
    """argparse type for ``--traces`` (see bus.tracing.parse_exporter)."""
    from bus.tracing import parse_exporter

    try:
        return parse_exporter(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_actor(args: argparse.Namespace) -> int:
    module = getattr(args, "_actor_module", None)
    if module is None:  # parsed by a parser built elsewhere
        module = importlib.import_module(ACTOR_MODULES[args.actor_kind])
    nats_url, etcd_url = resolve_endpoints(args)
    args.nats, args.etcd = nats_url, etcd_url
    args.state_dir = str(state_dir_of(args))
    ident = getattr(args, "worker_id", None) or getattr(args, "gateway_id", None)
    label = f"{args.actor_kind}:{ident}" if ident else args.actor_kind
    return run_actor_main(module.main, args, kind=label)


def _cmd_status(args: argparse.Namespace) -> int:
    from control.state.registry import Registry
    from control.ops.supervisor_processes import http_status, pid_alive, read_pids

    state_dir = state_dir_of(args)
    nats_url, etcd_url = resolve_endpoints(args, need_nats=False)
    http_url = None
    try:
        http_url = json.loads((state_dir / "endpoints.json").read_text()).get("http_url")
    except (OSError, ValueError, AttributeError):
        pass
    pids: dict[str, Any] = read_pids(state_dir) or {}

    async def go() -> dict[str, Any]:
        async with Registry.connect(etcd_url) as reg:
            models = await reg.list_models()
            workers = {
                f"{name}@{version}": await reg.list_workers(name, version)
                for name in models
                for version in models[name]
            }
            hosts = list((await reg.list_hosts()).values())
        return {"models": models, "workers": workers, "hosts": hosts}

    report: dict[str, Any] = {
        "state_dir": str(state_dir),
        "endpoints": {"nats_url": redact_url(nats_url) if nats_url else nats_url, "etcd_url": etcd_url,
                      "http_url": http_url},  # the operator password stays in the 0600 endpoints.json
        "processes": {k: {"pid": v, "alive": pid_alive(v)} for k, v in pids.items() if isinstance(v, int)},
        "stopped": pids.get("stopped") if isinstance(pids.get("stopped"), dict) else {},
        "ready": (http_status(f"{http_url}/readyz") == 200) if http_url else None,
    }
    try:
        report.update(asyncio.run(go()))
    except Exception as e:  # etcd down: still show what we know
        if not is_unreachable(e):
            raise
        report["error"] = unreachable_line("etcd", etcd_url, e)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
        if "error" in report:
            print(report["error"], file=sys.stderr)
            return EXIT_UNREACHABLE
        return 0
    ep = report["endpoints"]
    print(f"state dir: {report['state_dir']}")
    print(f"nats:      {redact_url(ep['nats_url']) if ep['nats_url'] else '-'}")
    print(f"etcd:      {ep['etcd_url']}")
    ready = {True: "ready", False: "NOT ready", None: "-"}[report["ready"]]
    print(f"http:      {ep['http_url'] or '-'} ({ready})")
    if report["processes"] or report["stopped"]:
        print("processes:")
        for name, p in report["processes"].items():
            print(f"  {name:<14} pid {p['pid']:<8} {'running' if p['alive'] else 'GONE'}")
    for name, info in sorted(report["stopped"].items()):
        by = info.get("by", "?") if isinstance(info, dict) else "?"
        rc = info.get("status") if isinstance(info, dict) else None
        if by in ("autoscaler", "preempted"):  # issue 19: scaled down / notice due (docs/autoscaling.md)
            state = "scaled down" if by == "autoscaler" else "preempted"
            print(f"  {name:<14} {state:<12} ({'draining' if info.get('draining') else f'exit status {rc}'})")
            continue
        print(f"  {name:<14} {'stopped by ' + str(by):<12} (exit status {rc}; not restarted, `kill -HUP "
              f"{pids.get('supervisor', '<up pid>')}` starts it again)")
    if "error" in report:
        print(report["error"], file=sys.stderr)
        return EXIT_UNREACHABLE
    print("models:")
    if not report["models"]:
        print("  (none registered)")
    for name, versions in sorted(report["models"].items()):
        for version in sorted(versions, key=lambda v: (len(v), v)):
            ws = report["workers"].get(f"{name}@{version}", {})
            labels = [w + (" [engine zero-compute: NO MODEL]" if isinstance(ws[w], dict) and ws[w].get("engine")
                           == "zero-compute" else "") for w in sorted(ws)]
            state = versions[version].get("status", "active") if isinstance(versions[version], dict) else "active"
            print(f"  {name}@{version}{'' if state == 'active' else f' [{state}]'}: {len(ws)} live worker(s)"
                  f"{': ' + ', '.join(labels) if ws else ''}")
            for w in sorted(ws):
                if line := worker_detail(ws[w]):
                    print(f"    {w}: {line}")
    if report.get("hosts"):
        from control.ops.status_detail import host_lines
        print("worker hosts:")
        for line in host_lines(report["hosts"]):
            print(f"  {line}")
    return 0


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``actorserve`` console script (and ``python -m control.ops.cli``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    verb = " ".join(str(v) for v in (args.command, getattr(args, "bench_command", None)) if v)
    missing = missing_extra(tuple(getattr(args, "extras", ())))
    if missing is not None:  # an optional extra the verb declared (issue [18] item 2): one line, exit 2
        print(missing_extra_line(verb, *missing), file=sys.stderr)
        sys.exit(EXIT_USAGE)
    try:
        status = args.func(args)
    except KeyboardInterrupt:
        status = 130
    except BrokenPipeError:  # stdout closed early (| head): not the stack; quiet, 141 (cli_errors.py)
        status = stdout_closed()
    except StackUnreachable as e:  # no endpoint found: one line, exit 3
        print(e.message, file=sys.stderr)
        status = EXIT_UNREACHABLE
    except ModuleNotFoundError as e:  # a module of an optional extra the verb did not declare: one line, exit 2
        extra = extra_of_module(e.name)
        if extra is None:
            raise
        print(missing_extra_line(verb, extra, (e.name or "?").split(".")[0]), file=sys.stderr)
        status = EXIT_USAGE
    except Exception as e:  # a verb let a connection failure escape: one line, exit 3, no traceback
        if not is_unreachable(e):
            raise
        status = report_unreachable("the stack", None, e)
    sys.exit(status or 0)


if __name__ == "__main__":
    main()
