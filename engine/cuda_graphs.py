"""Decode steps on static buffers, replayed from CUDA graphs on a GPU.

A pure decode step (every scheduled sequence adds one token) is padded to the next of a few batch
sizes ("buckets"). Its inputs live in static device buffers: token ids, positions, the cache slot
each new K/V goes to, sequence lengths, block tables and, for a hybrid model, each sequence's Gated
DeltaNet state slot. Padding rows attend to one token of a scratch cache block that no sequence
owns and write their K/V there, and read and write a scratch state slot likewise, so they change
nothing. A hybrid model's step is static only in steady state: a sequence computing its first
token (its slot must be zeroed first) or a prefill chunk makes the step eager.
The forward pass, the LM head and the greedy argmax read and write only those buffers, so on a
GPU each bucket's step is captured once as a CUDA graph (all graphs share one memory pool) and
replayed: one launch instead of thousands, and no host synchronisation until the sampled tokens
are read back. Prefill and mixed steps stay eager.

The same buffers and the same forward run eagerly where no graph is captured (the CPU), which is
how the padding and buffer logic is tested without a GPU.
"""
from __future__ import annotations

import logging

import torch

from engine.attention_metadata import AttentionMetadata, DecodeGroup
from engine.layers.sampler import greedy_ids
from engine.scheduler import ScheduledSeq
from engine.state_cache import decode_only

log = logging.getLogger("engine")

MAX_GRAPH_BATCH = 512
# rows of the packed per-step metadata; SOURCE: the row of the step before whose sampled token is this row's input
# (still on the device: async-scheduling), or -1 where the input comes from the host
IDS, POSITIONS, SLOT_BLOCKS, SLOT_OFFSETS, SEQ_LENS, STATE_SLOTS, SOURCE = range(7)


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_rows`` (as nano-vllm)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 16))
    return sizes + [max_rows]


class StaticDecodeInputs:
    """Device buffers a decode step reads, filled from pinned host buffers by two non-blocking
    copies: the per-row values (all rows, a few KiB), and the used columns of the block tables
    (staged contiguously, so the copy moves only what this step's contexts need). The host buffers
    come in two sets, used in turn: a step's copies may still wait in the stream while the next
    step is filled (async-scheduling), and the step before that has been read back by then.
    ``scratch_state_slot``: a hybrid model's spare state slot (None: no Gated DeltaNet layers)."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device, scratch_state_slot: int | None = None):
        pin = device.type == "cuda"
        self.max_rows, self.block_size, self.scratch_block = max_rows, block_size, scratch_block
        self.scratch_state_slot = scratch_state_slot
        self.hosts = [torch.zeros(7, max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.hosts_tables = [torch.zeros(max_rows * max_blocks, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.turn = 0
        self.meta = torch.zeros(7, max_rows, dtype=torch.int64, device=device)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        for turn in range(2):
            self._use(turn)
            self._pad_rows(0, max_rows)
        self.meta.copy_(self.host)
        self.tables[:, 0] = scratch_block

    def _use(self, turn: int) -> None:
        self.turn = turn
        self.host, self.host_tables = self.hosts[turn], self.hosts_tables[turn]
        self._h, self._ht = self.host.numpy(), self.host_tables.numpy()

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows ``start:end`` decode one token of the scratch block and write their K/V there (and
        their state to the scratch state slot)."""
        h = self._h
        h[IDS, start:end] = 0
        h[POSITIONS, start:end] = 0
        h[SLOT_BLOCKS, start:end] = self.scratch_block
        h[SLOT_OFFSETS, start:end] = 0
        h[SEQ_LENS, start:end] = 1
        h[STATE_SLOTS, start:end] = self.scratch_state_slot or 0
        h[SOURCE, start:end] = -1

    def fill(self, scheduled: list[ScheduledSeq], rows: int, pending: dict[int, int] | None = None) -> None:
        """Row i decodes ``scheduled[i]``'s next token; rows past them are padding. ``pending``: by ``id`` of a
        sequence, the row of the step before whose token, not yet read back, is its input."""
        self._use(1 - self.turn)
        bs, h = self.block_size, self._h
        width = max(item.seq.num_computed_tokens // bs + 1 for item in scheduled)
        tables = self._ht[:rows * width].reshape(rows, width)
        for i, item in enumerate(scheduled):
            seq = item.seq
            pos = seq.num_computed_tokens
            source = pending.get(id(seq), -1) if pending else -1
            h[SOURCE, i] = source
            h[IDS, i] = seq.token_ids[pos] if source < 0 else 0
            h[POSITIONS, i] = pos
            h[SLOT_BLOCKS, i] = seq.block_table[pos // bs]
            h[SLOT_OFFSETS, i] = pos % bs
            h[SEQ_LENS, i] = pos + 1
            if self.scratch_state_slot is not None:
                h[STATE_SLOTS, i] = seq.state_slot
            used = pos // bs + 1
            tables[i, :used] = seq.block_table[:used]
        self._pad_rows(len(scheduled), rows)
        tables[len(scheduled):, 0] = self.scratch_block
        self.meta.copy_(self.host, non_blocking=True)
        self.tables[:rows, :width].copy_(self.host_tables[:rows * width].view(rows, width), non_blocking=True)
        if pending:  # the inputs still on the device: the tokens the step before left in ``tokens``
            ids, source = self.meta[IDS, :rows], self.meta[SOURCE, :rows]
            ids.copy_(torch.where(source >= 0, self.tokens[source.clamp(min=0)], ids))

    def metadata(self, rows: int) -> AttentionMetadata:
        m = self.meta
        state = None if self.scratch_state_slot is None else decode_only(m[STATE_SLOTS, :rows])
        return AttentionMetadata(slot_blocks=m[SLOT_BLOCKS, :rows], slot_offsets=m[SLOT_OFFSETS, :rows],
                                 decode=DecodeGroup(0, rows, self.tables[:rows], m[SEQ_LENS, :rows]),
                                 decode_long=None, prefill=None, state=state)


class DecodeGraphs:
    """Runs decode steps of up to ``max_rows`` sequences on static buffers, from a captured CUDA
    graph per bucket when ``capture`` (a GPU), else eagerly through the same code."""

    def __init__(self, model: torch.nn.Module, max_rows: int, max_blocks: int, block_size: int,
                 scratch_block: int, device: torch.device, capture: bool, scratch_state_slot: int | None = None):
        self.model = model
        self.buckets = bucket_sizes(max_rows)
        self.max_rows = max_rows
        self.inputs = StaticDecodeInputs(max_rows, max_blocks, block_size, scratch_block, device, scratch_state_slot)
        self.host_tokens = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=device.type == "cuda")
                            for _ in range(2)]  # each step's tokens read back, in the inputs' turns
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps = 0  # decode steps run on the static buffers
        self.replays = 0  # of which replayed from a graph
        if capture:
            self._capture()

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _forward(self, rows: int) -> None:
        """Model, LM head and greedy choice over the first ``rows`` static rows."""
        inp = self.inputs
        hidden = self.model(inp.meta[IDS, :rows], inp.meta[POSITIONS, :rows], inp.metadata(rows))
        inp.tokens[:rows].copy_(greedy_ids(self.model.compute_logits(hidden)))

    @torch.no_grad()
    def _capture(self) -> None:
        pool = None
        for rows in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool
            self._forward(rows)  # warm-up: compiles the Triton kernels this shape needs
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(rows)
            pool = graph.pool() if pool is None else pool
            self.graphs[rows] = graph
        torch.cuda.synchronize()
        log.info("cuda-graphs: captured decode steps for %d batch sizes up to %d", len(self.graphs),
                 self.max_rows)

    @torch.no_grad()
    def run(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """The greedy next token of each scheduled sequence (all decodes, at most ``max_rows``)."""
        return self.launch(scheduled).tokens()

    @torch.no_grad()
    def launch(self, scheduled: list[ScheduledSeq], pending: dict[int, int] | None = None) -> "Launched":
        """The step queued on the device, its tokens copied back without a wait (``pending``: see ``fill``)."""
        rows = self.bucket(len(scheduled))
        self.inputs.fill(scheduled, rows, pending)
        graph = self.graphs.get(rows)
        self.steps += 1
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._forward(rows)
        host = self.host_tokens[self.inputs.turn]
        host[:len(scheduled)].copy_(self.inputs.tokens[:len(scheduled)], non_blocking=True)
        done = None
        if self.inputs.tokens.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launched(host, len(scheduled), done)


class Launched:
    """A decode step on its way: its tokens, read back when asked for (the wait on the device)."""

    def __init__(self, host: torch.Tensor, rows: int, done):
        self.host, self.rows, self.done = host, rows, done

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host[:self.rows].tolist()
