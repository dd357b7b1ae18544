"""Serving benchmark probe: starts an OpenAI-compatible server, drives a seeded streaming workload
against it and prints `vllm bench serve`'s result fields plus the deployment's weighted score.

    python -m orchestrator.probes.serving [--server-cmd CMD | --base-url URL | --import-result FILE]

Without ``--server-cmd`` or ``--base-url`` it serves ``$ORCHESTRATOR_TARGET_ROOT/serve.yaml`` with
``python -m engine.server``. The server runs in its own process group (``live_server.LiveServer``)
and that group is always stopped, on success, on error and on SIGTERM. The last stdout line is one
JSON object (probe protocol); a failure exits 1 with a JSON object holding ``error``, and a server
that never became healthy adds ``"reason": "timeout"`` (one that exited first: ``"crashed"``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.probes.live_server import (LiveServer, ServerFailed, Terminated, group_cpu_seconds, on_sigterm,
                                             server_label, wait_healthy)

DEFAULT_WEIGHTS = (16.796, 2.799, 0.56)  # output, uncached input, cached input tokens/s
WINDOW_STRIDE = 7919  # seed offset of each further measured window
WARMUP_OFFSET = 1_000_003  # seed offset of the warm-up batch
# Seed offset of each pair (--pair, $ORCHESTRATOR_PAIR): larger than every offset within one probe, so no
# two pairs share a prompt. Both samples of a pair send the same prompts; a server reused for the next
# pair's sample (the staging loop's A B, B A order) finds none of them in its prefix cache.
PAIR_STRIDE = 10_000_019
PAIR_ENV = "ORCHESTRATOR_PAIR"
# The instant (seconds since the epoch) at which a sample's measured window begins: the staging loop gives both
# samples of a simultaneous pair the same one (orchestrator.measure).
START_AT_ENV = "ORCHESTRATOR_START_AT"


class ProbeError(Exception):
    """A failure reported as the probe's JSON ``error``."""


# ---------------------------------------------------------------- the workload


@dataclass
class Workload:
    """A seeded synthetic load, the same on every server so that runs compare."""

    num_prompts: int = 32
    input_len: int = 64
    output_len: int = 16
    range_ratio: float = 0.0
    shared_prefix_fraction: float = 0.5
    token_low: int = 0
    token_high: int = 256
    request_rate: float = math.inf
    max_concurrency: int | None = 8
    seed: int = 0

    def requests(self) -> list[tuple[list[int], int]]:
        """Seeded (prompt token ids, output length) pairs; every prompt starts with one shared
        prefix of ``shared_prefix_fraction × input_len`` tokens, so prefix caching matters."""
        rng = np.random.default_rng(self.seed)
        prefix_len = round(self.shared_prefix_fraction * self.input_len)
        prefix = rng.integers(self.token_low, self.token_high, prefix_len).tolist()

        def length(mean: int) -> int:
            low, high = math.floor(mean * (1 - self.range_ratio)), math.ceil(mean * (1 + self.range_ratio))
            return max(1, int(rng.integers(low, high + 1)))

        out = []
        for _ in range(self.num_prompts):
            total = max(length(self.input_len), prefix_len + 1)
            own = rng.integers(self.token_low, self.token_high, total - prefix_len).tolist()
            out.append((prefix + own, length(self.output_len)))
        return out

    def delays(self) -> list[float]:
        """Send times relative to the start: Poisson arrivals at ``request_rate``, as vLLM's."""
        if math.isinf(self.request_rate):
            return [0.0] * self.num_prompts
        rng = random.Random(self.seed)
        gaps = [rng.expovariate(self.request_rate) for _ in range(self.num_prompts)]
        return np.cumsum([0.0] + gaps[:-1]).tolist()


@dataclass
class Outcome:
    """One request as the client saw it."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
               max_tokens: int) -> Outcome:
    """One streaming completion, timed the way `vllm bench serve` times it."""
    out = Outcome(prompt_len=len(prompt))
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = last = time.perf_counter()
    chunks, done = 0, False
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if not isinstance(msg, dict):
                    out.error = f"stream event is not a JSON object: {data[:100]}"
                    return out
                if "error" in msg:
                    out.error = f"server error in stream: {msg['error']}"
                    return out
                now = time.perf_counter()
                if msg.get("choices"):
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last, chunks = now, chunks + 1
                if usage := msg.get("usage"):
                    out.output_tokens = usage.get("completion_tokens", 0)
                    out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
    except (httpx.HTTPError, httpx.StreamError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - start
    if not done:
        out.error = "stream ended without data: [DONE]"
    elif chunks == 0:
        out.error = "stream held no tokens"
    else:
        out.output_tokens = out.output_tokens or chunks
        out.success = True
    return out


async def drive(base_url: str, model: str, workload: Workload, request_timeout: float,
                cpu_clock: Callable[[], float | None] = lambda: None,
                start_at: float | None = None) -> tuple[list[Outcome], float, float | None]:
    """Sends the whole workload, from the wall-clock instant ``start_at`` if given (after one test
    request); returns each request's outcome, the wall time and the CPU seconds ``cpu_clock`` advanced
    over that same window (None when it cannot tell)."""
    url = f"{base_url}/v1/completions"
    requests, delays = workload.requests(), workload.delays()
    limit = workload.max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits) as client:
        first = await send(client, url, model, *requests[0])
        if not first.success:
            raise ProbeError(f"the initial test request failed: {first.error}")
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu_start = cpu_clock()
        start = time.perf_counter()

        async def one(delay: float, prompt: list[int], max_tokens: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            async with gate:
                return await send(client, url, model, prompt, max_tokens)

        outcomes = await asyncio.gather(*(one(d, *r) for d, r in zip(delays, requests)))
        duration, cpu_end = time.perf_counter() - start, cpu_clock()
        cpu = cpu_end - cpu_start if cpu_start is not None and cpu_end is not None else None
        return list(outcomes), duration, cpu


async def prefix_cache_hits(base_url: str) -> float | None:
    """The server's ``vllm:prefix_cache_hits_total`` (summed over labels), or None if absent."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    for family in text_string_to_metric_families(resp.text):
        if family.name == "vllm:prefix_cache_hits":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return None


async def served_model(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=10.0) as client:
        resp = await client.get(f"{base_url}/v1/models")
    if resp.status_code != 200 or not resp.json().get("data"):
        raise ProbeError(f"{base_url}/v1/models answered {resp.status_code} without a model")
    return resp.json()["data"][0]["id"]


# ---------------------------------------------------------------- results


def _stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def with_score(result: dict, cached_tokens: float, weights: tuple[float, float, float]) -> dict:
    """Adds uncached and cached prompt throughput and the weighted score."""
    duration = result["duration"]
    result["total_cached_tokens"] = cached_tokens
    result["input_throughput"] = (result["total_input_tokens"] - cached_tokens) / duration
    result["cached_throughput"] = cached_tokens / duration
    w_out, w_in, w_cached = weights
    result["score_weights"] = {"output": w_out, "input": w_in, "cached": w_cached}
    result["score"] = (w_out * result["output_throughput"] + w_in * result["input_throughput"]
                       + w_cached * result["cached_throughput"])
    return result


def with_cpu(result: dict, cpu_seconds: float | None) -> dict:
    """Adds the server's CPU seconds over the measured window and throughput per CPU second:
    ``cpu_score`` is the score's weighted tokens over CPU seconds instead of wall seconds."""
    if cpu_seconds is None or cpu_seconds <= 0:
        return result
    per_cpu = result["duration"] / cpu_seconds
    result["server_cpu_seconds"] = cpu_seconds
    result["cpu_utilization"] = cpu_seconds / result["duration"]
    result["output_tokens_per_cpu_second"] = result["output_throughput"] * per_cpu
    result["cpu_score"] = result["score"] * per_cpu
    return result


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    """`vllm bench serve`'s metrics over the completed requests."""
    ok = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    errors = sorted({o.error for o in outcomes if not o.success})
    result = {
        "duration": duration, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    result.update(_stats("ttft", [o.ttft for o in ok]))
    result.update(_stats("tpot", tpots))
    result.update(_stats("itl", [x for o in ok for x in o.itl]))
    result.update(_stats("e2el", [o.latency for o in ok]))
    result["errors"] = errors[:10]
    return result


REQUIRED_IMPORT_FIELDS = ("duration", "completed", "total_input_tokens", "total_output_tokens",
                          "output_throughput")


def import_result(path: Path, weights: tuple[float, float, float]) -> dict:
    """Scores a `vllm bench serve --save-result` JSON; it records no cached tokens, so all prompt
    tokens count as uncached input."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProbeError(f"{path}: cannot read a JSON result: {exc}") from None
    if not isinstance(data, dict):
        raise ProbeError(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key in REQUIRED_IMPORT_FIELDS:
        if not isinstance(data.get(key), (int, float)) or isinstance(data.get(key), bool):
            raise ProbeError(f"{path}: field {key!r} is missing or not a number")
    if data["duration"] <= 0:
        raise ProbeError(f"{path}: field 'duration' must be positive, got {data['duration']}")
    keep = [k for k in data if isinstance(data[k], (int, float, str)) or data[k] is None]
    result = {k: data[k] for k in keep}
    result["failed"] = int(data.get("failed", 0) or 0)
    result["imported_from"] = str(path)
    return with_score(result, 0, weights)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.probes.serving",
                                description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--server-cmd", help="server command line; the literal {port} and {host} are filled "
                     "in (e.g. 'vllm serve MODEL --port {port}')")
    src.add_argument("--base-url", help="an already running server, e.g. http://127.0.0.1:8000")
    src.add_argument("--import-result", type=Path, metavar="FILE",
                     help="score a `vllm bench serve --save-result` JSON instead of generating load")
    p.add_argument("--serve-config", help="engine serve config (default: "
                   "$ORCHESTRATOR_TARGET_ROOT/serve.yaml)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    p.add_argument("--health-timeout", "--startup-timeout", type=float, default=300.0,
                   help="seconds the server may take to answer /health with 200")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the server")
    p.add_argument("--server-pid", type=int, help="with --base-url: the server's pid (its process group), "
                   "whose CPU time gives cpu_score")
    p.add_argument("--server-log-dir", type=Path,
                   help="keep the server's log in this folder (default: a temporary file, removed)")
    w = Workload()
    p.add_argument("--num-prompts", type=int, default=w.num_prompts)
    p.add_argument("--input-len", type=int, default=w.input_len)
    p.add_argument("--output-len", type=int, default=w.output_len)
    p.add_argument("--range-ratio", type=float, default=w.range_ratio,
                   help="lengths are drawn uniformly from len × [1 - r, 1 + r]")
    p.add_argument("--shared-prefix-fraction", type=float, default=w.shared_prefix_fraction,
                   help="fraction of each prompt that is one prefix shared by all prompts")
    p.add_argument("--token-id-range", type=int, nargs=2, default=[w.token_low, w.token_high],
                   metavar=("LOW", "HIGH"), help="prompt token ids are drawn from [LOW, HIGH)")
    p.add_argument("--request-rate", type=float, default=w.request_rate,
                   help="requests per second, Poisson arrivals (default: all at once)")
    p.add_argument("--max-concurrency", type=int, default=w.max_concurrency)
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--pair", type=int, default=None,
                   help=f"the sample's pair index: the workload's seed is offset by {PAIR_STRIDE} per pair "
                        f"(default: ${PAIR_ENV}, else 0)")
    p.add_argument("--start-at", type=float, default=None, metavar="EPOCH",
                   help="begin the measured window at this wall-clock instant (seconds since the epoch), so that "
                        f"two probes measure at the same time (default: ${START_AT_ENV}, else at once)")
    p.add_argument("--windows", type=int, default=1,
                   help="measured passes on the one server, each from its own prompts; the best is reported")
    p.add_argument("--best-of", default="score", choices=["score", "cpu_score", "output_throughput"],
                   help="the figure that picks the best pass (default: score)")
    p.add_argument("--warmup", action="store_true",
                   help="before the measured window, one concurrent batch of other prompts shaped like the "
                        "workload (compiles per-shape kernels outside the window)")
    p.add_argument("--max-failed-fraction", type=float, default=0.0,
                   help="the probe fails when more than this fraction of requests fail")
    p.add_argument("--output-weight", type=float, default=DEFAULT_WEIGHTS[0])
    p.add_argument("--input-weight", type=float, default=DEFAULT_WEIGHTS[1])
    p.add_argument("--cached-weight", type=float, default=DEFAULT_WEIGHTS[2])
    args = p.parse_args(argv)
    if not 1 <= args.windows <= 100:  # their seeds stay clear of the warm-up's and of the next pair's
        p.error("--windows must be between 1 and 100")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be at least 1")
    if not 0.0 <= args.shared_prefix_fraction < 1.0:
        p.error("--shared-prefix-fraction must be in [0, 1)")
    if not 0.0 <= args.range_ratio < 1.0:
        p.error("--range-ratio must be in [0, 1)")
    if args.token_id_range[0] >= args.token_id_range[1] or args.token_id_range[0] < 0:
        p.error("--token-id-range needs 0 <= LOW < HIGH")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--request-rate and --max-concurrency must be positive")
    if args.start_at is None and (value := os.environ.get(START_AT_ENV, "").strip()):
        try:
            args.start_at = float(value)
        except ValueError:
            p.error(f"${START_AT_ENV} must be a number of seconds since the epoch, got {value!r}")
    if args.pair is None:
        value = os.environ.get(PAIR_ENV, "").strip() or "0"
        try:
            args.pair = int(value)
        except ValueError:
            p.error(f"${PAIR_ENV} must be a whole number, got {value!r}")
    if args.pair < 0:
        p.error("the pair index (--pair or $ORCHESTRATOR_PAIR) must not be negative")
    return args


def server_argv(args: argparse.Namespace) -> list[str]:
    """The server's argv, ``{host}`` and ``{port}`` left for LiveServer to fill in."""
    if args.server_cmd:
        if "{port}" not in args.server_cmd and not args.port:
            raise ProbeError("--server-cmd must contain {port}, or give --port")
        return shlex.split(args.server_cmd)
    config = args.serve_config
    if config is None:
        root = os.environ.get("ORCHESTRATOR_TARGET_ROOT")
        if not root:
            raise ProbeError("no server given: pass --server-cmd, --base-url or --serve-config, "
                             "or set ORCHESTRATOR_TARGET_ROOT")
        config = str(Path(root) / "serve.yaml")
    from orchestrator.targets.engine import server_argv as engine_server_argv

    return engine_server_argv(config, "{host}", "{port}")


async def warm_up(base_url: str, model: str, workload: Workload, request_timeout: float) -> float:
    """One concurrent batch as wide as the workload's, of its own prompt and output lengths but other
    prompts (their prefixes do not prime the measured ones): the lengths decide which kernels run (a
    chunked prefill's remainder, the long-decode path past its threshold) and Triton compiles each at
    first use, which must happen here, not in the window. With 1,024-token warm-up prompts, samples
    of one config on an H200 (8 x 8,400-token prompts) spread from 23k to 37k. Returns its wall time."""
    batch = min(workload.num_prompts, workload.max_concurrency or workload.num_prompts)
    warm = replace(workload, num_prompts=batch, request_rate=math.inf, seed=workload.seed + WARMUP_OFFSET)
    outcomes, duration, _ = await drive(base_url, model, warm, request_timeout)
    if not any(o.success for o in outcomes):
        raise ProbeError(f"every warm-up request failed: {sorted({o.error for o in outcomes})[:3]}")
    return duration


async def measure_window(base_url: str, model: str, workload: Workload, args: argparse.Namespace,
                         server: LiveServer | None, start_at: float | None = None) -> dict:
    """One measured pass of ``workload`` (from ``start_at``, when given): `vllm bench serve`'s fields, the
    score, CPU figures."""
    hits_before = await prefix_cache_hits(base_url)
    clock = server or (RunningServer(args.server_pid) if args.server_pid else None)
    outcomes, duration, cpu = await drive(base_url, model, workload, args.request_timeout,
                                          clock.cpu_seconds if clock is not None else lambda: None, start_at)
    lag = time.time() - duration - start_at if start_at is not None else None
    ok = [o for o in outcomes if o.success]
    if ok and all(o.cached_tokens is not None for o in ok):
        cached, source = sum(o.cached_tokens for o in ok), "usage"
    elif hits_before is not None and (hits_after := await prefix_cache_hits(base_url)) is not None:
        cached, source = hits_after - hits_before, "metrics"
    else:
        cached, source = 0, "none"
    result = summarize(outcomes, duration)
    result.update({"backend": "openai", "model_id": model, "base_url": base_url,
                   "num_prompts": workload.num_prompts,
                   "request_rate": workload.request_rate if math.isfinite(workload.request_rate) else "inf",
                   "max_concurrency": workload.max_concurrency, "input_len": workload.input_len,
                   "output_len": workload.output_len,
                   "shared_prefix_fraction": workload.shared_prefix_fraction,
                   "seed": workload.seed, "cached_tokens_source": source})
    if lag is not None:
        result["start_lag_seconds"] = lag  # how late after the agreed instant the window began
    return with_cpu(with_score(result, cached, (args.output_weight, args.input_weight, args.cached_weight)), cpu)


WINDOW_FIELDS = ("seed", "duration", "completed", "failed", "output_throughput", "score", "server_cpu_seconds",
                 "cpu_score")


class RunningServer:
    """A server this probe did not start (``--base-url``), known by its pid: its CPU clock only."""

    def __init__(self, pid: int):
        self.pid = pid

    def cpu_seconds(self) -> float | None:
        return group_cpu_seconds(self.pid)


async def benchmark(base_url: str, args: argparse.Namespace, server: LiveServer | None) -> dict:
    """``--windows`` passes of the workload on one healthy server, each from its own prompts (its own
    seed), reported as the best by ``--best-of``: interference from other processes on a shared
    machine only ever slows a pass down, so the fastest one is the least disturbed."""
    ready = server.age() if server is not None else None
    model = args.model or await served_model(base_url)
    seed = args.seed + PAIR_STRIDE * args.pair
    workload = Workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                        args.shared_prefix_fraction, *args.token_id_range, args.request_rate,
                        args.max_concurrency, seed)
    warmup = await warm_up(base_url, model, workload, args.request_timeout) if args.warmup else None
    windows = []
    for i in range(args.windows):
        windows.append(await measure_window(base_url, model, replace(workload, seed=seed + WINDOW_STRIDE * i),
                                            args, server, args.start_at if i == 0 else None))
        if failure(windows[-1], args.max_failed_fraction):
            break  # a failing server is reported as it is, not retried into a pass
    failed = next((w for w in windows if failure(w, args.max_failed_fraction)), None)
    result = failed or max(windows, key=lambda w: w.get(args.best_of, 0))
    result["pair"] = args.pair
    if args.windows > 1:
        result = {**result, "best_of": args.best_of,
                  "windows": [{k: w[k] for k in WINDOW_FIELDS if k in w} for w in windows]}
    if ready is not None:
        result["server_ready_seconds"] = ready
    if warmup is not None:
        result["warmup_seconds"] = warmup
    if server is not None and (code := server.exited()) is not None:
        result["server_exit_code"] = code
    return result


def run(args: argparse.Namespace) -> dict:
    weights = (args.output_weight, args.input_weight, args.cached_weight)
    if args.import_result:
        return import_result(args.import_result, weights)
    if args.base_url:
        base_url = args.base_url.rstrip("/")
        wait_healthy(base_url, args.health_timeout)
        return asyncio.run(benchmark(base_url, args, None))
    server = LiveServer(server_argv(args), host=args.host, port=args.port or None, stop_timeout=args.stop_timeout,
                        log_dir=args.server_log_dir, log_label=server_label("serving"))
    try:
        server.start()
        server.wait_healthy(args.health_timeout)
        result = asyncio.run(benchmark(server.url, args, server))
        if "server_exit_code" in result:
            result["server_output"] = server.tail()
    except ProbeError as exc:
        code = server.exited()
        if code is None:
            raise
        raise ProbeError(f"{exc}; the server exited with code {code}; its last output:\n"
                         f"{server.tail()}") from None
    finally:
        server.stop()
    result["server_stopped_by"] = server.stopped_by
    if server.log_dir is not None:
        result["server_log"] = str(server.log_path)
    return result


def failure(result: dict, max_failed_fraction: float) -> str | None:
    total = result["completed"] + result["failed"]
    if result["completed"] == 0:
        return "no request completed"
    if result["failed"] > max_failed_fraction * total:
        return (f"{result['failed']} of {total} requests failed, more than the allowed "
                f"fraction {max_failed_fraction:g}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = run(args)
    except ProbeError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    except ServerFailed as exc:  # "reason" lets the staging loop tell a start-up timeout from a crash
        print(f"serving probe: {exc.reason}: {str(exc).splitlines()[0]}", file=sys.stderr)
        print(json.dumps({"error": str(exc), "reason": exc.reason}))
        return 1
    except Terminated:
        print(json.dumps({"error": "terminated by SIGTERM; the server was stopped"}))
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    if reason := failure(result, args.max_failed_fraction):
        result["error"] = reason
        print(json.dumps(result))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
