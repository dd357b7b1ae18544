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


PENDING = -1  # the token of a sequence whose step is on its way (async-scheduling), put in place when read back


@dataclass
class _Pending:
    launched: Any  # cuda_graphs.Launched
    scheduled: list
    rows: dict[int, int]  # id(sequence) -> its row


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
        self.async_scheduling = self.config.async_scheduling  # GPU reports time both ways on one engine
        self._pending: _Pending | None = None  # async-scheduling: the step queued and not yet read back

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
        """Runs one step; returns the new tokens read back in it. With async-scheduling a decode step on the graphs'
        buffers is queued, then the step before it read back (its tokens come one call later; the host's work for
        a step overlaps the device's for the one before)."""
        began = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return self._read_back()
        launched = (self.model_runner.launch(scheduled, self._pending.rows if self._pending else {})
                    if self.async_scheduling else None)
        outputs = self._read_back()
        if launched is None:  # its inputs are on the host: read back whatever was on its way, then run it
            sampled = self.model_runner.run(scheduled)
            self._advance(scheduled, sampled, began)
            return outputs + self._outputs(scheduled, sampled)
        self._advance(scheduled, [PENDING] * len(scheduled), began)
        self._pending = _Pending(launched, scheduled, {id(item.seq): i for i, item in enumerate(scheduled)})
        return outputs

    def _advance(self, scheduled, sampled, began: float) -> None:
        self._steps += 1
        self._step_seconds += time.perf_counter() - began
        for item in scheduled:  # prompt tokens as their chunks run, not all at once at the first output
            self._prefill_tokens += max(0, min(item.num_new_tokens,
                                               item.seq.num_prompt_tokens - item.seq.num_computed_tokens))
        self.scheduler.update(scheduled, sampled)

    def _read_back(self) -> list[StepOutput]:
        """The tokens of the step on its way, put in place of its sequences' placeholders."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        tokens = pending.launched.tokens()
        for item, token in zip(pending.scheduled, tokens):
            item.seq.token_ids[-1] = token  # its placeholder: nothing was appended since
        return self._outputs(pending.scheduled, tokens)

    def _outputs(self, scheduled, sampled) -> list[StepOutput]:
        outputs = []
        for item, token in zip(scheduled, sampled):
            if token is None:
                continue
            seq = item.seq
            self._generation_tokens += 1
            if self._requests.get(seq.request_id) is not seq:  # aborted while its step was on its way
                continue
            if seq.num_output_tokens == 1:
                self._prompt_tokens += seq.num_prompt_tokens
            if seq.is_finished:
                del self._requests[seq.request_id]
            outputs.append(StepOutput(seq.request_id, [token], seq.is_finished, seq.num_prompt_tokens,
                                      seq.num_cached_tokens or 0))
        self._step_ended = time.time()
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

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
