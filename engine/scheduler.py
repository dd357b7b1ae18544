"""Continuous batching: which sequences run this step, and how many of their tokens.

Running sequences go first (a decode is one token, an unfinished prefill its next chunk), then
waiting ones are admitted while ``max-num-seqs`` and ``max-num-batched-tokens`` allow. When the
cache runs out, the most recently admitted sequence is preempted: its blocks are freed and it
is recomputed later (its full blocks usually come back as prefix-cache hits). For a hybrid model
each running sequence also holds a Gated DeltaNet state slot, from admission to finish or preemption.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.state_cache import StateSlots


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's end, so a token is sampled from it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass
class SchedulerStats:
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    preemptions: int = 0
    requests_finished: int = 0


@dataclass
class Scheduler:
    block_manager: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    state_slots: StateSlots | None = None  # hybrid models: at least max_num_seqs slots

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        if preempted:  # memory is tight: let the running ones make progress first
            return scheduled
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self.block_manager.find_cached(seq)
            num_hit_tokens = len(hit.block_ids) * self.block_manager.block_size
            n = min(len(seq) - num_hit_tokens, budget)
            if not self.block_manager.allocate_slots(seq, n, hit):
                break
            self.stats.prefix_cache_queries += len(seq)
            self.stats.prefix_cache_hits += num_hit_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_hit_tokens
            self.waiting.popleft()
            if self.state_slots is not None:
                self.state_slots.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def update(self, scheduled: list[ScheduledSeq], sampled: list[int | None]) -> None:
        """Advance each sequence by its chunk; append the sampled token where one was drawn."""
        for item, token in zip(scheduled, sampled):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if token is None:
                continue
            seq.append_token(token)
            if seq.num_output_tokens >= seq.max_tokens:
                self._finish(seq)
                self.stats.requests_finished += 1

    def abort(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
        elif seq.status is SequenceStatus.RUNNING:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
