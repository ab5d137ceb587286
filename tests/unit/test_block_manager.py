"""BlockManager: pure paged-block accounting."""

import pytest

from actors.worker.engine.block_manager import BlockManager, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_takes_ceil_blocks_and_counts_free():
    bm = BlockManager(num_blocks=10, block_size=4)
    table = bm.allocate("a", 9)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 3
    assert bm.num_slots("a") == 9


def test_allocate_returns_none_without_room_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(9)
    assert bm.allocate("a", 9) is None
    assert bm.num_free_blocks == 2 and not bm.has_seq("a")


def test_duplicate_allocate_raises():
    bm = BlockManager(4, 4)
    bm.allocate("a", 1)
    with pytest.raises(ValueError):
        bm.allocate("a", 1)


def test_append_slot_adds_block_only_at_boundary():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 3)
    assert len(bm.append_slot("a")) == 1  # 4th token fits block 0
    assert bm.num_free_blocks == 2
    assert len(bm.append_slot("a")) == 2  # 5th token needs a new block
    assert bm.num_free_blocks == 1


def test_append_none_when_full():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("a", 2)
    bm.allocate("b", 2)
    assert not bm.can_append("a")
    assert bm.append_slot("a") is None
    assert bm.num_slots("a") == 2
    assert bm.can_append("a", 0)


def test_append_slots_many_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 1)
    assert len(bm.append_slots("a", 10)) == 3  # 11 tokens -> 3 blocks
    assert bm.num_slots("a") == 11


def test_free_returns_blocks_and_is_idempotent():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 16)
    assert bm.num_free_blocks == 0
    assert bm.free("a") == 4
    assert bm.num_free_blocks == 4
    assert bm.free("a") == 0
    assert bm.allocate("b", 16) is not None


def test_blocks_are_never_shared():
    bm = BlockManager(num_blocks=6, block_size=2)
    tables = [bm.allocate(s, 4) for s in "abc"]
    flat = [b for t in tables for b in t]
    assert sorted(flat) == list(range(6))


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_module_is_pure():
    import ast

    import actors.worker.engine.block_manager as m

    tree = ast.parse(open(m.__file__).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(x.split(".")[0] in ("torch", "nats") for x in names)


# --------------------------------------------------------------------------------------- sliding windows


def test_release_before_window_frees_leading_blocks_and_keeps_positions():
    """Decision 0046: with window 16 and blocks of 4, after 30 computed tokens a query at position >= 30 reads
    keys > 14: blocks 0..2 (tokens 0..11) are done with, block 3 (12..15) is not."""
    bm = BlockManager(num_blocks=10, block_size=4)
    table = list(bm.allocate("a", 30))
    assert bm.num_free_blocks == 2
    assert bm.release_before_window("a", 30, 16) == 3
    assert bm.num_free_blocks == 5 and bm.num_held("a") == 5
    t = bm.block_table("a")
    assert len(t) == 8 and t[3:] == table[3:] and t[:3] == [table[3]] * 3  # stand-ins: the first kept block
    assert bm.release_before_window("a", 30, 16) == 0  # idempotent
    assert bm.release_before_window("a", 31, 16) == 1  # the next query, at 31, reads keys > 15: block 3 goes
    assert bm.release_before_window("a", 32, 16) == 0
    assert bm.free("a") == 4 and bm.num_free_blocks == 10  # only what it held, each block once


def test_release_before_window_keeps_one_block_and_shared_blocks_stay_with_their_owners():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    ids = list(range(17))
    bm.allocate("a", 17, ids)
    bm.cache_blocks("a", ids, 17)
    bm.allocate("b", 17, ids)  # shares a's four full blocks
    shared = bm.block_table("b")[:4]
    assert bm.release_before_window("a", 17, 1) == 4  # window 1: all but the last block
    assert all(bm.ref_count(b) == 1 for b in shared)  # still b's
    assert bm.num_held("a") == 1
    bm.free("b")
    assert all(bm.ref_count(b) == 0 for b in shared) and bm.cached_prefix_tokens(ids) == 16  # cached, evictable
    bm.free("a")
    assert bm.num_free_blocks == 8
