"""Prefix-cache affinity: remember which worker holds which prompt prefix, by chained block hashes.

Pure module (no torch, no nats). The worker's prefix cache (actors/worker/engine/block_manager.py)
reuses KV blocks of equal full-block token prefixes; a request only benefits if it lands on the
worker that computed that prefix. The scheduler hashes the prompt's full blocks as a chain
(h_i = hash(h_{i-1}, block_i), the same idea as vLLM's automatic prefix caching) and keeps an LRU
index hash -> worker of what it dispatched. Routing then prefers, among workers that can take the
request, the one with the longest indexed prefix, and falls back to least-loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = 256, salt: bytes = b"") -> list[int]:
    """Chained hashes of the first ``max_blocks`` full blocks of ``token_ids`` (a partial tail is ignored), the
    chain rooted at the request's prefix-cache ``salt`` (actors/cache_salt.py) as in the workers' block manager:
    the same tokens under another tenant's salt match nothing."""
    out, prev = [], hash(salt) if salt else 0
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        prev = hash((prev, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(prev)
    return out


class PrefixIndex:
    """LRU map block-chain hash -> worker id, bounded to ``capacity`` entries."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._where: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def record(self, hashes: Sequence[int], worker_id: str) -> None:
        """``worker_id`` now holds these blocks (it was sent a request with this prefix)."""
        for h in hashes:
            self._where[h] = worker_id
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[int], worker_id: str) -> int:
        """How many leading blocks of ``hashes`` are indexed on ``worker_id``."""
        n = 0
        for h in hashes:
            if self._where.get(h) != worker_id:
                break
            n += 1
        return n

    def forget_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker that left."""
        for h in [h for h, w in self._where.items() if w == worker_id]:
            del self._where[h]
