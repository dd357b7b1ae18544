"""MoE as two grouped GEMMs in Triton over expert-aligned row blocks, in the manner of vLLM's fused_moe.

One kernel routes (softmax, top-k, renormalisation and the shared experts' sigmoid gates, see
``routing.route``) and counts each 16 tokens' pairs per expert; two more group the token-expert pairs by
expert and pad every expert's group to a multiple of BLOCK_M (vLLM's ``moe_align_block_size``: one
program's prefix sums over those histograms, then a scatter), so that each GEMM program's rows share
one expert. The first GEMM computes gate and up projections together and writes ``silu(gate) * up``;
the second applies the down projection and the routing weight; a sum over each token's rows gives the
output. Six launches, none of which waits on the device, so the whole MoE can be captured in a CUDA
graph.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from kernels import triton_env
from kernels.routing import check_moe

import triton  # noqa: E402  (after triton_env: see its docstring)
import triton.language as tl  # noqa: E402


@triton_env.jit_per_step("num_pairs")
def _grouped_gemm(A, W, OUT, PAIRS, BLOCK_EXPERT, ROUTE_W, num_pairs, n_out, k_in,
                  sa0, sw0, sw1, so0, gate_off,
                  TOP_K: tl.constexpr, GATED: tl.constexpr, A_IS_TOKENS: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """OUT[pair] = act(A[row] @ W[e]ᵀ) for the BLOCK_M pairs of one expert block, one BLOCK_N column tile.

    GATED: W holds gate rows then up rows (``gate_off`` apart); writes silu(gate) * up.
    Otherwise the result is multiplied by the pair's routing weight.
    """
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert >= 0:
        pairs = tl.load(PAIRS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        live = pairs < num_pairs
        if A_IS_TOKENS:
            a_row = pairs // TOP_K
        else:
            a_row = pairs
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        k = tl.arange(0, BLOCK_K)
        a_ptr = A + a_row[:, None].to(tl.int64) * sa0 + k[None, :]
        w_ptr = W + expert.to(tl.int64) * sw0 + cols[None, :].to(tl.int64) * sw1 + k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            if EVEN_K:  # no mask along k: the loads stay full-width vectors
                k_ok = k < BLOCK_K
            else:
                k_ok = k + k0 < k_in
            a = tl.load(a_ptr, mask=live[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                w_up = tl.load(w_ptr + gate_off * sw1, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        else:
            acc = acc * tl.load(ROUTE_W + pairs, mask=live, other=0.0)[:, None]
        tl.store(OUT + pairs[:, None].to(tl.int64) * so0 + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


@triton_env.jit_per_step("tokens")
def _route_kernel(LOGITS, WEIGHTS, IDS, COUNTS, tokens, sl0, ROUTED: tl.constexpr, E_PAD: tl.constexpr,
                  TOP_K: tl.constexpr, SHARED: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BINS: tl.constexpr):
    """``routing.route`` for BLOCK_T tokens: weights float32 and expert ids int32, [tokens, TOP_K + SHARED];
    with BINS, also the expert histogram of its pairs into COUNTS (the alignment's first step)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    e = tl.arange(0, E_PAD)
    routed = (e < ROUTED)[None, :]
    logit = tl.load(LOGITS + t[:, None].to(tl.int64) * sl0 + e[None, :], mask=t_ok[:, None] & routed, other=0.0)
    logit = tl.where(routed, logit.to(tl.float32), float("-inf"))
    m = tl.max(logit, 1)
    denom = tl.sum(tl.exp(logit - m[:, None]), 1)
    k = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    work = logit
    for j in tl.static_range(TOP_K):  # the largest remaining logit is the largest remaining probability
        best = tl.max(work, 1)
        idx = tl.min(tl.where(work == best[:, None], e[None, :], E_PAD), 1)
        weights = tl.where(k == j, (tl.exp(best - m) / denom)[:, None], weights)
        ids = tl.where(k == j, idx[:, None], ids)
        work = tl.where(e[None, :] == idx[:, None], float("-inf"), work)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    for s in tl.static_range(SHARED):
        g = tl.load(LOGITS + t.to(tl.int64) * sl0 + ROUTED + s, mask=t_ok, other=0.0).to(tl.float32)
        weights = tl.where(k == TOP_K + s, (1.0 / (1.0 + tl.exp(-g)))[:, None], weights)
        ids = tl.where(k == TOP_K + s, ROUTED + s, ids)
    ok = t_ok[:, None] & (k < TOP_K + SHARED)
    out = t[:, None] * (TOP_K + SHARED) + k
    tl.store(WEIGHTS + out, weights, mask=ok)
    tl.store(IDS + out, ids, mask=ok)
    if BINS:  # lanes that are no pair count in the bin past the experts
        binned = tl.reshape(tl.where(ok, ids, ROUTED + SHARED), [BLOCK_T * K_PAD])
        tl.store(COUNTS + tl.program_id(0) * BINS + tl.arange(0, BINS), tl.histogram(binned, BINS))


ALIGN_SUB = 128  # pairs a program of the stand-alone alignment counts and scatters
# Up to this many histograms (256 tokens routed, a decode step's), each scatter program sums them itself instead
# of a scan launch before it: a [16, 512] load a program, against a launch a layer.
SCAN_IN_SCATTER = 16


@triton_env.jit_per_step("numel")
def _align_count_kernel(IDS, COUNTS, numel, E: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr):
    """The expert histogram of SUB pairs (lanes past the pairs count in bin E, no expert's)."""
    sub = tl.program_id(0)
    p = sub * SUB + tl.arange(0, SUB)
    ids = tl.load(IDS + p, mask=p < numel, other=E).to(tl.int32)
    tl.store(COUNTS + sub * E_PAD + tl.arange(0, E_PAD), tl.histogram(ids, E_PAD))


@triton_env.jit_per_step("subs")
def _align_scan_kernel(COUNTS, PAD, subs, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       TILE: tl.constexpr):
    """One program: each histogram row turned, in place, into the pairs of each expert before that row's pairs;
    then each expert's padded group: PAD's rows are where it starts, where it ends, and its pairs."""
    e = tl.arange(0, E_PAD)
    s = tl.arange(0, TILE)
    before = tl.zeros([E_PAD], tl.int32)
    for s0 in range(0, subs, TILE):
        ok = (s0 + s < subs)[:, None]
        at = COUNTS + (s0 + s)[:, None] * E_PAD + e[None, :]
        counts = tl.load(at, mask=ok, other=0)
        tl.store(at, tl.cumsum(counts, 0) - counts + before[None, :], mask=ok)
        before += tl.sum(counts, 0)
    padded = tl.where(e < E, (before + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pad_end = tl.cumsum(padded, 0)
    tl.store(PAD + e, pad_end - padded)
    tl.store(PAD + E_PAD + e, pad_end)
    tl.store(PAD + 2 * E_PAD + e, before)


@triton_env.jit_per_step("numel", "num_blocks", "blocks_per", "subs")
def _align_scatter_kernel(IDS, COUNTS, PAD, SORTED, BLOCK_EXPERT, numel, sub_pairs, num_blocks, blocks_per, subs,
                          E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, SUB_PAD: tl.constexpr,
                          CHUNK: tl.constexpr, TILE: tl.constexpr, SCAN: tl.constexpr):
    """Each of the program's `sub_pairs` pairs to its row: its expert's group start, the pairs of that expert in
    earlier programs, and those earlier in this program (pair order within an expert, as a stable sort), CHUNK
    pairs at a time against each earlier chunk (a [SUB_PAD, SUB_PAD] comparison at once spills registers at
    144 pairs). Then its share of the BLOCK_M-row blocks: each block's expert (-1 past the groups), and
    ``numel`` in its rows that no pair takes. With SCAN (a power of two, at least `subs`), each program first
    takes from the raw histograms what `_align_scan_kernel` would give, into PAD rows of its own: one launch
    less, for the few histograms of a decode step."""
    sub = tl.program_id(0)
    if SCAN:
        e = tl.arange(0, E_PAD)
        h = tl.arange(0, SCAN)  # the histograms' rows
        counts = tl.load(COUNTS + h[:, None] * E_PAD + e[None, :], mask=(h < subs)[:, None], other=0)
        total = tl.sum(counts, 0)
        padded = tl.where(e < E, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        pad_end = tl.cumsum(padded, 0)
        PAD += sub * 4 * E_PAD
        tl.store(PAD + e, pad_end - padded)
        tl.store(PAD + E_PAD + e, pad_end)
        tl.store(PAD + 2 * E_PAD + e, total)
        tl.store(PAD + 3 * E_PAD + e, tl.sum(tl.where((h < sub)[:, None], counts, 0), 0))
        BEFORE = PAD + 3 * E_PAD
        tl.debug_barrier()  # the rows just stored, read back by other threads of this program
    else:
        BEFORE = COUNTS + sub * E_PAD
    i = tl.arange(0, CHUNK)
    for c in tl.static_range(SUB_PAD // CHUNK):
        p = sub * sub_pairs + c * CHUNK + i
        ok = (c * CHUNK + i < sub_pairs) & (p < numel)
        ids = tl.load(IDS + p, mask=ok, other=0).to(tl.int32)
        earlier = tl.sum(((ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), 1)
        for j in tl.static_range(c):
            q = sub * sub_pairs + j * CHUNK + i
            prior = tl.load(IDS + q, mask=(j * CHUNK + i < sub_pairs) & (q < numel), other=-1).to(tl.int32)
            earlier += tl.sum((prior[None, :] == ids[:, None]).to(tl.int32), 1)
        row = tl.load(PAD + ids, mask=ok, other=0) + tl.load(BEFORE + ids, mask=ok, other=0)
        tl.store(SORTED + row + earlier, p, mask=ok)
    e = tl.arange(0, E_PAD)
    pad_end = tl.load(PAD + E_PAD + e)
    t = tl.arange(0, TILE)
    m = tl.arange(0, BLOCK_M)
    for b0 in range(sub * blocks_per, (sub + 1) * blocks_per, TILE):
        b = b0 + t  # the expert of block b: how many experts' padded groups end at or before its first row
        mine = (b < num_blocks) & (b < (sub + 1) * blocks_per)
        owner = tl.sum(((pad_end[None, :] <= (b * BLOCK_M)[:, None]) & (e < E)[None, :]).to(tl.int32), 1)
        tl.store(BLOCK_EXPERT + b, tl.where(owner < E, owner, -1), mask=mine)
        taken = tl.load(PAD + owner, mask=mine & (owner < E), other=0) + tl.load(PAD + 2 * E_PAD + owner,
                                                                                mask=mine & (owner < E), other=0)
        r = b[:, None] * BLOCK_M + m[None, :]  # rows from the group's start plus its pairs on are padding
        tl.store(SORTED + r, tl.zeros([TILE, BLOCK_M], tl.int32) + numel, mask=mine[:, None] & (r >= taken[:, None]))


CONFIG_DIR = Path(__file__).with_name("moe_configs")


def route_triton(router_logits, top_k: int, renormalize: bool, shared_experts: int = 0, counts=None):
    """(weights float32, expert ids int32), [tokens, top_k + shared_experts], in one launch; with ``counts``
    (int32 [ceil(tokens / ROUTE_TOKENS), :func:`alignment_bins`]), each program's expert histogram too. Rows of
    ``router_logits`` 16-byte aligned run it fastest: otherwise Triton loads them element by element and lays the
    tile out so that the top-k's reductions cross warps (engine.layers.moe pads its router for that)."""
    tokens, total = router_logits.shape
    routed, k = total - shared_experts, top_k + shared_experts
    weights = torch.empty(tokens, k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        _route_kernel[(triton.cdiv(tokens, ROUTE_TOKENS),)](
            router_logits, weights, ids, counts if counts is not None else ids, tokens, router_logits.stride(0),
            ROUTED=routed, E_PAD=triton_env.pow2(routed), TOP_K=top_k, SHARED=shared_experts,
            K_PAD=triton_env.pow2(k), RENORMALIZE=renormalize, BLOCK_T=ROUTE_TOKENS,
            BINS=counts.shape[1] if counts is not None else 0, num_warps=4)
    return weights, ids


ROUTE_TOKENS = 16  # tokens a routing program routes (and, in the MoE, whose pairs it counts)


def align_triton(ids, num_experts: int, block_m: int, used_blocks: int | None = None, counts=None):
    """``routing.align_block_size`` (same outputs, same upper-bound sizes) in three launches: expert histograms
    of ALIGN_SUB pairs each, one program's prefix sums over them (16 histograms a step: the one program that
    walked every pair took 0.71 ms at 16,384 pairs on the H200), then each program's pairs scattered and its
    share of the blocks labelled and padded; up to SCAN_IN_SCATTER histograms, the scatter programs take the
    prefix sums themselves (two launches). ``counts``: the histograms :func:`route_triton` took of ``ids``
    [tokens, k], ROUTE_TOKENS tokens a row (the first launch saved). ``used_blocks`` (a bound of the blocks in
    use, :func:`used_blocks`) leaves the rows past them unwritten: nothing reads them, and at decode sizes
    they are most of the buffer."""
    numel = ids.numel()
    cap = numel + num_experts * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    sorted_pairs = torch.empty(cap, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=ids.device)
    blocks = cap // block_m if used_blocks is None else min(used_blocks, cap // block_m)
    flat = ids.reshape(-1)
    if counts is None:
        bins = alignment_bins(num_experts)
        counts = torch.empty(max(1, triton.cdiv(numel, ALIGN_SUB)), bins, dtype=torch.int32, device=ids.device)
        sub_pairs = ALIGN_SUB
        _align_count_kernel[(counts.shape[0],)](flat, counts, numel, E=num_experts, E_PAD=bins, SUB=ALIGN_SUB,
                                                num_warps=4)
    else:
        sub_pairs = ROUTE_TOKENS * ids.shape[1]
    subs, bins = counts.shape
    scan = max(2, triton_env.pow2(subs)) if subs <= SCAN_IN_SCATTER else 0
    pad = torch.empty(subs if scan else 1, 4 if scan else 3, bins, dtype=torch.int32, device=ids.device)
    if not scan:
        _align_scan_kernel[(1,)](counts, pad, subs, E=num_experts, E_PAD=bins, BLOCK_M=block_m, TILE=16,
                                 num_warps=8)
    _align_scatter_kernel[(subs,)](flat, counts, pad, sorted_pairs, block_expert, numel, sub_pairs, blocks,
                                   triton.cdiv(blocks, subs), subs, E=num_experts, E_PAD=bins, BLOCK_M=block_m,
                                   SUB_PAD=triton_env.pow2(sub_pairs), CHUNK=min(64, triton_env.pow2(sub_pairs)),
                                   TILE=16, SCAN=scan, num_warps=4)
    return sorted_pairs, block_expert


def route_and_align(router_logits, top_k: int, renormalize: bool, shared_experts: int, block_m: int):
    """The MoE's first three launches: (routing weights, aligned pairs, block experts, blocks that can be in use,
    which bound the GEMMs' grids); the routing kernel counts the pairs the alignment starts from."""
    tokens, num_experts = router_logits.shape
    counts = torch.empty(triton.cdiv(tokens, ROUTE_TOKENS), alignment_bins(num_experts), dtype=torch.int32,
                         device=router_logits.device)
    weights, ids = route_triton(router_logits, top_k, renormalize, shared_experts, counts)
    bound = used_blocks(ids.numel(), num_experts, block_m)
    pairs, block_expert = align_triton(ids, num_experts, block_m, bound, counts)
    return weights, pairs, block_expert, min(block_expert.numel(), bound)


def alignment_bins(num_experts: int) -> int:
    """Histogram bins: the experts and one past them (lanes that are no pair), a power of two."""
    return triton_env.pow2(num_experts + 1)


def used_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the BLOCK_M-row blocks the aligned pairs fill: every expert's group comes
    first, one after the other, with at most one partial block each."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


# Launch configurations by rows per expert (token-expert pairs / experts): (rows up to, BLOCK_M,
# gate/up GEMM (BLOCK_N, BLOCK_K, num_warps, num_stages), down GEMM (same)). Below one row per expert
# (decode of a few tokens) the GEMMs stream weights: narrow N tiles give more programs to stream
# them with. Then 16-row blocks while experts see few rows, larger as they see more, as vLLM's
# tuned H200 tables for experts of this size do. The gate/up GEMM holds two accumulators (gate and
# up), so its BLOCK_N is half the weight columns of a vLLM tile of the same footprint.
TABLE = [
    (0.5, 16, (32, 128, 4, 4), (32, 128, 4, 4)),
    (16, 16, (64, 128, 8, 3), (128, 128, 8, 3)),
    (40, 32, (64, 64, 4, 3), (128, 64, 4, 3)),
    (96, 64, (64, 64, 4, 3), (128, 64, 4, 3)),
    (float("inf"), 128, (128, 64, 8, 3), (128, 64, 8, 3)),
]
GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def table_config(num_pairs: int, num_experts: int) -> dict:
    """The built-in configuration for ``num_pairs`` token-expert pairs over ``num_experts`` experts:
    ``{"BLOCK_M", "gate_up": {BLOCK_N, BLOCK_K, num_warps, num_stages}, "down": {...}}``."""
    per_expert = num_pairs / num_experts
    _, block_m, gate_up, down = next(row for row in TABLE if per_expert <= row[0])
    return dict(BLOCK_M=block_m, gate_up=dict(zip(GEMM_KEYS, gate_up)), down=dict(zip(GEMM_KEYS, down)))


def tuned_config(tokens: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device) -> dict | None:
    """A measured configuration for this expert shape on this device, when ``kernels/moe_configs``
    has one (vLLM's scheme: one file per shape and device, keyed by token count; the nearest count
    is used). ``python -m engine.gpu_report --sections moe-tune`` writes such files."""
    name = device_name(device)
    if name is None:
        return None
    table = _tuned_table(num_experts, hidden, inter, str(dtype).removeprefix("torch."), name)
    if not table:
        return None
    return table[min(table, key=lambda t: abs(t - tokens))]


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str | None:
    """The name tuned files carry (``NVIDIA_H200``), None off CUDA."""
    return torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else None


def config_file_name(num_experts: int, hidden: int, inter: int, dtype: str, device_name: str) -> str:
    return f"E={num_experts},H={hidden},N={inter},dtype={dtype},device={device_name}.json"


@functools.lru_cache(maxsize=None)
def _tuned_table(num_experts, hidden, inter, dtype, device_name) -> dict[int, dict]:
    path = CONFIG_DIR / config_file_name(num_experts, hidden, inter, dtype, device_name)
    if not path.is_file():
        return {}
    return {int(t): cfg for t, cfg in json.loads(path.read_text()).items()}


def gemm_shared(block_m: int, block_n: int, block_k: int, stages: int, elt: int, gated: bool) -> int:
    """Shared memory of one GEMM program: the A tile and one (gated: two) weight tiles per buffered
    stage, as Triton reports it: num_stages - 1 buffers, num_stages where 64-row tiles take Hopper's
    warp-group MMA (counted for any device: an estimate on the high side)."""
    buffers = stages if block_m >= 64 else max(1, stages - 1)
    return buffers * (block_m * block_k + (2 if gated else 1) * block_k * block_n) * elt


def fitting(gemm: dict, block_m: int, elt: int, gated: bool, limit: int) -> list[dict]:
    """``gemm`` first, then the same with fewer stages, shorter K tiles, narrower N tiles, each
    within ``limit`` bytes of shared memory: the configurations to try, best first."""
    out = []
    for n in sorted({gemm["BLOCK_N"]} | {b for b in (64, 32, 16) if b < gemm["BLOCK_N"]}, reverse=True):
        for k in sorted({gemm["BLOCK_K"]} | {b for b in (64, 32) if b < gemm["BLOCK_K"]}, reverse=True):
            for st in sorted({gemm["num_stages"]} | {b for b in (3, 2) if b < gemm["num_stages"]}, reverse=True):
                if gemm_shared(block_m, n, k, st, elt, gated) <= limit:
                    out.append(dict(gemm, BLOCK_N=n, BLOCK_K=k, num_stages=st))
    return out or [dict(gemm, BLOCK_N=16, BLOCK_K=32, num_stages=1)]


def launch_config(tokens, top_k, num_experts, hidden, inter, dtype, device, config=None) -> dict:
    """The configuration a call runs with: ``config`` (flat keys apply to both GEMMs; ``gate_up``
    and ``down`` hold either one's), over a tuned file's, over the built-in table's."""
    cfg = tuned_config(tokens, num_experts, hidden, inter, dtype, device) or table_config(tokens * top_k,
                                                                                           num_experts)
    cfg = dict(BLOCK_M=cfg["BLOCK_M"], gate_up=dict(cfg["gate_up"]), down=dict(cfg["down"]))
    if dtype not in (torch.float16, torch.bfloat16):
        # float32 dots are exact (ieee) and run on the FMA units: every output element of a tile is
        # a register of some thread, so tiles stay small enough not to spill
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], 32)
        for gemm in (cfg["gate_up"], cfg["down"]):
            gemm["BLOCK_N"], gemm["BLOCK_K"] = min(gemm["BLOCK_N"], 64), min(gemm["BLOCK_K"], 64)
    for key, value in (config or {}).items():
        if key == "BLOCK_M":
            cfg["BLOCK_M"] = value
        elif key in ("gate_up", "down"):
            cfg[key].update(value)
        elif key in GEMM_KEYS:
            cfg["gate_up"][key] = cfg["down"][key] = value
        else:
            raise ValueError(f"unknown MoE launch parameter {key!r}")
    return cfg


_LAUNCH = triton_env.FirstThatFits()


def moe_triton(hidden_states, router_logits, w13, w2, top_k, renormalize=True, shared_experts=0, config=None):
    """``config`` overrides the launch configuration (see :func:`launch_config`); tiles that would
    need more shared memory than the device has are narrowed (:func:`fitting`)."""
    tokens, hidden, num_experts, inter = check_moe(hidden_states, router_logits, w13, w2, top_k, shared_experts)
    if not tokens:
        return hidden_states.new_zeros(0, hidden)
    k = top_k + shared_experts
    num_pairs = tokens * k
    cfg = launch_config(tokens, k, num_experts, hidden, inter, hidden_states.dtype, hidden_states.device, config)
    block_m = cfg["BLOCK_M"]
    x = hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights, pairs, block_expert, blocks = route_and_align(router_logits, top_k, renormalize, shared_experts,
                                                           block_m)
    elt, limit = x.element_size(), triton_env.max_shared_mem(x.device)
    common = dict(BLOCK_M=block_m, TOP_K=k, PRECISION=triton_env.dot_precision(hidden_states.dtype))
    act = x.new_empty(num_pairs, inter)
    y = x.new_empty(num_pairs, hidden)

    def gate_up(g):
        _grouped_gemm[(blocks, triton.cdiv(inter, g["BLOCK_N"]))](
            x, w13, act, pairs, block_expert, weights, num_pairs, inter, hidden,
            x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), inter,
            GATED=True, A_IS_TOKENS=True, EVEN_K=hidden % g["BLOCK_K"] == 0, **g, **common)

    def down(g):
        _grouped_gemm[(blocks, triton.cdiv(hidden, g["BLOCK_N"]))](
            act, w2, y, pairs, block_expert, weights, num_pairs, hidden, inter,
            act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), 0,
            GATED=False, A_IS_TOKENS=False, EVEN_K=inter % g["BLOCK_K"] == 0, **g, **common)

    _LAUNCH.launch(fitting(cfg["gate_up"], block_m, elt, True, limit), gate_up, key=(x.device, "gate_up", elt))
    _LAUNCH.launch(fitting(cfg["down"], block_m, elt, False, limit), down, key=(x.device, "down", elt))
    return y.view(tokens, k, hidden).sum(dim=1)  # accumulates in float32, rounds once
