from engine.block_manager import BlockManager, hash_block
from engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, tokens, max_tokens=4)


def test_allocates_blocks_for_new_tokens_and_frees_them():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = seq(list(range(10)))
    assert bm.allocate_slots(s, 10)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 1
    s.num_computed_tokens = 10
    assert bm.allocate_slots(s, 1)  # token 11 still fits block 3
    assert bm.num_free_blocks == 1
    s.num_computed_tokens = 12
    assert bm.allocate_slots(s, 1)  # token 13 needs a fourth block
    assert bm.num_free_blocks == 0
    bm.free(s)
    assert bm.num_free_blocks == 4 and s.block_table == []


def test_refuses_without_changing_anything_when_blocks_run_out():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    s = seq(list(range(12)))
    assert not bm.allocate_slots(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_full_blocks_are_hashed_and_found_by_a_later_prompt():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq(list(range(10)), "a")
    bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 2  # the partial third block is not cached
    assert a.block_hashes[1] == hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])

    b = seq(list(range(8)) + [99, 98, 97], "b")
    hit = bm.find_cached(b)
    assert hit.block_ids == a.block_table[:2]
    free_before = bm.num_free_blocks
    assert bm.allocate_slots(b, len(b) - 8, hit)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.num_free_blocks == free_before - 1  # only the third block is new


def test_same_tokens_after_a_different_prefix_do_not_hit():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "a")
    bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 0], "b")
    assert bm.find_cached(b).block_ids == []


def test_the_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq(list(range(8)), "a")
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert len(bm.find_cached(seq(list(range(8)), "b")).block_ids) == 1
    assert len(bm.find_cached(seq(list(range(9)), "c")).block_ids) == 2


def test_freed_blocks_stay_cached_until_reused_and_are_evicted_oldest_first():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    first, second, _ = a.block_table
    bm.free(a)
    assert bm.num_free_blocks == 3
    # still findable after free, and reviving a hit takes it off the free list
    b = seq([1, 2, 3, 4, 7], "b")
    hit = bm.find_cached(b)
    assert hit.block_ids == [first, second]
    assert bm.allocate_slots(b, 1, hit)
    assert bm.num_free_blocks == 0 and bm.blocks[first].ref_count == 1
    bm.free(b)
    # a sequence's tail is freed (and so evicted) before its head
    c = seq([8, 8, 8], "c")
    assert bm.allocate_slots(c, 3)
    assert first not in c.block_table
    assert bm.find_cached(seq([1, 2, 3], "d")).block_ids == [first]


def test_no_hashing_without_prefix_caching():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert a.block_hashes == []
    assert bm.find_cached(seq([1, 2, 3, 4, 5], "b")).block_ids == []
