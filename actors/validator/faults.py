"""Test-only fault injection for a validator (exists only with ``ACTORSERVE_TEST_FAULTS=1``, like
actors/worker/faults.py).

``ACTORSERVE_FAULT_VALIDATOR_DELAY_MS=<ms>`` in a validator's environment makes it hold each request that
long before handling it, one request at a time: an ``asyncio.sleep`` under a lock, so the event loop stays
free (the load report keeps sampling) while the requests behind it wait -- their wait shows as queue wait and
backlog (``ActorLoad.wait_ms_p90``, ``pending``), and one validator handles at most ``1000 / ms`` requests
per second, as if each took that much CPU. It makes the validator tier the bottleneck on a machine where
tokenization is cheaper than prefill (the autoscaler's validator-bound target, docs/autoscaling.md).

Without ``ACTORSERVE_TEST_FAULTS=1`` the variable is ignored (logged once), so a production environment
can never slow a validator down.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Mapping

from control.policy.numbers import is_number

log = logging.getLogger(__name__)

ENV_TEST_FAULTS = "ACTORSERVE_TEST_FAULTS"
ENV_DELAY_MS = "ACTORSERVE_FAULT_VALIDATOR_DELAY_MS"


@dataclass
class ValidatorDelay:
    """Hold each request ``delay_ms`` ms, one at a time (ValueError for a negative or non-finite delay)."""

    delay_ms: float
    held: int = 0  # requests held so far
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def __post_init__(self) -> None:
        if not is_number(self.delay_ms, minimum=0):
            raise ValueError(f"{ENV_DELAY_MS} must be a number of ms >= 0, got {self.delay_ms!r}")

    @property
    def waiting(self) -> bool:
        """True while a request is being held (the next one waits)."""
        return self._lock.locked()

    async def hold(self, on_turn=None) -> None:
        """Wait for this validator's turn, call ``on_turn()`` (the queue wait ends here), then sleep the delay."""
        async with self._lock:
            if on_turn is not None:
                on_turn()
            self.held += 1
            await asyncio.sleep(self.delay_ms / 1e3)


def from_env(env: Mapping[str, str] | None = None) -> ValidatorDelay | None:
    """The delay fault configured in ``env`` (default: the process environment), or None when it is not
    set, is 0, or test faults are off. ValueError for a value that is not a number >= 0."""
    env = os.environ if env is None else env
    raw = env.get(ENV_DELAY_MS, "").strip()
    if not raw:
        return None
    if env.get(ENV_TEST_FAULTS, "") != "1":
        log.warning("%s ignored: test faults are off (set %s=1)", ENV_DELAY_MS, ENV_TEST_FAULTS)
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_DELAY_MS} must be a number of ms >= 0, got {raw!r}") from None
    if ms == 0:
        return None
    log.warning("test fault on: each request is held %g ms, one at a time (%s)", ms, ENV_DELAY_MS)
    return ValidatorDelay(ms)
