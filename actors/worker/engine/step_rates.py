"""Measured engine speed: decode step time per batch size and prefill tokens/s (pure: time passed in).

The worker reports both on every heartbeat (``Credits.step_ms``, ``Credits.prefill_tokens_per_s``) and the
scheduler predicts a request's completion from them (docs/decisions/0021-latency-isolation.md).  A step's
wall time grows with the running batch (on a CPU about linearly), so one EWMA over all steps would
mix batch sizes: decode-only steps are kept per batch size (one EWMA per size), and the time at a size
not yet seen is interpolated between the nearest measured sizes (extrapolated along the line through the
two nearest ones beyond them).  Steps that compute prompt tokens give the prefill rate: their prompt
tokens over the step time less the predicted time of the decodes that rode along.
"""

from __future__ import annotations

ALPHA = 0.2  # EWMA weight of the newest step
MIN_PREFILL_SHARE = 0.1  # the prefill part of a mixed step is taken as at least this share of its time


class StepRates:
    """EWMAs of decode step time (per batch size, ms) and of prefill speed (tokens/s); 0 until measured."""

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.decode_ms: dict[int, float] = {}  # batch size (sequences) -> EWMA of decode-only step time (ms)
        self.prefill_tokens_per_s = 0.0  # EWMA (tokens/s)

    def _ewma(self, old: float, new: float) -> float:
        return new if old <= 0.0 else old + self.alpha * (new - old)

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """Record one step: ``num_decodes`` one-token rows, ``num_prefill_tokens`` tokens of prefill chunks
        (prompt or recomputed), ``seconds`` of wall time."""
        if seconds <= 0.0 or (num_decodes <= 0 and num_prefill_tokens <= 0):
            return
        if num_prefill_tokens <= 0:
            self.decode_ms[num_decodes] = self._ewma(self.decode_ms.get(num_decodes, 0.0), seconds * 1e3)
            return
        decode_s = self.step_ms(num_decodes) / 1e3 if num_decodes else 0.0
        prefill_s = max(seconds - decode_s, MIN_PREFILL_SHARE * seconds)
        self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, num_prefill_tokens / prefill_s)

    def step_ms(self, batch: int) -> float:
        """Predicted wall time of a decode step of ``batch`` sequences (ms); 0 before any decode step."""
        if not self.decode_ms:
            return 0.0
        batch = max(1, batch)
        if batch in self.decode_ms:
            return self.decode_ms[batch]
        sizes = sorted(self.decode_ms)
        below = [b for b in sizes if b < batch]
        above = [b for b in sizes if b > batch]
        if below and above:
            lo, hi = below[-1], above[0]
        elif len(sizes) == 1:
            return self.decode_ms[sizes[0]]
        else:
            lo, hi = (below[-2], below[-1]) if below else (above[0], above[1])
        t_lo, t_hi = self.decode_ms[lo], self.decode_ms[hi]
        t = t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo)
        return max(t, min(t_lo, t_hi)) if not (below and above) else t


def served_delta(served: dict[str, list[int]], sent: dict[str, list[int]]) -> tuple[dict, dict]:
    """(``{tenant: [prompt, completion]}`` tokens served since ``sent`` — non-zero entries only —, the new
    ``sent``), from the engine's cumulative counters ``served`` (EngineStats.served) and those of the
    previous heartbeat ``sent``."""
    delta = {}
    for tenant, (p, c) in served.items():
        p0, c0 = sent.get(tenant, (0, 0))
        if p > p0 or c > c0:
            delta[tenant] = [p - p0, c - c0]
    return delta, {t: list(v) for t, v in served.items()}
