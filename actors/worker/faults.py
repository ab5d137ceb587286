"""Test-only fault injection for a worker (docs/architecture.md: exists only when ``ACTORSERVE_TEST_FAULTS=1``).

A model version's manifest may carry ``test_faults``, e.g.::

    {"test_faults": {"error_rate": 0.5, "ttft_delay_ms": 300, "seed": 7}}

* ``error_rate`` (0..1): that share of the requests this worker accepts ends with a retryable 500 error
  chunk (``code: "injected_fault"``) and a CompletionRecord with status ``error``; which ones is drawn
  from a RNG seeded with ``seed`` (default 0), so a run is reproducible.
* ``ttft_delay_ms`` (>= 0): each request reaches the engine that much later, delaying its first token
  (and its TTFT) without blocking the engine loop: other requests keep running meanwhile.

Without ``ACTORSERVE_TEST_FAULTS=1`` in the worker's environment the key is ignored (logged once), so a
production manifest can never turn faults on. Used to test the rollout controller's automatic rollback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from control.policy.numbers import is_number

log = logging.getLogger(__name__)

ENV_TEST_FAULTS = "ACTORSERVE_TEST_FAULTS"
MANIFEST_KEY = "test_faults"
FAULT_CODE = "injected_fault"


@dataclass
class FaultInjector:
    """Decides per accepted request whether it fails and how long it waits before the engine."""

    error_rate: float = 0.0
    ttft_delay_ms: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for fname, hi in (("error_rate", 1.0), ("ttft_delay_ms", None)):
            v = getattr(self, fname)
            if not is_number(v, minimum=0) or (hi is not None and v > hi):
                raise ValueError(f"{MANIFEST_KEY}.{fname} must be a number >= 0{'' if hi is None else ' and <= 1'}, "
                                 f"got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"{MANIFEST_KEY}.seed must be an integer, got {self.seed!r}")
        self._rng = random.Random(self.seed)
        self.injected_errors = 0
        self.delayed = 0

    @property
    def delay_s(self) -> float:
        """The first-token delay in seconds."""
        return self.ttft_delay_ms / 1000.0

    def should_fail(self) -> bool:
        """Draw once for one request: True for an injected error."""
        fail = self.error_rate > 0 and self._rng.random() < self.error_rate
        self.injected_errors += fail
        return fail

    async def admit(self, still_wanted: Callable[[], bool], add: Callable[[], None],
                    fail: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Hand one accepted request to the engine (``add``) after the configured delay, or end it with
        the injected error (``fail``). ``still_wanted`` is checked after the delay (it may have been
        cancelled or timed out meanwhile). Runs as its own task: the engine loop never waits for it."""
        failing = self.should_fail()
        if self.ttft_delay_ms > 0:
            self.delayed += 1
            await asyncio.sleep(self.delay_s)
        if not still_wanted():
            return
        if failing:
            await fail(self.error())
        else:
            add()

    def error(self) -> dict[str, Any]:
        """The error payload of an injected failure (retryable 500)."""
        from bus.errors import ServeError

        return ServeError(500, f"injected fault ({ENV_TEST_FAULTS}=1, manifest {MANIFEST_KEY})", type="server_error",
                          code=FAULT_CODE, retryable=True, retry_after=1.0).to_wire()


def faults_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether fault injection is allowed in this process (``ACTORSERVE_TEST_FAULTS=1``)."""
    return (os.environ if env is None else env).get(ENV_TEST_FAULTS, "") == "1"


def from_manifest(manifest: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> FaultInjector | None:
    """The injector a manifest asks for, or None (no ``test_faults``, nothing to inject, or faults not
    enabled in the environment). ValueError when ``test_faults`` is malformed and enabled."""
    spec = (manifest or {}).get(MANIFEST_KEY)
    if not spec:
        return None
    if not faults_enabled(env):
        log.warning("manifest has %s but %s is not 1: no faults are injected", MANIFEST_KEY, ENV_TEST_FAULTS)
        return None
    if not isinstance(spec, Mapping):
        raise ValueError(f"{MANIFEST_KEY} must be an object")
    unknown = set(spec) - {"error_rate", "ttft_delay_ms", "seed"}
    if unknown:
        raise ValueError(f"{MANIFEST_KEY}: unknown key(s) {', '.join(sorted(unknown))}")
    inj = FaultInjector(**dict(spec))
    if not inj.error_rate and not inj.ttft_delay_ms:
        return None
    log.warning("TEST FAULTS ACTIVE: error_rate %g, ttft_delay_ms %g, seed %d", inj.error_rate, inj.ttft_delay_ms,
                inj.seed)
    return inj
