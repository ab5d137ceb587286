"""Paged KV block allocator (pure: no torch, no nats).

Each sequence owns a block table (list of physical block ids); block ``i`` of the table holds the
sequence's tokens ``i*block_size .. (i+1)*block_size - 1``.  Idea from PagedAttention
(Kwon et al. 2023).  Every mutating call has a ``can_x`` check; mutators return None when there
is no room (and change nothing).
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates ``num_blocks`` blocks of ``block_size`` token slots among sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}  # token slots reserved per sequence

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by sequences."""
        return self.num_blocks - len(self._free)

    def has_seq(self, seq_id: str) -> bool:
        """True if ``seq_id`` currently owns a block table."""
        return seq_id in self._tables

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's physical block ids, in token order (KeyError if unknown)."""
        return self._tables[seq_id]

    def num_slots(self, seq_id: str) -> int:
        """Token slots reserved for ``seq_id`` (tokens)."""
        return self._num_slots[seq_id]

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new sequence of ``num_tokens`` tokens fits in the free blocks."""
        return blocks_for(num_tokens, self.block_size) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Give new sequence ``seq_id`` slots for ``num_tokens`` tokens; its table, or None if no room."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        if not self.can_allocate(num_tokens):
            return None
        self._tables[seq_id] = [self._free.popleft() for _ in range(blocks_for(num_tokens, self.block_size))]
        self._num_slots[seq_id] = num_tokens
        return self._tables[seq_id]

    def _extra_blocks(self, seq_id: str, num_new_tokens: int) -> int:
        """Blocks to add so ``seq_id`` holds ``num_new_tokens`` more tokens."""
        total = self._num_slots[seq_id] + num_new_tokens
        return blocks_for(total, self.block_size) - len(self._tables[seq_id])

    def can_append(self, seq_id: str, num_new_tokens: int = 1) -> bool:
        """True if ``seq_id`` can grow by ``num_new_tokens`` tokens."""
        return self._extra_blocks(seq_id, num_new_tokens) <= len(self._free)

    def append_slots(self, seq_id: str, num_new_tokens: int = 1) -> list[int] | None:
        """Grow ``seq_id`` by ``num_new_tokens`` slots; its table, or None (unchanged) if no room."""
        if not self.can_append(seq_id, num_new_tokens):
            return None
        extra = self._extra_blocks(seq_id, num_new_tokens)
        self._tables[seq_id].extend(self._free.popleft() for _ in range(extra))
        self._num_slots[seq_id] += num_new_tokens
        return self._tables[seq_id]

    def append_slot(self, seq_id: str) -> list[int] | None:
        """Grow ``seq_id`` by one token slot (decode step); table or None."""
        return self.append_slots(seq_id, 1)

    def free(self, seq_id: str) -> int:
        """Release all blocks of ``seq_id`` (no-op if unknown); returns the number freed."""
        table = self._tables.pop(seq_id, [])
        self._num_slots.pop(seq_id, None)
        self._free.extend(table)
        return len(table)
