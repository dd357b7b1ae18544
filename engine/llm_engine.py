"""The step API servers build on: add requests, call ``step()``, collect each step's new tokens."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig, load_config
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.state_cache import StateSlots

log = logging.getLogger("engine")


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache


class LLMEngine:
    def __init__(self, config: str | Path | dict[str, Any] | EngineConfig):
        self.config = load_config(config)
        self.model_runner = ModelRunner(self.config)
        self.kernel_choice: dict[str, str] = dict(self.model_runner.kernels.choice)
        if self.config.enable_prefix_caching and not self.config.prefix_caching:
            log.info("prefix caching is off: the model's Gated DeltaNet state after a prefix is not cached")
        self.scheduler = Scheduler(
            BlockManager(self.model_runner.num_blocks, self.config.block_size, self.config.prefix_caching),
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            state_slots=StateSlots(self.model_runner.num_state_slots) if self.config.hf.is_hybrid else None)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._prefill_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        self._step_seconds = 0.0  # wall time inside the steps that ran something: a server's busy time
        self._step_ended = 0.0  # Unix time the last of them ended: the counters count up to it

    def check_request(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise ValueError for a request the engine can never serve."""
        if not prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) + max_tokens > self.config.max_model_len:
            raise ValueError(f"{len(prompt_token_ids)} prompt tokens + max_tokens {max_tokens} exceed "
                             f"max-model-len {self.config.max_model_len}")

    def add_request(self, prompt_token_ids: list[int], max_tokens: int, request_id: str | None = None) -> str:
        self.check_request(prompt_token_ids, max_tokens)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        elif request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_token_ids, max_tokens)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def step(self) -> list[StepOutput]:
        began = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        sampled = self.model_runner.run(scheduled)
        self._steps += 1
        self._step_seconds += time.perf_counter() - began
        for item in scheduled:  # prompt tokens as their chunks run, not all at once at the first output
            self._prefill_tokens += max(0, min(item.num_new_tokens,
                                               item.seq.num_prompt_tokens - item.seq.num_computed_tokens))
        self.scheduler.update(scheduled, sampled)
        outputs = []
        for item, token in zip(scheduled, sampled):
            if token is None:
                continue
            seq = item.seq
            self._generation_tokens += 1
            if seq.num_output_tokens == 1:
                self._prompt_tokens += seq.num_prompt_tokens
            if seq.is_finished:
                del self._requests[seq.request_id]
            outputs.append(StepOutput(seq.request_id, [token], seq.is_finished, seq.num_prompt_tokens,
                                      seq.num_cached_tokens or 0))
        self._step_ended = time.time()
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks; unknown or finished ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    @property
    def stats(self) -> dict[str, float]:
        s = self.scheduler.stats
        return {"prompt_tokens": self._prompt_tokens, "prefill_tokens": self._prefill_tokens,
                "generation_tokens": self._generation_tokens, "steps": self._steps, "step_seconds": self._step_seconds,
                "step_ended": self._step_ended,
                "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                "preemptions": s.preemptions, "requests_finished": s.requests_finished}
