"""Bounded memory of recently seen ids (e.g. cancels heard before the request they cancel arrived)."""

from __future__ import annotations

import time


class RecentIds:
    """Ids with a value, forgotten ``ttl_s`` seconds after being added; at most ``max_size`` are kept.

    Cancels travel on ``as.int.cancel.<id>`` independently of the request itself, so an actor can hear
    a cancel before the request reaches it (gateway -> validator -> scheduler -> worker are separate
    publishers: NATS orders nothing between them). Remembering the cancel for a while closes that race.
    """

    def __init__(self, ttl_s: float = 30.0, max_size: int = 10_000) -> None:
        if ttl_s <= 0 or max_size <= 0:
            raise ValueError("ttl_s and max_size must be positive")
        self.ttl_s, self.max_size = ttl_s, max_size
        self._items: dict[str, tuple[float, object]] = {}  # id -> (time added, value), oldest first

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: str, value: object = True, now: float | None = None) -> None:
        """Remember ``key`` (again: its clock restarts) and forget what expired or overflows."""
        now = time.monotonic() if now is None else now
        self._items.pop(key, None)
        self._items[key] = (now, value)
        while self._items:
            oldest = next(iter(self._items))
            if now - self._items[oldest][0] <= self.ttl_s and len(self._items) <= self.max_size:
                break
            del self._items[oldest]

    def pop(self, key: str, now: float | None = None):
        """The value of ``key`` if it was added within ``ttl_s`` (and forget it), else None."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        now = time.monotonic() if now is None else now
        return item[1] if now - item[0] <= self.ttl_s else None

    def get(self, key: str, now: float | None = None):
        """The value of ``key`` if it was added within ``ttl_s`` (it is kept, unlike :meth:`pop`), else None."""
        item = self._items.get(key)
        now = time.monotonic() if now is None else now
        return item[1] if item is not None and now - item[0] <= self.ttl_s else None
