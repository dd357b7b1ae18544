"""What the engine would run for a serve config on this machine: its effective configuration.

Two serve configs that differ only in keys the engine ignores here (``gpu-memory-utilization`` on a
CPU, or on a GPU whose cache holds every sequence the scheduler may run either way; a Triton variant
that falls back to the same torch kernel, a long-decode kernel that no sequence can reach below
``max-model-len`` or in the served workload) run the same computation, so measuring one against
the other measures noise. The orchestrator's configuration probe compares this output for the
candidate and the last kept state and rolls back, unmeasured, a change that makes no difference
(docs/probes.md). Kernel variants are chosen exactly as at start-up (the self-checks of
``engine.kernel_choice``), on small inputs and without weights.

    python -m engine.effective --config serve.yaml [--max-context TOKENS]
    {"configuration": {...}, "ignored": {"gpu-memory-utilization": "..."}}
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from typing import Any

from engine.config import ConfigError, EngineConfig, load_config

SCHEDULING = ("max-num-seqs", "max-num-batched-tokens", "block-size", "max-model-len", "seed")
SERVING = ("stream-interval",)  # what engine.server does around the engine
# Of the card, kept from the cache's share beyond the weights, the state slots and the largest prefill's attention
# scores, when telling whether the cache holds every sequence: the activation peak, CUDA graphs, the CUDA context.
CACHE_RESERVE = 0.10


def cache_holds_all(config: EngineConfig, element_size: int, card_bytes: int, longest: int) -> bool:
    """Whether a GPU cache sized by ``gpu-memory-utilization`` holds ``max-num-seqs`` sequences of ``longest`` tokens
    by a pessimistic count of what else the share holds (the weights, the state slots, the largest prefill's
    attention scores as one float32 matrix, and ``CACHE_RESERVE`` of the card). Then no sequence ever waits for
    blocks or is preempted, and a larger share runs exactly the same steps."""
    hf = config.hf
    block = hf.kv_bytes_per_token(element_size) * config.block_size
    if block == 0:
        return True
    prefill = min(config.max_num_batched_tokens, config.max_model_len)
    states = (config.max_num_seqs + 1) * hf.state_bytes_per_sequence(element_size, config.state_dtype().itemsize)
    rest = hf.num_params() * element_size + states + prefill * prefill * hf.num_heads * 4 + CACHE_RESERVE * card_bytes
    need = config.max_num_seqs * -(-longest // config.block_size)
    return (card_bytes * config.gpu_memory_utilization - rest) // block >= need


def effective(config: EngineConfig, max_context: int | None = None) -> dict[str, Any]:
    """``configuration``: every setting that changes what runs here, kernel keys resolved to the variant
    used; ``ignored``: each serve-config key left out of it, with why. ``max_context``: the longest sequence
    (prompt and output) the served workload holds, where that is known; else ``max-model-len``."""
    import kernels
    from engine.kernel_choice import keys_for, select_kernels
    from engine.model_runner import fixed_cache_budget

    device, dtype = config.torch_device(), config.torch_dtype()
    raw = config.as_dict()
    out: dict[str, Any] = {"model": asdict(config.hf), "device": device.type,
                           "dtype": str(dtype).removeprefix("torch."), "prefix-caching": config.prefix_caching}
    out.update({k: raw[k.replace("-", "_")] for k in SCHEDULING + SERVING})
    ignored: dict[str, str] = {}
    if config.enable_prefix_caching and not config.prefix_caching:
        ignored["enable-prefix-caching"] = "a hybrid model caches no prefix"

    longest = min(config.max_model_len, max_context or config.max_model_len)
    if (budget := fixed_cache_budget(config, device.type)) is None:
        import torch

        card = torch.cuda.get_device_properties(device).total_memory
        if cache_holds_all(config, dtype.itemsize, card, longest):
            out["kv-cache"] = "holds every sequence"
            ignored["gpu-memory-utilization"] = (
                f"at {config.gpu_memory_utilization} of {card / 2**30:.0f} GiB the cache holds max-num-seqs "
                f"({config.max_num_seqs}) sequences of {longest} tokens: no sequence waits for blocks")
        else:
            out["gpu-memory-utilization"] = config.gpu_memory_utilization
    else:
        out["kv-cache-memory"] = budget
        ignored["gpu-memory-utilization"] = ("the cache is sized by kv-cache-memory" if device.type == "cuda"
                                             else f"the cache is sized by kv-cache-memory on {device.type}")
    if config.hf.is_hybrid:
        out["mamba-ssm-cache-dtype"] = str(config.state_dtype()).removeprefix("torch.")
    elif config.mamba_ssm_cache_dtype != "auto":
        ignored["mamba-ssm-cache-dtype"] = "the model has no Gated DeltaNet layer: no recurrent state"
    if device.type == "cuda":
        out["cuda-graphs"] = config.cuda_graphs
    else:
        ignored["cuda-graphs"] = f"CUDA graphs do not run on {device.type}"
    if config.graphs_on_gpu():
        out["async-scheduling"] = config.async_scheduling
    elif config.async_scheduling:
        ignored["async-scheduling"] = "it overlaps the steps replayed from CUDA graphs, and none are here"

    choice = select_kernels(config, device, dtype).choice
    for key in keys_for(config.hf):
        chain = config.chain(key)
        out[key] = choice[key]
        if chain != [choice[key]]:
            ignored[key] = f"{' -> '.join(chain)} runs {choice[key]} here"
    if config.decode_long_threshold >= longest:
        del out["attention-decode-long"]
        reach = (f"max-model-len {config.max_model_len}" if longest == config.max_model_len
                 else f"the workload's longest sequence, {longest} tokens")
        ignored["attention-decode-long"] = ignored["decode-long-threshold"] = (
            f"decode-long-threshold {config.decode_long_threshold} >= {reach}: no decode is long")
    else:
        out["decode-long-threshold"] = config.decode_long_threshold
    out["prefill-block-m"] = config.prefill_block_m
    if kernels.uses_triton("prefix_prefill", choice["attention-prefill"]):
        out["prefill-block-n"], out["prefill-num-warps"] = config.prefill_block_n, config.prefill_num_warps
    else:
        ignored["prefill-block-n"] = ignored["prefill-num-warps"] = f"{choice['attention-prefill']} prefill uses neither"
    return {"configuration": out, "ignored": ignored}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.effective", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="serve config YAML")
    p.add_argument("--max-context", type=int, metavar="TOKENS",
                   help="the longest sequence (prompt and output) the served workload holds: a decode kernel no "
                        "sequence of it reaches is ignored")
    args = p.parse_args(argv)
    if args.max_context is not None and args.max_context < 1:
        p.error("--max-context must be at least 1")
    logging.basicConfig(level=logging.ERROR)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(json.dumps({"error": str(exc)}))
        return 2
    print(json.dumps(effective(config, args.max_context), sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
