"""Latency figures of one request from its completion record's ``timing`` (pure): TTFT and mean ITL.

The rollout controller compares them between versions (actors/rollout/policy.py); the autoscaler holds
them against a version's SLO (actors/autoscaler/service.py).
"""

from __future__ import annotations

from typing import Any, Mapping

from control.policy.numbers import is_number

__all__ = ["TTFT_KEYS", "ttft_ms", "itl_ms"]

TTFT_KEYS = ("queue_ms", "prefill_ms", "validation_ms", "gateway_ms")  # summed into TTFT when present


def ttft_ms(timing: Mapping[str, Any]) -> float | None:
    """Time to first token of one request, ms: queue + prefill (+ validation, gateway when present);
    None when neither queue_ms nor prefill_ms is there."""
    if not isinstance(timing, Mapping) or ("queue_ms" not in timing and "prefill_ms" not in timing):
        return None
    total = 0.0
    for k in TTFT_KEYS:
        v = timing.get(k)
        if is_number(v) and v > 0:
            total += float(v)
    return total


def itl_ms(timing: Mapping[str, Any], completion_tokens: int) -> float | None:
    """Mean inter-token latency of one request, ms: ``decode_ms / (completion_tokens - 1)``;
    None with fewer than 2 completion tokens or no decode_ms."""
    if not isinstance(timing, Mapping) or not isinstance(completion_tokens, int) or completion_tokens < 2:
        return None
    v = timing.get("decode_ms")
    if not is_number(v, minimum=0):
        return None
    return float(v) / max(1, completion_tokens - 1)
