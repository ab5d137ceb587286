"""A model load timed by phase (issue 17 item 3): pure book-keeping, no torch, no nats.

Phases, in the order a worker passes them (seconds each, wall clock):

* ``registry``: process start to the version's manifest read from etcd (interpreter start, imports,
  etcd connection: what a registry edit costs before any model byte is read).
* ``artifact_read``: the GGUF header and metadata parsed (``gguf.GGUFReader``), or the converted-weights
  cache opened.
* ``convert``: tensors dequantized into the engine dtype (skipped on a converted-weights cache hit).
* ``kernels``: the engine path chosen (``kernel_choice``: cached or measured) and the native kernels
  built or loaded.
* ``quantize``: projections built by the linear factories (block quantization, packing, dense copies).
* ``warmup``: the warm-up pass (a few prefill and decode shapes) before credits are advertised.
* ``credits``: the service started and its first credits published.
* ``register``: the etcd lease taken and the worker record written (schedulers route to it from here).
* ``first_token``: registration to the first token this worker produced (waits for traffic; reported
  when it happens, not part of ``ready_s``).

Reported in the worker's log, its etcd record (``load_phases``, ``load_s``), ``actorserve status`` and
``/metrics`` (``actorserve_model_load_seconds{phase=...}``); docs/model-loading.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("registry", "artifact_read", "convert", "kernels", "quantize", "warmup", "credits", "register",
          "first_token")
READY_PHASES = PHASES[:-1]  # everything before the worker can serve: load_s sums these


@dataclass
class LoadTimeline:
    """Seconds per phase of one load.  ``mark(phase)`` closes ``phase`` at ``now`` (monotonic s): its
    duration is the time since the previous mark (or ``start``); ``add`` records a phase timed elsewhere
    (the engine's own phases) and moves the mark forward by it.  ValueError on an unknown phase."""

    start: float  # monotonic s at which the first phase began
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds (insertion = order passed)
    last: float = -1.0  # monotonic s of the latest mark (start until the first)

    def __post_init__(self) -> None:
        if self.last < 0:
            self.last = self.start

    def mark(self, phase: str, now: float | None = None) -> float:
        """Close ``phase`` at ``now``; returns its seconds (accumulated if marked twice)."""
        now = time.monotonic() if now is None else now
        return self.add(phase, max(0.0, now - self.last), now)

    def add(self, phase: str, seconds: float, now: float | None = None) -> float:
        """Record ``seconds`` of ``phase`` (>= 0) timed elsewhere; the mark moves to ``now`` if given."""
        if phase not in PHASES:
            raise ValueError(f"load phase must be one of {list(PHASES)}, got {phase!r}")
        if seconds < 0:
            raise ValueError(f"load phase {phase}: seconds must be >= 0, got {seconds}")
        self.phases[phase] = self.phases.get(phase, 0.0) + float(seconds)
        if now is not None:
            self.last = now
        return self.phases[phase]

    def add_all(self, phases: dict[str, float], now: float | None = None) -> None:
        """``add`` each of ``phases`` (e.g. the engine's ``load_phases``) in the order of PHASES."""
        for name in PHASES:
            if name in phases:
                self.add(name, phases[name])
        if now is not None:
            self.last = now

    @property
    def ready_s(self) -> float:
        """Seconds from process start to a registered worker (READY_PHASES summed)."""
        return sum(v for k, v in self.phases.items() if k in READY_PHASES)

    def as_dict(self) -> dict[str, float]:
        """``{phase: seconds}`` in PHASES order, rounded to ms (what the etcd record and status show)."""
        return {k: round(self.phases[k], 3) for k in PHASES if k in self.phases}

    def line(self) -> str:
        """``"loaded in 8.12 s: registry 0.91, artifact_read 3.02, ..."`` (the worker's log line)."""
        parts = ", ".join(f"{k} {v:.2f}" for k, v in self.as_dict().items())
        return f"loaded in {self.ready_s:.2f} s: {parts}"


def describe(phases: dict, load_s: float | None = None) -> str:
    """One status line from a worker record's ``load_phases`` (and ``load_s``): ``"loaded in 8.1 s
    (artifact_read 3.0, convert 2.1, ...), first token 0.4 s after"``; "" when there is none."""
    if not isinstance(phases, dict) or not phases:
        return ""
    ready = load_s if load_s is not None else sum(v for k, v in phases.items() if k in READY_PHASES)
    parts = ", ".join(f"{k} {float(v):.1f}" for k, v in phases.items() if k in READY_PHASES)
    tail = f", first token {float(phases['first_token']):.1f} s after" if "first_token" in phases else ""
    return f"loaded in {float(ready):.1f} s ({parts}){tail}"
