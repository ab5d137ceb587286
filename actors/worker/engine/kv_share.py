"""Weighted share of a worker's KV blocks between tenants under contention (pure: no torch, no nats).

Rule (issue [11], docs/decisions/0031-kv-isolation-and-cache-salt.md): while a sequence of tenant B waits
for KV blocks, no tenant A holds more than its weighted share ``total_blocks * w_A / sum(w)`` of them, the
sum over the tenants with a running sequence plus B. Without contention a tenant may hold every block
(work-conserving, as max-min fairness; Demers, Keshav and Shenker, SIGCOMM '89). The iteration scheduler
applies it between steps: the waiting sequence of the tenant furthest below its share goes first, and if
its blocks are missing, the newest running sequences of tenants above their share are recompute-preempted
(vLLM's recompute preemption) until they fit or no tenant is above its share.
"""

from __future__ import annotations

from collections.abc import Mapping


def kv_shares(weights: Mapping[str, float], total_blocks: int) -> dict[str, float]:
    """Blocks each contending tenant may hold: ``total_blocks * w / sum(w)`` (weights <= 0 count as 1)."""
    w = {t: (x if x > 0 else 1.0) for t, x in weights.items()}
    total_w = sum(w.values())
    return {t: total_blocks * x / total_w for t, x in w.items()} if total_w else {}


def reclaim_from(held: Mapping[str, int], weights: Mapping[str, float], total_blocks: int,
                 claimant: str, need: int) -> str | None:
    """The tenant to take blocks from so ``claimant`` gets ``need`` more blocks, or None.

    ``held``: blocks held per tenant by running sequences; ``weights``: the contending tenants' weights
    (``claimant`` included). None when the claimant would go above its own share with ``need`` more, or no
    other tenant holds more than its share. Else the tenant furthest above its share (blocks)."""
    shares = kv_shares(weights, total_blocks)
    if held.get(claimant, 0) + need > shares.get(claimant, 0.0):
        return None
    over = {t: n - shares.get(t, 0.0) for t, n in held.items() if t != claimant and n > shares.get(t, 0.0)}
    return max(over, key=lambda t: (over[t], t)) if over else None


def below_share(held: Mapping[str, int], weights: Mapping[str, float], total_blocks: int) -> dict[str, float]:
    """Blocks each tenant of ``weights`` is below its share (negative: above), for picking who goes first."""
    shares = kv_shares(weights, total_blocks)
    return {t: shares[t] - held.get(t, 0) for t in shares}
