"""Paged KV block allocator with prefix caching (pure: no torch, no nats).

Each sequence owns a block table (list of physical block ids); block ``i`` of the table holds the
sequence's tokens ``i*block_size .. (i+1)*block_size - 1``.  Idea from PagedAttention
(Kwon et al. 2023).  Every mutating call has a ``can_x`` check; mutators return None when there
is no room (and change nothing).

Prefix caching (automatic prefix caching by block hashes, the scheme of vLLM's APC described in
its docs; written here from that description):

* A *full* block whose K/V has been computed is registered under a chain hash:
  ``h_i = blake2b(h_{i-1} || token ids of block i)``, so equal hashes mean equal token prefixes
  (128-bit digests; a collision is as unlikely as in any content-addressed store).  The chain's root
  ``h_{-1}`` is the sequence's cache salt (actors/cache_salt.py: model version, tenant or cache-sharing
  group, adapter), so sequences with different salts never share a block (``b""``: no salt).
* Blocks carry reference counts.  A new sequence whose token ids start with cached full blocks
  takes them (refcount + 1) instead of fresh ones, and its first ``hits * block_size`` tokens
  count as computed.  At least one token is always left to compute (its logits are needed).
* A block whose refcount drops to 0 keeps its contents and hash and waits in an LRU list; it is
  evicted (hash dropped, block reused) only when no never-used/unhashed block is free.
  A sequence's blocks are released tail first, so a prefix's tail is evicted before its head.
* Free-block counts include evictable cached blocks: they are free for allocation purposes.

Sliding windows (decision 0046): ``release_before_window`` releases a sequence's leading blocks whose every
token lies before every later query's window; its table keeps its length (positions stay block indices), each
released entry standing as the first block it keeps (never read: the native decode kernel's table starts
inside the window, the torch path masks those keys out).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, tokens) -> bytes:
    """Chain hash of one full block: 16-byte blake2b of the parent hash and the token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Allocates ``num_blocks`` blocks of ``block_size`` token slots among sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # refcount 0, no cached contents
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}  # token slots reserved per sequence
        self._hash_of: dict[int, bytes] = {}  # block -> chain hash (cached full blocks)
        self._block_of: dict[bytes, int] = {}  # chain hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached blocks, LRU first
        self._seq_hashes: dict[str, list[bytes]] = {}  # chain hashes of each sequence's full blocks
        self._salt: dict[str, bytes] = {}  # each sequence's cache salt (the chain's root; absent = b"")
        self._released: dict[str, int] = {}  # leading table entries released (sliding window; absent = 0)
        self.prefix_query_tokens = 0  # prompt tokens looked up in the cache (tokens)
        self.prefix_hit_tokens = 0  # of which found cached (tokens)

    # ------------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence (including cached blocks that may be evicted)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by sequences."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered prefix (owned or evictable)."""
        return len(self._hash_of)

    def has_seq(self, seq_id: str) -> bool:
        """True if ``seq_id`` currently owns a block table."""
        return seq_id in self._tables

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's physical block ids, in token order (KeyError if unknown)."""
        return self._tables[seq_id]

    def num_slots(self, seq_id: str) -> int:
        """Token slots reserved for ``seq_id`` (tokens)."""
        return self._num_slots[seq_id]

    def ref_count(self, block: int) -> int:
        """Sequences sharing ``block``."""
        return self._ref[block]

    # ------------------------------------------------------------------ prefix cache

    def _match(self, token_ids, salt: bytes = b"") -> tuple[list[int], list[bytes]]:
        """Cached blocks (and their hashes) of the longest cached full-block prefix of ``token_ids`` under
        ``salt``, leaving at least one token uncached."""
        if not self.enable_prefix_caching or not token_ids:
            return [], []
        bs, blocks, hashes, parent = self.block_size, [], [], salt
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def cached_prefix_tokens(self, token_ids, salt: bytes = b"") -> int:
        """Tokens of ``token_ids`` a new sequence with cache ``salt`` would find cached (a multiple of
        block_size)."""
        return len(self._match(token_ids, salt)[0]) * self.block_size

    def cache_blocks(self, seq_id: str, token_ids, num_computed_tokens: int) -> None:
        """Register ``seq_id``'s full blocks among its first ``num_computed_tokens`` tokens."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        hashes, table, bs = self._seq_hashes.setdefault(seq_id, []), self._tables[seq_id], self.block_size
        for i in range(len(hashes), min(num_computed_tokens // bs, len(table))):
            h = block_hash(hashes[-1] if hashes else self._salt.get(seq_id, b""), token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            b = table[i]
            if i < self._released.get(seq_id, 0):  # a stand-in entry (release_before_window), not block i
                continue
            if h not in self._block_of and b not in self._hash_of:
                self._block_of[h] = b
                self._hash_of[b] = h

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (evictable blocks become plain free blocks); returns how many."""
        n = len(self._hash_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._seq_hashes.clear()
        return n

    # ------------------------------------------------------------------ allocation

    def _take_free(self) -> int:
        """A free block: an unhashed one first, else evict the least recently used cached block."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(b)]
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if b in self._hash_of:
                self._evictable[b] = None  # most recently used end
            else:
                self._free.append(b)

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new sequence of ``num_tokens`` tokens fits in the free blocks (no prefix hits)."""
        return blocks_for(num_tokens, self.block_size) <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int, token_ids=None, salt: bytes = b"") -> list[int] | None:
        """Give new sequence ``seq_id`` slots for ``num_tokens`` tokens; its table, or None if no room.

        With ``token_ids`` (the sequence's tokens) and prefix caching on, cached full blocks of its
        prefix under the same ``salt`` (actors/cache_salt.py: model version, tenant scope, adapter) are
        shared (see ``cached_prefix_tokens``); ``num_tokens`` counts them too. The blocks it fills are
        registered under that salt.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        hits, hashes = self._match(token_ids, salt) if token_ids is not None else ([], [])
        hits, hashes = hits[: num_tokens // self.block_size], hashes[: num_tokens // self.block_size]
        new = blocks_for(num_tokens, self.block_size) - len(hits)
        if new > self.num_free_blocks - sum(1 for b in hits if self._ref[b] == 0):
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        self._tables[seq_id] = hits + [self._take_free() for _ in range(new)]
        self._num_slots[seq_id] = num_tokens
        if salt:
            self._salt[seq_id] = salt
        if self.enable_prefix_caching and token_ids is not None:
            self._seq_hashes[seq_id] = hashes
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += len(hits) * self.block_size
        return self._tables[seq_id]

    def _extra_blocks(self, seq_id: str, num_new_tokens: int) -> int:
        """Blocks to add so ``seq_id`` holds ``num_new_tokens`` more tokens."""
        total = self._num_slots[seq_id] + num_new_tokens
        return blocks_for(total, self.block_size) - len(self._tables[seq_id])

    def can_append(self, seq_id: str, num_new_tokens: int = 1) -> bool:
        """True if ``seq_id`` can grow by ``num_new_tokens`` tokens."""
        return self._extra_blocks(seq_id, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq_id: str, num_new_tokens: int = 1) -> list[int] | None:
        """Grow ``seq_id`` by ``num_new_tokens`` slots; its table, or None (unchanged) if no room."""
        if not self.can_append(seq_id, num_new_tokens):
            return None
        extra = self._extra_blocks(seq_id, num_new_tokens)
        self._tables[seq_id].extend(self._take_free() for _ in range(extra))
        self._num_slots[seq_id] += num_new_tokens
        return self._tables[seq_id]

    def append_slot(self, seq_id: str) -> list[int] | None:
        """Grow ``seq_id`` by one token slot (decode step); table or None."""
        return self.append_slots(seq_id, 1)

    def num_held(self, seq_id: str) -> int:
        """Blocks ``seq_id`` holds: its table less the entries released before its window."""
        return len(self._tables[seq_id]) - self._released.get(seq_id, 0)

    def release_before_window(self, seq_id: str, num_computed_tokens: int, window: int) -> int:
        """Release ``seq_id``'s leading blocks no later query reads under a sliding ``window`` (tokens): a query
        at position p >= ``num_computed_tokens`` reads keys > p - window, so keys at positions up to
        ``num_computed_tokens - window`` are done with, and so is every block wholly among them. The table keeps
        its length, released entries standing as its first kept block (module docstring); at least one block is
        kept. Shared blocks stay with their other owners, cached ones stay cached until evicted. Returns how many
        blocks it released now."""
        table = self._tables[seq_id]
        done = (num_computed_tokens - window + 1) // self.block_size  # blocks wholly before the window
        done = min(done, len(table) - 1)
        start = self._released.get(seq_id, 0)
        if done <= start:
            return 0
        for i in range(start, done):
            self._release(table[i])
            table[i] = table[done]
        self._released[seq_id] = done
        return done - start

    def free(self, seq_id: str) -> int:
        """Release all blocks of ``seq_id`` (no-op if unknown), tail first; returns how many it held.

        Shared blocks stay with their other owners; cached blocks stay cached until evicted.
        """
        released = self._released.pop(seq_id, 0)
        table = self._tables.pop(seq_id, [])[released:]
        self._num_slots.pop(seq_id, None)
        self._seq_hashes.pop(seq_id, None)
        self._salt.pop(seq_id, None)
        for b in reversed(table):
            self._release(b)
        return len(table)
