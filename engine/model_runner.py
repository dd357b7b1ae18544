"""Owns the weights, the KV cache and the Gated DeltaNet state slots, turns a scheduled batch into
tensors, runs the model and samples."""
from __future__ import annotations

import contextlib
import logging

import torch

from engine.attention_metadata import AttentionMetadata, DecodeGroup, PrefillGroup
import kernels
from engine.config import EngineConfig, key_ops
from engine.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from engine.host_staging import HostStaging
from engine.kernel_choice import select_kernels
from engine.layers.attention import PagedAttention
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.sampler import greedy
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.state_cache import allocate_states, state_metadata
from engine import warm_up

log = logging.getLogger("engine")

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # without ``kv-cache-memory`` and without a GPU to measure
GIB = float(1 << 30)


def fixed_cache_budget(config, device_type: str) -> int | None:
    """Bytes of KV cache a config asks for outright (``kv-cache-memory``, or the CPU default); None on a GPU
    without it: the ``gpu-memory-utilization`` share left after profiling decides there."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    return None if device_type == "cuda" else DEFAULT_CPU_KV_CACHE_MEMORY


@contextlib.contextmanager
def _defaults(device: torch.device, dtype: torch.dtype):
    """Create parameters directly on ``device`` in ``dtype``: a 35B model must never pass through
    host memory or float32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.block_size = config.block_size
        cfg = config.hf
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._check_weights_fit()
        fixed_budget = fixed_cache_budget(self.config, self.device.type)
        if fixed_budget is not None:  # fail before allocating anything
            self._blocks_for(fixed_budget, "kv-cache-memory")
        self.kernels = select_kernels(config, self.device, self.dtype)
        self.staging = HostStaging(self.device)
        self.decode_graphs: DecodeGraphs | None = None  # captured last; the profiling step runs eager
        with _defaults(self.device, self.dtype):
            self.model = Qwen3MoeForCausalLM(cfg, self.kernels)
        self.model.requires_grad_(False)
        self.model.init_weights(config.seed)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.linear_layers = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        # one state slot per sequence that may run, and a scratch slot (the last) for the padding rows
        # of static decode steps, allocated before the KV cache is sized
        self.num_state_slots = config.max_num_seqs if self.linear_layers else 0
        self.scratch_state_slot = self.num_state_slots if self.linear_layers else None
        state_bytes = allocate_states(self.linear_layers, self.num_state_slots + 1, self.dtype, config.state_dtype(),
                                      self.device) \
            if self.linear_layers else 0
        if self.linear_layers:
            log.info("Gated DeltaNet state: %d slots and a scratch one (%.2f GiB)", self.num_state_slots,
                     state_bytes / GIB)
        if fixed_budget is None:
            self.num_blocks = self._blocks_for(self._profile_cache_budget(), "gpu-memory-utilization")
        else:
            self.num_blocks = self._blocks_for(fixed_budget, "kv-cache-memory")
        self._allocate_cache(self.num_blocks)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                 self.num_blocks * self._block_bytes() / GIB)
        # Triton compiles each kernel variant on first use: on a GPU, before the first request rather than in it
        self.warm_up_seconds = warm_up.run(self) if self.device.type == "cuda" else 0.0
        self.graphs_off_reason = self._capture_decode_graphs()

    # ------------------------------------------------------------------ memory
    def _element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def _block_bytes(self) -> int:
        return self.config.hf.kv_bytes_per_token(self._element_size()) * self.block_size


    def _check_weights_fit(self) -> None:
        free, total = torch.cuda.mem_get_info(self.device)
        need = self.config.hf.num_params() * self._element_size()
        if need > free:
            raise self.config.error(
                "num-layers", f"the weights need {need / GIB:.1f} GiB but {self.device} has {free / GIB:.1f} GiB "
                              f"free of {total / GIB:.1f}; lower num-layers, or free the card: {self._holders()}")

    def _holders(self) -> str:
        import os

        from engine.gpu_memory import describe_holders

        return describe_holders(self.device.index or 0, os.getpid())

    def _blocks_for(self, budget: float, key: str) -> int:
        num_blocks = max(0, int(budget // self._block_bytes()))
        need = _cdiv(self.config.max_model_len, self.block_size)
        if num_blocks < need:
            on_card = f"; {self._holders()}" if self.device.type == "cuda" else ""
            raise self.config.error(
                key, f"the KV cache would hold {num_blocks * self.block_size} tokens ({max(budget, 0) / GIB:.3f} GiB),"
                     f" fewer than one sequence of max-model-len {self.config.max_model_len}; "
                     f"give it more memory or lower max-model-len{on_card}")
        return num_blocks

    def _profile_cache_budget(self) -> float:
        """GPU bytes left for the cache: the ``gpu-memory-utilization`` share of the card, less
        what is in use and the activation peak of the largest prefill the scheduler may send."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        num_blocks = _cdiv(n, self.block_size)
        self._allocate_cache(num_blocks)
        seq = Sequence("profile", [0] * n, 1)
        seq.block_table = list(range(num_blocks))
        seq.state_slot = 0 if self.linear_layers else None
        self.run([ScheduledSeq(seq, n)])
        self._allocate_cache(0)
        torch.cuda.synchronize()
        peak, current = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total * self.config.gpu_memory_utilization - (total - free) - (peak - current)

    def _allocate_cache(self, num_blocks: int) -> None:
        """``num_blocks`` for sequences plus one scratch block (the last) that padding rows of a
        static decode step write to and read from."""
        cfg = self.config.hf
        x = 16 // self._element_size()
        for layer in self.attention_layers:
            layer.key_cache = layer.value_cache = None
        for layer in self.attention_layers:
            layer.key_cache = torch.zeros(num_blocks + 1, cfg.num_kv_heads, cfg.head_size // x, self.block_size, x,
                                          dtype=self.dtype, device=self.device)
            layer.value_cache = torch.zeros(num_blocks + 1, cfg.num_kv_heads, cfg.head_size, self.block_size,
                                            dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ static decode steps
    def _capture_decode_graphs(self) -> str | None:
        """On a GPU with ``cuda-graphs: true``, capture the decode steps; returns why not, or None."""
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return None
        reason = self._graph_blocker()
        if reason is None:
            try:
                self.use_static_decode(capture=True)
            except Exception as exc:  # a failed capture must not stop serving: stay eager, say why
                self.decode_graphs, reason = None, f"capture failed: {type(exc).__name__}: {exc}"
                torch.cuda.synchronize()
        if reason is not None:
            log.warning("cuda-graphs: decode steps stay eager: %s", reason)
        return reason

    def _graph_blocker(self) -> str | None:
        """Why decode steps cannot be captured with this model and the kernels chosen, or None."""
        if not getattr(self.model, "static_decode", False):  # e.g. per-sequence state outside the KV cache
            return f"{type(self.model).__name__} declares no static decode path (static_decode = True)"
        keys = ["attention-decode", "moe-dispatch", "rms-norm", "qk-norm-rope"]
        if self.linear_layers:
            keys += ["gdn-decode", "gdn-fused"]
        for key in keys:
            variant = self.kernels.choice[key]
            for op in key_ops(key):
                if not kernels.graph_safe(op, variant):
                    safe = ", ".join(kernels.graph_safe_variants(op))
                    return f"{key} variant {variant} waits on the device ({op} graph-safe: {safe})"
        return None

    def use_static_decode(self, capture: bool) -> None:
        """Run pure decode steps on static, bucket-padded buffers: captured as CUDA graphs when
        ``capture`` (needs a GPU and graph-safe kernels), else eagerly through the same code."""
        self.decode_graphs = DecodeGraphs(
            self.model, min(self.config.max_num_seqs, MAX_GRAPH_BATCH), _cdiv(self.config.max_model_len, self.block_size),
            self.block_size, self.num_blocks, self.device, capture, self.scratch_state_slot)

    def _static_decode_fits(self, scheduled: list[ScheduledSeq]) -> bool:
        graphs = self.decode_graphs
        if graphs is None or len(scheduled) > graphs.max_rows or any(s.num_new_tokens != 1 for s in scheduled):
            return False
        if self.linear_layers and any(s.seq.num_computed_tokens == 0 for s in scheduled):
            return False  # a one-token prompt: its state slot is zeroed first, eagerly
        if self.kernels.choice["attention-decode"] == self.kernels.choice["attention-decode-long"]:
            return True
        threshold = self.config.decode_long_threshold
        return all(s.seq.num_computed_tokens + 1 <= threshold for s in scheduled)

    # ------------------------------------------------------------------ one step
    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self.staging.tensor(values, dtype)

    def _tables(self, seqs_blocks: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(b) for b in seqs_blocks))
        flat = [x for b in seqs_blocks for x in b + [0] * (width - len(b))]
        return self._tensor(flat, torch.int32).view(len(seqs_blocks), width)

    def _decode_group(self, scheduled: list[ScheduledSeq], rows: list[int], start: int) -> DecodeGroup | None:
        if not rows:
            return None
        lens = [scheduled[i].seq.num_computed_tokens + 1 for i in rows]
        tables = [scheduled[i].seq.block_table[:_cdiv(n, self.block_size)] for i, n in zip(rows, lens)]
        return DecodeGroup(start, start + len(rows), self._tables(tables), self._tensor(lens, torch.int32))

    def prepare(self, scheduled: list[ScheduledSeq]):
        """(input_ids, positions, metadata, sample_rows): tokens ordered short decodes, long
        decodes, prefills; ``sample_rows`` pairs the batch row of each last token with its index
        in ``scheduled``."""
        bs, threshold = self.block_size, self.config.decode_long_threshold
        self.staging.begin_step()
        short, long_, prefill = [], [], []
        for i, item in enumerate(scheduled):
            if item.num_new_tokens > 1:
                prefill.append(i)
            else:
                (long_ if item.seq.num_computed_tokens + 1 > threshold else short).append(i)
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        sample_rows: list[tuple[int, int]] = []
        for i in short + long_ + prefill:
            seq, n = scheduled[i].seq, scheduled[i].num_new_tokens
            c = seq.num_computed_tokens
            ids += seq.token_ids[c:c + n]
            span = range(c, c + n)
            positions += span
            blocks += [seq.block_table[p // bs] for p in span]
            if scheduled[i].samples:
                sample_rows.append((len(ids) - 1, i))
        pos = self._tensor(positions, torch.int64)
        prefill_group = None
        if prefill:
            start = len(short) + len(long_)
            ctx = [scheduled[i].seq.num_computed_tokens for i in prefill]
            qsl = [0]
            for i in prefill:
                qsl.append(qsl[-1] + scheduled[i].num_new_tokens)
            tables = [scheduled[i].seq.block_table[:_cdiv(c, bs)] for i, c in zip(prefill, ctx)]
            prefill_group = PrefillGroup(start, self._tables(tables), self._tensor(qsl, torch.int32),
                                         self._tensor(ctx, torch.int32))
        order = short + long_ + prefill
        meta = AttentionMetadata(
            slot_blocks=self._tensor(blocks, torch.int64), slot_offsets=pos % bs,
            decode=self._decode_group(scheduled, short, 0),
            decode_long=self._decode_group(scheduled, long_, len(short)),
            prefill=prefill_group,
            state=state_metadata([scheduled[i].seq for i in order], [scheduled[i].num_new_tokens for i in order],
                                 len(short) + len(long_), self._tensor) if self.linear_layers else None)
        return self._tensor(ids, torch.int64), pos, meta, sample_rows

    def launch(self, scheduled: list[ScheduledSeq], pending: dict[int, int]):
        """A pure decode step on the static buffers, queued on the device with no wait (its inputs still there
        by ``pending``: StaticDecodeInputs.fill); None where the step is not one (it then runs with ``run``)."""
        if not self._static_decode_fits(scheduled):
            return None
        return self.decode_graphs.launch(scheduled, pending)

    @torch.no_grad()
    def run(self, scheduled: list[ScheduledSeq]) -> list[int | None]:
        """The sampled token of each scheduled sequence whose chunk reaches its end, else None."""
        if self._static_decode_fits(scheduled):
            tokens = self.decode_graphs.run(scheduled)
            return [t if item.samples else None for item, t in zip(scheduled, tokens)]
        input_ids, positions, meta, sample_rows = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, meta)
        out: list[int | None] = [None] * len(scheduled)
        if sample_rows:
            rows = self._tensor([r for r, _ in sample_rows], torch.int64)
            for (_, i), token in zip(sample_rows, greedy(self.model.compute_logits(hidden[rows]))):
                out[i] = token
        return out
