"""Service actually delivered per tenant (the fairness currency) and completion-time prediction.

Pure module (no torch, no nats, no clock reads: callers pass ``now``, monotonic seconds).

* :class:`ServiceLedger` — Virtual Token Counter bookkeeping (Sheng et al., "Fairness in Serving Large
  Language Models", OSDI '24): the tokens each tenant was actually served, prompt and completion apart,
  from the workers' heartbeats (``Credits.served``), weighted by ``fair_queue.service_tokens``. It gives
  the cumulative counters exported as ``actorserve_tenant_service_tokens_total`` and, over a sliding
  window, each tenant's share of the service next to its weight's share, so an operator sees the split
  the fair queue achieves. (The queue orders by the same currency: ``fair_queue`` charges an estimate at
  dispatch and corrects it with the served tokens at completion.)
* :class:`OutputLengthModel` — expected completion tokens of a request, from recent natural ends.
* :func:`predict_service_s` — a request's own time on a worker: its prefill at the measured prefill
  rate plus its decode steps at the measured step time of the current batch.
"""

from __future__ import annotations

from collections import deque

from actors.scheduler.fair_queue import service_tokens

# Expected completion tokens when no natural end (EOS / stop) has been seen yet (tokens). A prior, not a
# measurement, and deliberately low: admission refuses only what most likely cannot finish in time (an
# answer that runs longer is ended at its deadline by the worker), so an unknown length must not refuse.
PRIOR_OUTPUT_TOKENS = 64
MIN_SAMPLES = 20  # natural ends needed before their quantile replaces the prior
OUTPUT_QUANTILE = 0.5  # the median of recent natural lengths: the likely length, not a pessimistic bound


class ServiceLedger:
    """Per-tenant tokens served: cumulative totals and a sliding-window share of weighted service."""

    def __init__(self, window_s: float = 60.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self.prompt_tokens: dict[str, int] = {}  # tenant -> prompt tokens computed (cumulative)
        self.completion_tokens: dict[str, int] = {}  # tenant -> completion tokens generated (cumulative)
        self._recent: deque[tuple[float, str, float]] = deque()  # (now, tenant, weighted service)

    def add(self, now: float, tenant: str, prompt: int, completion: int) -> None:
        """Record ``prompt`` prompt tokens computed and ``completion`` tokens generated for ``tenant``.
        ValueError on negative counts (a heartbeat never un-serves)."""
        if prompt < 0 or completion < 0:
            raise ValueError("served token counts must be >= 0")
        self.prompt_tokens[tenant] = self.prompt_tokens.get(tenant, 0) + int(prompt)
        self.completion_tokens[tenant] = self.completion_tokens.get(tenant, 0) + int(completion)
        self._recent.append((now, tenant, service_tokens(prompt, completion)))
        self._trim(now)

    def add_heartbeat(self, now: float, served: dict) -> None:
        """Record a worker heartbeat's ``served`` map ``{tenant: [prompt, completion]}``; malformed
        entries are skipped (a heartbeat comes from another process)."""
        for tenant, counts in (served or {}).items():
            try:
                prompt, completion = int(counts[0]), int(counts[1])
            except (TypeError, ValueError, IndexError, KeyError):
                continue
            if prompt >= 0 and completion >= 0 and (prompt or completion):
                self.add(now, str(tenant), prompt, completion)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def window_service(self, now: float) -> dict[str, float]:
        """Weighted service per tenant within the window (tokens). Reads a copy and does not trim, so a
        metrics scrape may call it from another thread."""
        out: dict[str, float] = {}
        for ts, tenant, s in list(self._recent):
            if ts >= now - self.window_s:
                out[tenant] = out.get(tenant, 0.0) + s
        return out

    def shares(self, now: float) -> dict[str, float]:
        """Each tenant's fraction (0..1) of the weighted service within the window; {} when none."""
        svc = self.window_service(now)
        total = sum(svc.values())
        return {t: s / total for t, s in svc.items()} if total > 0 else {}


class OutputLengthModel:
    """Expected completion tokens of a request: ``max_tokens`` when it ignores EOS, else at most the
    ``OUTPUT_QUANTILE`` (median) of recent natural ends (EOS or a stop sequence), ``PRIOR_OUTPUT_TOKENS`` until
    ``MIN_SAMPLES`` of them were seen."""

    def __init__(self, max_samples: int = 500) -> None:
        self._recent: deque[int] = deque(maxlen=max_samples)

    def observe(self, completion_tokens: int, finish_reason: str | None) -> None:
        """Record a finished request; only natural ends (``stop``, ``tool_calls``) say how long answers are."""
        if finish_reason in ("stop", "tool_calls") and completion_tokens >= 0:
            self._recent.append(int(completion_tokens))

    def typical(self) -> int:
        """The quantile of recent natural lengths (tokens), or the prior."""
        if len(self._recent) < MIN_SAMPLES:
            return PRIOR_OUTPUT_TOKENS
        s = sorted(self._recent)
        return s[int(round(OUTPUT_QUANTILE * (len(s) - 1)))]

    def expected(self, max_tokens: int, ignore_eos: bool) -> int:
        """Completion tokens to plan for (tokens)."""
        return max_tokens if ignore_eos else min(max_tokens, self.typical())


def predict_service_s(prompt_tokens: int, output_tokens: int, step_ms: float, prefill_tokens_per_s: float) -> float:
    """Seconds from dispatch to a request's last token: half a step of waiting for the step already
    running, its prompt at ``prefill_tokens_per_s`` (tokens/s) inside the step that yields its first token,
    and one step of ``step_ms`` (ms, the step time at the current running batch, which it joins) per output
    token. An unmeasured rate (0) contributes 0: no prediction is better than a made-up one."""
    prefill = prompt_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else 0.0
    return prefill + (output_tokens + 0.5) * max(0.0, step_ms) / 1e3 if output_tokens or prefill else 0.0


def cannot_finish(deadline: float, now: float, own_s: float) -> bool:
    """True when a request with ``deadline`` (epoch s; 0 = none) dispatched at ``now`` would still be running
    at its deadline by the prediction ``own_s`` (s): dispatching it would only waste the compute the worker
    spends before aborting it there, so the scheduler ends it with 503 ``deadline_unmeetable`` instead."""
    return bool(deadline) and own_s > 0 and now + own_s > deadline


class ServiceTimeCalibration:
    """How far the predicted service time (:func:`predict_service_s`) is from what requests take from
    dispatch to their last token: the ``quantile`` of actual - predicted (s) over the last ``window``
    finished requests, clamped to [0, ``max_margin_s``], added to every prediction. The per-token part
    of the prediction is measured (the worker's step-loop time), so what it leaves out is mostly a fixed
    cost per request: the wait in the worker before its step, the hops to and from it, the CPU the rest of
    the stack takes at that moment. Additive, not a factor: a factor learnt on short requests would
    multiply a long generation's whole decode. A high quantile, not the mean: a request dispatched with
    just enough time by the mean misses its deadline half the time, and its compute is lost. 0 until
    ``min_samples`` were seen."""

    def __init__(self, quantile: float = 0.9, window: int = 200, min_samples: int = 10,
                 max_margin_s: float = 10.0) -> None:
        if not (0 < quantile <= 1 and window >= min_samples >= 1 and max_margin_s >= 0):
            raise ValueError("need 0 < quantile <= 1, window >= min_samples >= 1 and max_margin_s >= 0")
        self.quantile, self.min_samples, self.max_margin_s = quantile, min_samples, max_margin_s
        self._residuals: deque[float] = deque(maxlen=window)
        self.margin_s = 0.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        """Fold one finished request in (seconds; ignored without a prediction or a positive actual)."""
        if predicted_s > 0 and actual_s > 0:
            self._residuals.append(min(self.max_margin_s, max(0.0, actual_s - predicted_s)))
            if len(self._residuals) >= self.min_samples:
                s = sorted(self._residuals)
                self.margin_s = s[int(round(self.quantile * (len(s) - 1)))]


def slot_wait_s(now: float, finish_times: list[float], free_slots: int) -> float:
    """Seconds until a request could start on a worker: 0 with a free slot, else until the earliest
    predicted finish (epoch s) of the running requests (0 when none is known)."""
    if free_slots > 0 or not finish_times:
        return 0.0
    return max(0.0, min(finish_times) - now)
