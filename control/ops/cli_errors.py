"""Exit statuses shared by every ``actorserve`` verb, and the one-line report of a stack that does not answer.

=====  ==========================================================================================
code   meaning
=====  ==========================================================================================
0      done
1      error (bad input to a verb that reads files, a failed start, a refused ``up``, ...)
2      usage (argparse), or an edit the registry refused (``models retire`` of the stable version,
       ``rollout`` conflicts)
3      stack unreachable: no endpoint found (no ``endpoints.json``, no ``--etcd``), or etcd / NATS /
       every metrics endpoint did not answer. One line on stderr, never a traceback.
130    interrupted (Ctrl-C)
141    our standard output was closed early (``actorserve ... | head -1``): 128 + SIGPIPE, as a shell
       reports a process ended by SIGPIPE; the verb's work (a registration, say) is done, and nothing more
       is printed (before, this was reported as "stack unreachable", exit 3)
=====  ==========================================================================================

:func:`is_unreachable` tells a connection failure from any other error (it looks at the exception's
class and module only: this module imports neither aetcd nor nats); :func:`report_unreachable` prints
the line and returns :data:`EXIT_UNREACHABLE`. control/ops/cli.py ``main`` applies both to whatever a
verb lets escape, so a verb that forgets still exits 3.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys

from actors.runtime import EXIT_UNREACHABLE, StackUnreachable  # noqa: F401 (re-exported)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2

_UNREACHABLE_MODULES = ("aetcd", "grpc", "nats")
_NET_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH,
                         errno.ETIMEDOUT, errno.ECONNABORTED, errno.EADDRNOTAVAIL})


def is_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` means the stack did not answer: TimeoutError, ConnectionError, an OSError of a
    network errno (refused, reset, no route, ...), a name that does not resolve, or an error raised by the etcd / gRPC / NATS clients (aetcd ``ClientError`` and its
    subclasses such as ``ConnectionFailedError``, grpc ``AioRpcError``, nats ``NoServersError``, ...)."""
    if isinstance(exc, StackUnreachable):
        return True
    if isinstance(exc, BrokenPipeError):  # our own stdout's reader went away (| head): see stdout_closed
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, socket.gaierror)):
        return True
    if isinstance(exc, OSError) and exc.errno in _NET_ERRNOS:
        return True
    return any(type(exc).__module__.split(".")[0] == m for m in _UNREACHABLE_MODULES) or any(
        c.__module__.split(".")[0] in _UNREACHABLE_MODULES for c in type(exc).__mro__[1:])


def unreachable_line(what: str, url: str | None, exc: BaseException | None = None) -> str:
    """``actorserve: stack unreachable: <what> at <url> did not answer (<detail>); is `actorserve up`
    running?`` on one line (the detail's first line only)."""
    detail = ""
    if exc is not None:
        text = (str(exc) or type(exc).__name__).strip().splitlines()
        detail = f" ({text[0][:200] if text else type(exc).__name__})"
    where = f" at {url}" if url else ""
    return f"actorserve: stack unreachable: {what}{where} did not answer{detail}; is `actorserve up` running?"


def report_unreachable(what: str, url: str | None, exc: BaseException | None = None) -> int:
    """Print :func:`unreachable_line` on stderr and return :data:`EXIT_UNREACHABLE` (3)."""
    print(unreachable_line(what, url, exc), file=sys.stderr)
    return EXIT_UNREACHABLE


def stdout_closed() -> int:
    """Our standard output's reader went away (``actorserve ... | head -1``); that is not the stack. Points
    stdout at /dev/null, so that the interpreter's last flush does not fail again (the recipe of the Python
    docs, library/signal.html "Note on SIGPIPE"), and returns 141 (128 + SIGPIPE)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (replaced, closed): nothing to point
        pass
    return 128 + signal.SIGPIPE


def run_on_registry(func, args, errors: tuple[type[BaseException], ...] = (ValueError,), wrap=None) -> int:
    """Run ``await func(reg, args)`` (``wrap(reg)`` instead of ``reg`` when given) on a Registry connected to
    the stack's etcd (``--etcd`` / ``--state-dir`` / ``ACTORSERVE_ETCD``); returns its exit status. An
    exception of ``errors`` prints one line and exits 1; etcd not answering prints one line and exits 3."""
    import asyncio

    from actors.runtime import resolve_endpoints
    from control.state.registry import Registry

    _, etcd_url = resolve_endpoints(args, need_nats=False)

    async def go() -> int:
        async with Registry.connect(etcd_url) as reg:
            return await func(wrap(reg) if wrap is not None else reg, args)
    try:
        return asyncio.run(go())
    except errors as e:
        print(f"actorserve: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # etcd unreachable (TimeoutError, OSError, aetcd ClientError): one line, exit 3
        if not is_unreachable(e):
            raise
        return report_unreachable("etcd", etcd_url, e)
