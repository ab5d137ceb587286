"""The small runtime every actor process shares: options, endpoint discovery, logging, run loop.

An actor module (``actors.kinds.ACTOR_MODULES``) exposes ``add_arguments(parser)`` and ``async def
main(args)``, which runs the shared skeleton :func:`actors.serve.serve` (registry and bus on a context,
the actor's parts, closers in reverse order, bounded and shielded). The CLI
(``actorserve actor KIND ...``) adds :func:`common_arguments`, resolves the endpoints with
:func:`resolve_endpoints` and hands ``main`` to :func:`run_actor_main`, which

* sets up logging (level from ``--log-level``, else ``ACTORSERVE_LOG_LEVEL``, else INFO; every line
  names the actor kind and the pid);
* runs ``main(args)`` as one task in a fresh event loop (like ``asyncio.run``, but a blocking call
  still running in a thread after ``main`` ended delays the exit by at most a few seconds);
* turns SIGTERM / SIGINT into a cancellation of that task. The actor's ``main`` catches
  ``CancelledError`` and drains (bounded, shielded cleanup). A second signal while draining
  exits at once with status 130 (SIGINT) / 143 (SIGTERM);
* exits 0 after a clean drain (``main`` returned, or ended with the CancelledError the signal
  caused), 1 if ``main`` raised;
* drains the same way when its parent dies (``ACTORSERVE_PARENT_PID``, set by ``actorserve up``,
  checked every second; ``up`` also sets ``PR_SET_PDEATHSIG``, actors/lifeline.py).

This module imports neither torch nor nats, so it is cheap to import from the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("actorserve.runtime")

DEFAULT_STATE_DIR = ".actorserve"
ENV_NATS = "ACTORSERVE_NATS"
ENV_ETCD = "ACTORSERVE_ETCD"
ENV_LOG_LEVEL = "ACTORSERVE_LOG_LEVEL"
ENV_STATE_DIR = "ACTORSERVE_STATE_DIR"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENDPOINTS_FILE = "endpoints.json"
#: pid of the process that started this actor (set by ``actorserve up``): when it dies the actor drains
ENV_PARENT_PID = "ACTORSERVE_PARENT_PID"
PARENT_POLL_S = 1.0  # seconds between two checks of the parent
#: exit status of every CLI verb (and actor) that finds no stack or whose stack does not answer
EXIT_UNREACHABLE = 3


class StackUnreachable(SystemExit):
    """SystemExit carrying a one-line message: no endpoint of the stack was found, or it did not answer.
    control/ops/cli.py ``main`` prints the message and exits :data:`EXIT_UNREACHABLE` (3); raised
    outside it, Python prints the message and exits 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def parent_gone() -> bool:
    """True when ``ACTORSERVE_PARENT_PID`` names a parent this process no longer has (it died and we were
    re-parented). False when the variable is unset or not a pid."""
    try:
        expected = int(os.environ.get(ENV_PARENT_PID, ""))
    except ValueError:
        return False
    return expected > 1 and os.getppid() != expected


def log_level_type(value: str) -> str:
    """argparse type for ``--log-level``: a level name (case-insensitive, WARN accepted), upper-cased."""
    v = value.strip().upper()
    if v == "WARN":
        v = "WARNING"
    if v not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid log level {value!r} (choose from {', '.join(LOG_LEVELS)})")
    return v


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options every actor (and every CLI verb that talks to the stack) accepts.

    ``--nats URL`` and ``--etcd URL`` default to None: :func:`resolve_endpoints` then takes them
    from ``ACTORSERVE_NATS`` / ``ACTORSERVE_ETCD``, else from ``<state-dir>/endpoints.json``.
    ``--state-dir DIR`` defaults to ``ACTORSERVE_STATE_DIR`` or ``.actorserve``. ``--log-level``
    defaults to ``ACTORSERVE_LOG_LEVEL`` or INFO (resolved at run time).
    """
    g = parser.add_argument_group("stack endpoints")
    g.add_argument("--nats", metavar="URL", default=None,
                   help=f"NATS server URL (default: ${ENV_NATS}, else <state-dir>/{ENDPOINTS_FILE})")
    g.add_argument("--etcd", metavar="URL", default=None,
                   help=f"etcd client URL, or the members of a cluster comma-separated (http://a:2379,http://b:2379)"
                        f" (default: ${ENV_ETCD}, else <state-dir>/{ENDPOINTS_FILE})")
    g.add_argument("--state-dir", metavar="DIR", default=None,
                   help=f"state directory written by `actorserve up` (default: ${ENV_STATE_DIR} or {DEFAULT_STATE_DIR})")
    g.add_argument("--log-level", type=log_level_type, default=None, metavar="LEVEL",
                   help=f"log level: {', '.join(LOG_LEVELS)} (default: ${ENV_LOG_LEVEL} or INFO)")


def state_dir_of(args: argparse.Namespace) -> Path:
    """The state directory named by ``args.state_dir``, else ``ACTORSERVE_STATE_DIR``, else ``.actorserve``."""
    value = getattr(args, "state_dir", None) or os.environ.get(ENV_STATE_DIR) or DEFAULT_STATE_DIR
    return Path(value)


def _read_endpoints_file(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / ENDPOINTS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise SystemExit(f"actorserve: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"actorserve: {path} must hold a JSON object")
    return data


def resolve_endpoints(args: argparse.Namespace, *, need_nats: bool = True, need_etcd: bool = True) -> tuple[str | None, str | None]:
    """Return ``(nats_url, etcd_url)`` for ``args``.

    Each URL comes from its option (``--nats`` / ``--etcd``), else from the environment
    (``ACTORSERVE_NATS`` / ``ACTORSERVE_ETCD``), else from ``<state-dir>/endpoints.json``.
    Raises :class:`StackUnreachable` (a SystemExit; the CLI exits 3) with a message naming all three
    sources if a needed URL is found nowhere;
    a URL that is not needed (``need_nats=False`` / ``need_etcd=False``) may come back None.
    """
    nats_url = getattr(args, "nats", None) or os.environ.get(ENV_NATS) or None
    etcd_url = getattr(args, "etcd", None) or os.environ.get(ENV_ETCD) or None
    if nats_url is None or etcd_url is None:
        state_dir = state_dir_of(args)
        data = _read_endpoints_file(state_dir) or {}
        nats_url = nats_url or data.get("nats_url") or None
        etcd_url = etcd_url or data.get("etcd_url") or None
        if data.get("tls"):  # a TLS stack (`up --tls`): act as its root user unless TLS files are set already
            from bus.tls import apply_endpoints_tls  # in here: ssl stays out of processes without TLS

            apply_endpoints_tls(data["tls"])
    missing = [
        (opt, env)
        for opt, env, val, needed in (
            ("--nats", ENV_NATS, nats_url, need_nats),
            ("--etcd", ENV_ETCD, etcd_url, need_etcd),
        )
        if needed and not val
    ]
    if missing:
        what = " and ".join(f"{opt} (or ${env})" for opt, env in missing)
        raise StackUnreachable(
            f"actorserve: no {'/'.join(o.lstrip('-') for o, _ in missing)} endpoint: pass {what}, "
            f"or start the stack with `actorserve up` so that {state_dir_of(args) / ENDPOINTS_FILE} exists"
        )
    return nats_url, etcd_url


def log_level_of(args: argparse.Namespace | None) -> str:
    """Effective log level name: ``args.log_level``, else ``ACTORSERVE_LOG_LEVEL``, else INFO."""
    level = getattr(args, "log_level", None) if args is not None else None
    if not level:
        env = os.environ.get(ENV_LOG_LEVEL, "")
        try:
            level = log_level_type(env) if env else "INFO"
        except argparse.ArgumentTypeError:
            level = "INFO"
    return level


def setup_logging(kind: str, level: str = "INFO") -> None:
    """Configure the root logger: one line per record on stderr, naming ``kind`` and the pid.

    Format: ``2025-01-01 12:00:00,000 INFO worker[1234] module: message``. Replaces existing
    handlers so that it may be called again (e.g. in tests).
    """
    fmt = f"%(asctime)s %(levelname)s {kind}[%(process)d] %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format=fmt, stream=sys.stderr, force=True)
    # Third-party chatter stays at WARNING unless we are debugging.
    if level != "DEBUG":
        for noisy in ("aetcd", "grpc", "nats", "asyncio", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--metrics-port`` (every ``actorserve actor KIND``): the loopback port of the actor's own
    ``/metrics`` (0, the default: a free port; -1: no server and no etcd registration)."""
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="loopback port serving this actor's Prometheus /metrics, registered (leased) in etcd "
                        "under /actorserve/metrics/KIND/ID (default 0: a free port; -1: disabled)")


async def _with_metrics(main_coro_fn: Callable[[argparse.Namespace], Awaitable[Any]], args: argparse.Namespace) -> Any:
    """Run ``main(args)`` inside :func:`actors.metrics.actor_metrics` (metrics server, etcd registration,
    event-loop lag) when the args carry ``metrics_port``; plain ``main(args)`` otherwise."""
    if not hasattr(args, "metrics_port"):
        return await main_coro_fn(args)
    from actors.metrics import actor_metrics

    async with actor_metrics(args, getattr(args, "actor_kind", None) or "actor"):
        return await main_coro_fn(args)


async def _run_main(main_coro_fn: Callable[[argparse.Namespace], Awaitable[Any]], args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(_with_metrics(main_coro_fn, args))
    received: list[int] = []

    def on_signal(signum: int) -> None:
        if not received:
            received.append(signum)
            log.info("received %s: draining", signal.Signals(signum).name)
            task.cancel()
        else:
            # A second signal while draining: give up on the drain.
            log.warning("received %s again while draining: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)

    installed: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / platform
            pass

    async def watch_parent() -> None:  # the supervisor died (even by SIGKILL): drain as after SIGTERM
        while not received:
            await asyncio.sleep(PARENT_POLL_S)
            if parent_gone() and not received:
                received.append(signal.SIGTERM)
                log.warning("parent process (pid %s) is gone: draining", os.environ.get(ENV_PARENT_PID))
                task.cancel()

    watcher = asyncio.ensure_future(watch_parent()) if os.environ.get(ENV_PARENT_PID) else None
    try:
        await task
    except asyncio.CancelledError:
        if received:
            log.info("drained; exiting")
            return 0
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        for signum in installed:
            loop.remove_signal_handler(signum)
    if received:
        log.info("drained; exiting")
    return 0


# Threads of the actor's default executor (``asyncio.to_thread``) carry this name prefix, so the
# runner can tell them from threads it did not start.
_EXECUTOR_PREFIX = "actorserve-actor-exec"
#: seconds the runner waits, after main ended, for executor threads (e.g. a model load) to finish
EXECUTOR_GRACE_S = 3.0


def _run_loop(main_coro_fn: Callable[[argparse.Namespace], Awaitable[Any]], args: argparse.Namespace) -> int:
    """Like ``asyncio.run(_run_main(...))``, but never blocks on executor threads that are still busy
    (``asyncio.run`` joins them without a bound: a worker told to stop mid-load would wait for the load)."""
    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(thread_name_prefix=_EXECUTOR_PREFIX)
    loop.set_default_executor(executor)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_run_main(main_coro_fn, args))
    finally:
        try:
            leftovers = asyncio.all_tasks(loop)
            for t in leftovers:
                t.cancel()
            if leftovers:
                loop.run_until_complete(asyncio.wait(leftovers, timeout=EXECUTOR_GRACE_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            asyncio.set_event_loop(None)
            loop.close()


def _busy_executor_threads(grace: float) -> list[str]:
    """Join this runner's executor threads for up to ``grace`` s; return the names still alive."""
    deadline = time.monotonic() + grace
    for t in threading.enumerate():
        if t.name.startswith(_EXECUTOR_PREFIX):
            t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threading.enumerate() if t.name.startswith(_EXECUTOR_PREFIX) and t.is_alive()]


def run_actor_main(
    main_coro_fn: Callable[[argparse.Namespace], Awaitable[Any]],
    args: argparse.Namespace,
    *,
    kind: str | None = None,
) -> int:
    """Run an actor's ``main(args)`` to completion in a fresh event loop and return its exit status.

    Sets up logging (see :func:`setup_logging`; ``kind`` defaults to ``args.actor_kind`` or the
    program name), installs SIGTERM/SIGINT handlers that cancel the main task so the actor drains,
    and returns 0 after a clean drain or normal return, 1 if ``main`` raised (the traceback is
    logged). The CLI passes the result to ``sys.exit``.

    Blocking work the actor started with ``asyncio.to_thread`` (e.g. loading weights) gets
    ``EXECUTOR_GRACE_S`` seconds after ``main`` ended; if it is still running then, the process
    exits at once with the same status (``os._exit``) instead of waiting for it.
    """
    kind = kind or getattr(args, "actor_kind", None) or Path(sys.argv[0]).name or "actor"
    setup_logging(kind, log_level_of(args))
    from bus import tracing
    try:  # --traces, else ACTORSERVE_TRACES; off ("none") by default
        tracing.setup(f"actorserve-{getattr(args, 'actor_kind', None) or kind}", getattr(args, "traces", None))
    except ValueError as e:
        raise SystemExit(f"actorserve: {e}") from None
    try:
        code = _run_loop(main_coro_fn, args)
    except KeyboardInterrupt:  # a SIGINT before the handler was installed
        code = 130
    except SystemExit:
        raise
    except BaseException:
        log.exception("%s failed", kind)
        code = 1
    tracing.shutdown()  # flush spans still batched (OTLP)
    busy = _busy_executor_threads(EXECUTOR_GRACE_S)
    if busy:
        log.warning("exiting with %d blocking call(s) still running in threads", len(busy))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
