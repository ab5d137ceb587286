"""The one number check: what a JSON / etcd / wire value must be to count as a number (issue 19 item 6).

``bool`` is an ``int`` in Python, so ``isinstance(True, (int, float))`` holds; every record, request and
setting that takes a number refuses ``true`` / ``false`` and NaN (and, unless told, infinities) through
these.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_int", "is_number"]


def is_int(v: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any, *, minimum: float | None = None, finite: bool = True) -> bool:
    """An int or float that is not a bool nor NaN; finite unless ``finite=False`` (then +-inf pass); with
    ``minimum``, not below it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or (finite and math.isinf(v)):
        return False
    return minimum is None or v >= minimum
