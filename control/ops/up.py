"""``actorserve up``: run a :class:`control.ops.supervisor.Supervisor` in the foreground with signal handling
and terminal output."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from control.ops.stack_config import StackConfig
from control.ops.supervisor import START_ORDER, Supervisor, SupervisorError


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def _start_stopped(sup: Supervisor) -> None:
    try:
        names = sup.start_stopped()
    except OSError as e:
        print(f"actorserve: could not start the stopped actors: {e}", file=sys.stderr)
        return
    print(f"actorserve: started again: {', '.join(names) or 'nothing was stopped'}", file=sys.stderr, flush=True)


def _autoscaler_line(sup: Supervisor) -> str:
    """One banner line: whether the autoscaler runs, and its bounds (docs/autoscaling.md)."""
    cfg = sup.cfg
    if not any(a.kind == "autoscaler" for a in sup.actors):
        why = ("--multi-model without --lend: hosts are not scaled" if cfg.multi_model else "--no-autoscaler"
               if not cfg.autoscaler else "its actor kind is not installed")
        return f"autoscaler: off ({why}); counts stay fixed (docs/autoscaling.md)"
    if cfg.multi_model:
        return (f"autoscaler: on, lending hosts across versions (1..{max(1, cfg.workers)} hosts per version, to 0 "
                f"when idle; docs/autoscaling.md); `actorserve autoscaler status`")
    return (f"autoscaler: on (validators 1..{max(1, cfg.cores)}, workers {cfg.workers}..{cfg.max_workers} per "
            f"version, gateways {cfg.gateways}); `actorserve autoscaler status`, `up --no-autoscaler` to pin")


def main_up(args: argparse.Namespace) -> int:
    """Run ``actorserve up`` with parsed ``args``; return the exit status.

    Starts the :class:`Supervisor`, waits for readiness (printing the worker's loading progress),
    prints the URL and a curl example, then supervises until SIGINT/SIGTERM and stops everything
    (in parallel waves, within the supervisor's ``stop_timeout_s``). SIGHUP starts again the actors
    the operator stopped (``kill -TERM <actor pid>``: drained, not restarted). Refuses to start (status 1,
    one line naming the pids and how to stop them) over a stack still running on the state directory.
    The autoscaler actor runs unless ``--no-autoscaler`` (docs/autoscaling.md): floors = ``--gateways``,
    one validator and ``--workers``; ceilings from the CPUs this process may use.
    """
    from actors.runtime import log_level_of, setup_logging

    level = log_level_of(args)
    setup_logging("supervisor", level)
    actor_args: dict[str, list[str]] = {}
    for kind in START_ORDER:
        extra = getattr(args, f"{kind}_args", None)
        if extra:
            actor_args[kind] = shlex.split(extra)
    if getattr(args, "lend", False) and not getattr(args, "multi_model", False):
        print("actorserve up: --lend needs --multi-model (hosts are lent across versions)", file=sys.stderr)
        return 2
    if getattr(args, "lend", False) and getattr(args, "no_autoscaler", False):
        print("actorserve up: --lend and --no-autoscaler contradict each other (the autoscaler lends)", file=sys.stderr)
        return 2
    sup = Supervisor(StackConfig(
        args.state_dir or os.environ.get("ACTORSERVE_STATE_DIR") or ".actorserve",
        host=args.host,
        port=args.port,
        gateways=args.gateways,
        workers=args.workers,
        model_file=args.model_file,
        model_name=args.model_name,
        context_length=args.context_length,
        log_level=args.log_level,
        actor_args=actor_args,
        echo_worker_log=True,
        tls=bool(getattr(args, "tls", False)),
        autoscaler=not getattr(args, "no_autoscaler", False),
        multi_model=bool(getattr(args, "multi_model", False)),
        lend=bool(getattr(args, "lend", False)),
        sleep_horizon_s=float(getattr(args, "sleep_horizon_s", 0.0) or 0.0),
    ))

    def on_signal(signum: int, _frame: Any) -> None:
        sup.request_stop()

    def on_hup(_signum: int, _frame: Any) -> None:  # start again the actors the operator stopped
        threading.Thread(target=_start_stopped, args=(sup,), name="actorserve-sighup", daemon=True).start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if hasattr(signal, "SIGHUP"):
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hup)
    status = 0
    try:
        try:
            print(f"actorserve: starting etcd, nats and the actors (state: {sup.state_dir})", file=sys.stderr)
            sup.start()
            print(
                f"actorserve: {sup.model_ref} registered; loading (logs: {sup.logs_dir}/) ...",
                file=sys.stderr,
            )
            sup.wait_ready(args.ready_timeout)
        except (SupervisorError, FileNotFoundError, ValueError, RuntimeError) as e:
            if sup.stop_requested and isinstance(e, SupervisorError):
                print("actorserve: interrupted during startup; stopping", file=sys.stderr)
                status = 130
            else:
                print(f"actorserve: startup failed: {e}", file=sys.stderr)
                status = 1
            return status
        url = sup.http_url
        print(
            f"\nactorserve is ready: {url}/v1  (model {sup.cfg.model_name}, {sup.cfg.gateways} gateway(s), "
            f"{sup.cfg.workers} worker(s))\n"
            f"  endpoints: {sup.state_dir / 'endpoints.json'}   logs: {sup.logs_dir}/\n"
            f"  dev API key (tenant dev): {sup.dev_api_key}   (also in {sup.state_dir / 'dev-api-key'})\n"
            f"  NATS API: {sup.stack.nats.url}  user {_read(sup.state_dir / 'dev-nats-user')}, "
            f"password = the dev API key, inbox prefix _INBOX.dev (docs/nats-api.md)\n"
            f"  {_autoscaler_line(sup)}\n\n"
            f"  export OPENAI_API_KEY=$(cat {sup.state_dir / 'dev-api-key'})\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            + (f"    --cacert {sup.tls_dir / 'ca.pem'} \\\n" if sup.tls_dir else "") +
            f"    -H \"Authorization: Bearer $OPENAI_API_KEY\" \\\n"
            f"    -d '{{\"model\":\"{sup.cfg.model_name}\",\"messages\":[{{\"role\":\"user\","
            f"\"content\":\"What is the capital of France?\"}}],\"temperature\":0}}'\n\n"
            f"Press Ctrl-C to stop.",
            flush=True,
        )
        sup.wait()
        print("\nactorserve: stopping ...", file=sys.stderr, flush=True)
        return 0
    finally:
        sup.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        if status == 0:
            print("actorserve: stopped", file=sys.stderr)
