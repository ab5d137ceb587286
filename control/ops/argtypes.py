"""argparse value types shared by the CLI modules (pure)."""

from __future__ import annotations

import argparse


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
