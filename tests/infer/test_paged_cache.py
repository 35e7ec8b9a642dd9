"""Block manager: allocation, reference counts, prefix caching by content + position chain."""

import pytest

from llmopt.infer.batch.blocks import BlockManager, OutOfBlocksError, block_digest


def test_allocate_and_free_counts_exactly():
    bm = BlockManager(num_blocks=4, block_size=2)
    got = [bm.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3]
    assert bm.num_free == 0 and bm.num_used == 4
    with pytest.raises(OutOfBlocksError, match="all 4 KV blocks are in use"):
        bm.allocate()
    bm.free(got[:2])
    assert bm.num_free == 2
    bm.free(got[2:])
    bm.check_all_free()


def test_double_free_is_refused():
    bm = BlockManager(num_blocks=2, block_size=2)
    b = bm.allocate()
    bm.free([b])
    with pytest.raises(RuntimeError, match=f"KV block {b} freed more often"):
        bm.free([b])


def test_blocks_for_rounds_up():
    bm = BlockManager(num_blocks=2, block_size=16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def _fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and register full blocks for tokens, like the engine does."""
    blocks, digest = [], b""
    for i in range(len(tokens) // bm.block_size):
        b = bm.allocate()
        digest = bm.register(b, digest, tokens[i * bm.block_size : (i + 1) * bm.block_size])
        blocks.append(b)
    return blocks


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _fill(bm, [1, 2, 3, 4, 5, 6])
    hits, digest = bm.match_prefix([1, 2, 3, 4, 9, 9, 7], max_blocks=3)
    assert hits == a[:2]  # third block differs
    assert digest == block_digest(block_digest(b"", [1, 2]), [3, 4])
    assert bm.ref_count[a[0]] == 2 and bm.ref_count[a[2]] == 1
    bm.free(a)
    assert bm.ref_count[a[0]] == 1  # still held by the second sequence
    bm.free(hits)
    bm.check_all_free()


def test_same_tokens_at_another_position_do_not_match():
    bm = BlockManager(num_blocks=8, block_size=2)
    _fill(bm, [1, 2, 3, 4])
    hits, _ = bm.match_prefix([3, 4, 1, 2], max_blocks=2)
    assert hits == []


def test_freed_blocks_stay_cached_until_reused_then_evicted_oldest_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = _fill(bm, [1, 2, 3, 4])
    bm.free(a)
    hits, _ = bm.match_prefix([1, 2, 3, 4, 5], max_blocks=2)
    assert hits == a and bm.prefix_hits == 2
    bm.free(hits)
    # the never-used block goes first, then the tail block (freed first), then the head
    order = [bm.allocate() for _ in range(3)]
    assert order[0] not in a and order[1:] == [a[1], a[0]]
    bm.free(order)
    assert bm.match_prefix([1, 2, 3, 4], max_blocks=2)[0] == []  # evicted: no stale hit


def test_max_blocks_and_disabled_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    _fill(bm, [1, 2, 3, 4])
    assert len(bm.match_prefix([1, 2, 3, 4], max_blocks=1)[0]) == 1
    off = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    _fill(off, [1, 2, 3, 4])
    assert off.match_prefix([1, 2, 3, 4], max_blocks=2)[0] == []


@pytest.mark.parametrize(
    "kwargs", [{"num_blocks": 0, "block_size": 4}, {"num_blocks": 4, "block_size": 0}]
)
def test_bad_sizes_are_refused(kwargs):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(**kwargs)
