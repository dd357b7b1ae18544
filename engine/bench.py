"""Offline throughput of the engine under one or more serve configs, side by side in one run.

    python -m engine.bench --config engine/configs/baseline.yaml \\
        --config engine/configs/optimized.yaml [--set num-layers=8 ...]

Every config serves the same fixed, seeded workload: prompts built from a few shared prefixes (so
prefix caching has something to find) plus random suffixes, all submitted at once. Reported per
config: input (prompt) tok/s, output tok/s, cached (prefix-cache hit) tok/s and their weighted
``score`` (output x 16.796 + input x 2.799 + cached x 0.56, the seed deployment's scoring). The last
stdout line is one JSON object: the last config's figures at the top level (so the bench works as a
throughput probe) and every config's under ``results``.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from engine.config import ConfigError, EngineConfig, load_config
from engine.llm_engine import LLMEngine

WEIGHTS = {"output_tok_s": 16.796, "input_tok_s": 2.799, "cached_tok_s": 0.56}


@dataclass
class Workload:
    num_prompts: int = 128
    input_len: int = 512
    output_len: int = 128
    prefix_len: int = 256  # tokens each prompt shares with the others of its group
    num_prefixes: int = 4
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed)
        prefixes = [torch.randint(0, vocab_size, (self.prefix_len,), generator=g).tolist()
                    for _ in range(self.num_prefixes)]
        suffix = self.input_len - self.prefix_len
        return [prefixes[i % self.num_prefixes] + torch.randint(0, vocab_size, (suffix,), generator=g).tolist()
                for i in range(self.num_prompts)]


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, dict[str, int]]:
    before = dict(engine.stats)
    for p in prompts:
        engine.add_request(p, max_tokens)
    _sync(engine)
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    _sync(engine)
    elapsed = time.perf_counter() - start
    return elapsed, generated, {k: v - before[k] for k, v in engine.stats.items()}


def _sync(engine: LLMEngine) -> None:
    if engine.model_runner.device.type == "cuda":
        torch.cuda.synchronize(engine.model_runner.device)


def bench_config(config: EngineConfig, workload: Workload) -> dict[str, Any]:
    start = time.perf_counter()
    engine = LLMEngine(config)
    startup = time.perf_counter() - start
    prompts = workload.prompts(engine.config.vocab_size)
    # warm-up on other tokens, so that nothing of the measured workload is cached beforehand
    warm = Workload(num_prompts=2, input_len=workload.input_len, output_len=2, prefix_len=0, seed=workload.seed + 1)
    _run(engine, warm.prompts(engine.config.vocab_size), 2)
    elapsed, generated, stats = _run(engine, prompts, workload.output_len)
    result = {
        "config": config.source,
        "elapsed_s": round(elapsed, 3),
        "startup_s": round(startup, 1),
        "input_tok_s": stats["prompt_tokens"] / elapsed,
        "output_tok_s": generated / elapsed,
        "cached_tok_s": stats["prefix_cache_hits"] / elapsed,
        "preemptions": stats["preemptions"],
        "kernel_choice": engine.kernel_choice,
        "kv_cache_tokens": engine.model_runner.num_blocks * engine.config.block_size,
        "decode_graph_replays": engine.model_runner.decode_graphs.replays if engine.model_runner.decode_graphs else 0,
        "device": str(engine.model_runner.device),
        "dtype": str(engine.model_runner.dtype).removeprefix("torch."),
    }
    result["score"] = sum(result[k] * w for k, w in WEIGHTS.items())
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _parse_set(items: list[str]) -> dict[str, Any]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --set expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)  # so numbers, booleans and lists keep their types
    return overrides


def _table(results: list[dict[str, Any]]) -> str:
    rows = [("config", "input tok/s", "output tok/s", "cached tok/s", "score", "elapsed s", "preempt")]
    rows += [(Path(r["config"]).name, f"{r['input_tok_s']:.1f}", f"{r['output_tok_s']:.1f}",
              f"{r['cached_tok_s']:.1f}", f"{r['score']:.0f}", f"{r['elapsed_s']:.1f}", str(r["preemptions"]))
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="serve config YAML (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a serve-config key in every config (repeatable)")
    parser.add_argument("--device", help="shorthand for --set device=...")
    parser.add_argument("--dtype", help="shorthand for --set dtype=...")
    defaults = Workload()
    for field, value in asdict(defaults).items():
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=value)
    args = parser.parse_args(argv)
    workload = Workload(**{f: getattr(args, f) for f in asdict(defaults)})
    if not 0 <= workload.prefix_len <= workload.input_len or min(workload.input_len, workload.num_prompts,
                                                                  workload.output_len, workload.num_prefixes) < 1:
        parser.error("need 0 <= --prefix-len <= --input-len and --input-len, --num-prompts, --output-len, "
                     "--num-prefixes >= 1")
    overrides = _parse_set(args.set)
    for key in ("device", "dtype"):
        if getattr(args, key):
            overrides[key] = getattr(args, key)
    try:
        configs = [load_config(path, overrides) for path in args.config]  # all checked before any runs
        for config in configs:
            if workload.input_len + workload.output_len > config.max_model_len:
                raise config.error("max-model-len", f"{config.max_model_len} is shorter than the workload's "
                                                    f"{workload.input_len} + {workload.output_len} tokens")
        results = []
        for config in configs:
            results.append(bench_config(config, workload))
            print(_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_table(results))
    print(json.dumps({**{k: results[-1][k] for k in ("input_tok_s", "output_tok_s", "cached_tok_s", "score")},
                      "workload": asdict(workload), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
