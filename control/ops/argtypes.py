"""argparse helpers shared by the CLI modules: value types (pure) and the subcommand adder of a verb."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from actors.runtime import common_arguments


def int_at_least(value: str, minimum: int) -> int:
    """``int(value)`` if it is >= ``minimum``; argparse.ArgumentTypeError otherwise."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= {minimum}")
    return n


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    return int_at_least(value, 1)


def non_negative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    return int_at_least(value, 0)


def subcommand_adder(subparsers: Any, runner: Callable[[Any, argparse.Namespace], int], *, describe: bool = False,
                     model_name: bool = False) -> Callable[[str, str, Any], argparse.ArgumentParser]:
    """The ``cmd(name, help, func)`` of a verb's subcommands (``tenants``, ``adapters``, ``rollout``): a
    subparser of ``subparsers`` with the stack's common arguments (--nats, --etcd, --state-dir, ...) that
    runs ``runner(func, args)``; ``describe`` repeats the help as the description, ``model_name`` adds the
    positional model ``name``."""
    def cmd(name: str, help_: str, func: Any) -> argparse.ArgumentParser:
        p = subparsers.add_parser(name, help=help_, **({"description": help_} if describe else {}))
        common_arguments(p)
        if model_name:
            p.add_argument("name", help="model name")
        p.set_defaults(func=lambda args: runner(func, args))
        return p

    return cmd
