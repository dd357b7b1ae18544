from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, max_num_seqs=4, max_tokens=64, prefix=True):
    return Scheduler(BlockManager(num_blocks, block_size, prefix), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_tokens)


def run_step(sched, token=7):
    """Schedule and pretend the model sampled ``token`` wherever a chunk reached a sequence's end."""
    batch = sched.schedule()
    sampled = [token if item.samples else None for item in batch]
    sched.update(batch, sampled)
    return [(item.seq.request_id, item.num_new_tokens) for item in batch]


def test_running_sequences_decode_one_token_and_finish_at_max_tokens():
    sched = make()
    a = Sequence("a", [1, 2, 3], max_tokens=2)
    sched.add(a)
    assert run_step(sched) == [("a", 3)]
    assert a.output_token_ids == [7] and a.status is SequenceStatus.RUNNING
    assert run_step(sched) == [("a", 1)]
    assert a.is_finished and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


def test_max_num_seqs_limits_the_batch():
    sched = make(max_num_seqs=2)
    for rid in "abc":
        sched.add(Sequence(rid, [1, 2], max_tokens=3))
    assert [r for r, _ in run_step(sched)] == ["a", "b"]
    assert [r for r, _ in run_step(sched)] == ["a", "b"]
    assert len(sched.waiting) == 1


def test_prefills_are_chunked_to_the_token_budget_and_decodes_go_first():
    sched = make(max_tokens=5)
    sched.add(Sequence("a", [1, 2], max_tokens=3))
    assert run_step(sched) == [("a", 2)]
    b = Sequence("b", list(range(12)), max_tokens=1)
    sched.add(b)
    assert run_step(sched) == [("a", 1), ("b", 4)]
    assert run_step(sched) == [("a", 1), ("b", 4)]
    assert b.num_computed_tokens == 8 and b.output_token_ids == []
    assert run_step(sched) == [("b", 4)]
    assert b.is_finished


def test_prefix_cache_hits_are_counted_per_request():
    sched = make()
    sched.add(Sequence("a", list(range(10)), max_tokens=1))
    run_step(sched)
    b = Sequence("b", list(range(9)) + [50, 51], max_tokens=1)
    sched.add(b)
    assert run_step(sched) == [("b", 3)]  # 8 of 11 tokens were cached
    assert b.num_cached_tokens == 8
    assert sched.stats.prefix_cache_queries == 21 and sched.stats.prefix_cache_hits == 8


def test_preemption_frees_the_newest_sequence_and_recomputes_it_later():
    sched = make(num_blocks=4, block_size=2, max_num_seqs=2, prefix=False)
    a, b = Sequence("a", [1, 2, 3], max_tokens=4), Sequence("b", [4, 5, 6], max_tokens=4)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each, 4 tokens each after sampling
    assert sched.block_manager.num_free_blocks == 0
    run_step(sched)  # position 3 still fits the second block
    assert sched.stats.preemptions == 0
    run_step(sched)  # a's position 4 needs a third block: b, the newest, is preempted
    assert sched.stats.preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert a.output_token_ids == [7, 7, 7] and b.output_token_ids == [7, 7]
    while sched.has_unfinished():
        run_step(sched)
    assert a.output_token_ids == [7] * 4 and b.output_token_ids == [7] * 4
    assert sched.block_manager.num_free_blocks == 4


def test_a_lone_sequence_that_cannot_grow_preempts_itself_and_resumes():
    sched = make(num_blocks=2, block_size=2, max_num_seqs=1, prefix=False)
    a = Sequence("a", [1, 2, 3], max_tokens=2)
    sched.add(a)
    run_step(sched)
    assert run_step(sched) == [("a", 1)]
    assert a.is_finished


def test_abort_frees_blocks_of_running_and_drops_waiting():
    sched = make(max_num_seqs=1)
    a, b = Sequence("a", [1, 2, 3], max_tokens=5), Sequence("b", [4], max_tokens=5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.abort(a)
    sched.abort(b)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16
