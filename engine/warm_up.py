"""The kernel variants a served step can launch, compiled before the server answers its first request.

Triton compiles a kernel the first time it runs with new compile-time constants, and the wrappers pick some by
size: the MoE's launch configuration by rows per expert, decode attention's tile by the longest context and
its split count by batch and context. (The counts and widths that change every step are not specialized on:
``triton_env.jit_per_step``.) Compiled lazily, that happens inside a fresh server's first samples, on the core
its measurements share: on an H100 the first `moe-triton` server ran 3 engine steps in its 10-s warm-up window
and its decision's interval spanned -28% to +371% (BENCHMARKS.md). So a GPU model runner first runs throwaway
steps of every kind and size class the scheduler can send to its Triton kernels (none where it runs torch ones:
every server start pays for them); ``python -m kernels.compile_report --sweep`` checks
that no other step size compiles anything more. Triton keeps what it compiled on disk: the first server of a
state on a machine pays the compile time here, later ones load it.

The steps write only junk that no request reads: K/V into blocks a request overwrites before it attends to
them (none is registered in the prefix cache), and state into slots zeroed at a request's first token.
"""
from __future__ import annotations

import logging
import time

import torch

import kernels
from engine.config import key_ops
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

log = logging.getLogger("engine")


def token_counts(limit: int) -> list[int]:
    """1, then every power of two up to ``limit`` and the count after it, and ``limit``: both residues of 16 at
    every scale, and a count in each band of a size table whose bounds are at least twice apart."""
    counts = {1, limit}
    p = 2
    while p <= limit:
        counts.update((p, p + 1))
        p *= 2
    return sorted(c for c in counts if c <= limit)


class _Dummies:
    """Throwaway sequences over the runner's blocks and state slots (reused round-robin)."""

    def __init__(self, block_size: int, num_blocks: int, num_slots: int | None):
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        self.next_block = 0

    def seq(self, computed: int, new: int, slot: int) -> ScheduledSeq:
        s = Sequence("warm-up", [0] * (computed + new), 1)
        s.num_computed_tokens = computed
        n = -(-(computed + new) // self.block_size)
        s.block_table = [(self.next_block + i) % self.num_blocks for i in range(n)]
        self.next_block = (self.next_block + n) % self.num_blocks
        s.state_slot = slot % self.num_slots if self.num_slots else None
        return ScheduledSeq(s, new)


def compiled_keys(choice: dict[str, str]) -> set[str]:
    """The kernel keys whose chosen variant is a Triton kernel (the torch ones compile nothing)."""
    return {key for key, variant in choice.items() if any(kernels.uses_triton(op, variant) for op in key_ops(key))}


def plan(max_tokens: int, max_seqs: int, max_model_len: int, block_size: int, num_blocks: int,
         num_slots: int | None, compiled: set[str], long_threshold: int | None = None) -> list[list[ScheduledSeq]]:
    """The steps for the Triton kernels of ``compiled`` (kernel keys): prompts of every token count class, a
    chunk after a cached context where a prefill kernel reads one, decode steps of every batch size class (at
    contexts of every power of two, and past ``long_threshold``, only where decode attention is Triton), and mixed
    steps whose prefill rows start at offsets of both residues. None where nothing compiles: every step costs a
    server start its time."""
    if not compiled:
        return []
    d = _Dummies(block_size, num_blocks, num_slots)
    context = 2 * block_size + 1  # a partial last block behind full ones
    steps = [[d.seq(0, n, 0)] for n in token_counts(min(max_tokens, max_model_len))]
    if compiled & {"attention-prefill", "gdn-prefill", "gdn-fused"}:
        steps += [[d.seq(context, n, 0)] for n in token_counts(min(max_tokens, max_model_len - context))]
    # decode attention picks its tile by the longest context (one block, two, more) and its splits by batch size
    # and context: every batch size class at each such context and each power of two from 256 tokens (and past
    # the long-context threshold); the other kernels see a decode step's rows only as a token count
    contexts = {block_size}
    if compiled & {"attention-decode", "attention-decode-long"}:
        contexts |= {context} | {c + 1 for c in (256 << i for i in range(32)) if c + 2 <= max_model_len}
    if long_threshold is not None and long_threshold < max_model_len:
        contexts.add(long_threshold)
    for ctx in sorted(contexts):
        steps += [[d.seq(ctx, 1, i) for i in range(b)] for b in token_counts(max_seqs)]
    rows = [b for b in (1, 2, 16, 17) if b < max_seqs]
    chunks = [n for n in (2, 16, 17) if rows and max(rows) + n <= max_tokens and context + n <= max_model_len]
    steps += [[d.seq(context, 1, i) for i in range(b)] + [d.seq(context, n, b)] for b in rows for n in chunks]
    return steps


def run(runner) -> float:
    """Runs the plan on ``runner`` (a ModelRunner, its cache allocated, no graphs captured yet); returns the
    seconds it took."""
    cfg = runner.config
    start = time.perf_counter()
    choice = runner.kernels.choice
    compiled = compiled_keys(choice)
    long_variant = "attention-decode-long" in compiled and choice["attention-decode"] != choice["attention-decode-long"]
    steps = plan(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len, runner.block_size,
                 runner.num_blocks, runner.num_state_slots or None, compiled,
                 cfg.decode_long_threshold if long_variant else None)
    for step in steps:
        runner.run(step)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - start
    log.info("warm-up: %d steps in %.1f s for %s (kernels compiled or loaded from Triton's cache)", len(steps),
             seconds, ", ".join(sorted(compiled)) or "no Triton kernel")
    return seconds
