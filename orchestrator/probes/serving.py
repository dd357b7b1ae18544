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
import shlex
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from orchestrator.fingerprint import gpu_now
from orchestrator.probes.live_server import (LiveServer, ServerFailed, Terminated, engine_server_argv,
                                             group_cpu_seconds, on_sigterm, server_label, wait_healthy)
from orchestrator.probes.workload import Workload

DEFAULT_WEIGHTS = (16.796, 2.799, 0.56)  # output, uncached input, cached input tokens/s
WINDOW_STRIDE = 7919  # seed offset of each further measured window
WARMUP_OFFSET = 1_000_003  # seed offset of the warm-up batch
FILL_NOTICE = 5.0  # seconds of fill after which the probe says on stderr how far it got
# A queue of prompts that has not drained over this many seconds, and this many of the server's steps, marks a
# server that admits a prompt only as another request ends: a steady state already (wait_for_fill).
FILL_HOLD = 1.0
FILL_HOLD_STEPS = 4
# Seed offset of each pair (--pair, $ORCHESTRATOR_PAIR): larger than every offset within one probe, so no
# two pairs share a prompt. Both samples of a pair send the same prompts; a server reused for the next
# pair's sample (the staging loop's A B, B A order) finds none of them in its prefix cache.
PAIR_STRIDE = 10_000_019
PAIR_ENV = "ORCHESTRATOR_PAIR"
# The instant (seconds since the epoch) at which a sample's measured window begins: the staging loop gives both
# samples of a simultaneous pair the same one (orchestrator.pairing).
START_AT_ENV = "ORCHESTRATOR_START_AT"
# --turns: seconds between resuming a filled server and a turn's window (the step under way at the pause ends)
TURN_RAMP = 0.5
# Set for the first sample on a fresh live server: a warm-up batch first (per-shape compilation, first-use
# allocations), whatever --warmup says.
WARMUP_ENV = "ORCHESTRATOR_WARMUP"


class ProbeError(Exception):
    """A failure reported as the probe's JSON ``error``."""


# ---------------------------------------------------------------- the workload


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
    first_at: float | None = None  # perf_counter() of the first token
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each streamed chunk


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
               max_tokens: int, out: Outcome | None = None) -> Outcome:
    """One streaming completion, timed the way `vllm bench serve` times it; into `out` as it streams, so that a
    request cancelled midway keeps what it received."""
    out = out if out is not None else Outcome()
    out.prompt_len = len(prompt)
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
                        out.ttft, out.first_at = now - start, now
                    else:
                        out.itl.append(now - last)
                    out.token_times.append(now)
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


async def drive_steady(base_url: str, model: str, workload: Workload, request_timeout: float,
                       cpu_clock: Callable[[], float | None] = lambda: None, start_at: float | None = None,
                       counters: dict | None = None
                       ) -> tuple[list[Outcome], float, float, float, float | None, int, str, list | None]:
    """Keeps ``max_concurrency`` requests of the workload's stream in flight, from the wall-clock instant
    ``start_at`` if given (after one test request): first the fill (``Workload.fill``), then ``ramp`` seconds,
    then the measured ``duration``, after which those still running are cancelled (the server aborts them).
    Returns every request sent, when the fill began and the window's bounds (perf_counter), the CPU seconds
    ``cpu_clock`` advanced over the window, how many of the first wave were prefilled when the fill ended, how it
    ended (``wait_for_fill``), and the GPUs' clocks at the window's end (``gpu_now``)."""
    url = f"{base_url}/v1/completions"
    stream = workload.stream()
    limit = workload.concurrency
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits) as client:
        prompt, _ = next(stream)
        first = await send(client, url, model, prompt, 1)  # the server answers: one token says so
        if not first.success:
            raise ProbeError(f"the initial test request failed: {first.error}")
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        begin = time.perf_counter()
        window_end = math.inf
        outcomes: list[Outcome] = []
        wave, tasks = keep_filled(client, url, model, workload, stream, outcomes,
                                  lambda: time.perf_counter() < window_end)
        try:
            fill_ended = await wait_for_fill(wave, outcomes, workload.fill_limit)
            filled = sum(map(prefilled, wave))
            window_start = time.perf_counter() + workload.ramp
            window_end = window_start + workload.duration
            await asyncio.sleep(workload.ramp)
            cpu_start = cpu_clock()
            before = await server_tokens(base_url) if counters is not None else None
            await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
            cpu_end = cpu_clock()
            after = await server_tokens(base_url) if before is not None else None
            gpus = await asyncio.to_thread(gpu_now)
            if before is not None and after is not None:
                counters.update({k: after[k] - before[k] for k in after if k in before})
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        cpu = cpu_end - cpu_start if cpu_start is not None and cpu_end is not None else None
        return outcomes, begin, window_start, window_end, cpu, filled, fill_ended, gpus


def keep_filled(client: httpx.AsyncClient, url: str, model: str, workload: Workload, stream, outcomes: list[Outcome],
                running: Callable[[], bool]) -> tuple[list[Outcome], list[asyncio.Task]]:
    """The steady state's load: ``max_concurrency`` request loops, the first wave's output lengths from
    ``Workload.fill``, each request replaced by the stream's next one as it ends while ``running()``. Returns the
    first wave and the loops; every request sent goes into ``outcomes``."""
    wave = [Outcome() for _ in range(workload.concurrency)]

    async def keep_busy(out: Outcome, fill_len: int) -> None:
        outcomes.append(out)
        await send(client, url, model, next(stream)[0], fill_len, out=out)
        while running():
            out = Outcome()
            outcomes.append(out)
            await send(client, url, model, *next(stream), out=out)

    return wave, [asyncio.create_task(keep_busy(out, n)) for out, n in zip(wave, workload.fill())]


def prefilled(o: Outcome) -> bool:
    """Past its prefill: it streamed a token, finished or failed."""
    return o.first_at is not None or bool(o.latency) or bool(o.error)


def step_seconds(outcomes: list[Outcome]) -> float | None:
    """The server's step as the client sees it: the median gap between the latest streamed tokens."""
    gaps = [g for o in outcomes[-256:] for g in o.itl[-4:]]
    return float(np.median(gaps)) if gaps else None


async def wait_for_fill(wave: list[Outcome], outcomes: list[Outcome], limit: float) -> str:
    """Waits until the first wave is past its prefill (``prefilled``) and says how the fill ended.

    A window that began earlier would find the rest of the wave's prompts queued, and measure their prefill burst
    instead of the steady state's mix (on an H200 a fill cut at 5 s left 30-80 of 128 prompts to the window, and
    its score rose by what it lacked in decoding). A server that runs fewer sequences than the wave holds admits
    a prompt only as another request ends: the prompts waiting for a first token then stop draining, and the fill
    ends once they have not drained over ``FILL_HOLD`` seconds and ``FILL_HOLD_STEPS`` steps (``saturated``; the
    fill's interleaved lengths have spread the ones it runs). ``limit`` seconds bound it (``limit``)."""
    begin = said = time.perf_counter()
    seen: deque[tuple[float, int]] = deque()  # (when, prompts waiting for their first token)
    first = {id(o) for o in wave}  # the wave's requests count from the start, sent or about to be
    while not all(prefilled(o) for o in wave):
        now = time.perf_counter()
        if now - begin >= limit:
            print(f"fill: stopped at its limit of {limit:.0f} s with {sum(map(prefilled, wave))} of {len(wave)} "
                  "prompts prefilled: the window begins with a queue", file=sys.stderr, flush=True)
            return "limit"
        waiting = (sum(not prefilled(o) for o in wave)
                   + sum(not prefilled(o) for o in outcomes if id(o) not in first))
        seen.append((now, waiting))
        step = step_seconds(outcomes)
        if step is not None:
            hold = max(FILL_HOLD, FILL_HOLD_STEPS * step)
            while len(seen) > 1 and seen[1][0] <= now - hold:
                seen.popleft()
            if seen[0][0] <= now - hold and waiting >= seen[0][1]:
                return "saturated"
        if now - said > FILL_NOTICE:  # a slow fill says how far it got
            said = now
            print(f"fill: {sum(map(prefilled, wave))} of {len(wave)} prompts prefilled after {now - begin:.0f} s",
                  file=sys.stderr, flush=True)
        await asyncio.sleep(0.02)
    return "prefilled"


def summarize_window(outcomes: list[Outcome], start: float, end: float) -> tuple[dict, float, str]:
    """`vllm bench serve`'s metrics over a steady-state window: the tokens streamed inside it (a chunk counts
    as the request's tokens per chunk), the prompts whose first token came inside it, and the latencies of the
    requests that finished inside it."""
    def inside(t: float | None) -> bool:
        return t is not None and start <= t < end

    duration = end - start
    done = [o for o in outcomes if o.success and o.token_times and inside(o.token_times[-1])]
    failed = [o for o in outcomes if not o.success and o.error and o.error != "cancelled" and
              (not o.token_times or inside(o.token_times[-1]))]
    total_out = 0.0
    for o in outcomes:
        per_chunk = (o.output_tokens / len(o.token_times)) if o.success and o.output_tokens and o.token_times else 1.0
        total_out += per_chunk * sum(1 for t in o.token_times if inside(t))
    prefilled = [o for o in outcomes if inside(o.first_at)]
    total_in = sum(o.prompt_len for o in prefilled)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    result = {
        "duration": duration, "completed": len(done), "failed": len(failed),
        "total_input_tokens": total_in, "total_output_tokens": round(total_out),
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration, "steady_state": True,
        "requests_sent": len(outcomes),
    }
    result.update(_stats("ttft", [o.ttft for o in done]))
    result.update(_stats("tpot", tpots))
    result.update(_stats("itl", [x for o in done for x in o.itl]))
    result.update(_stats("e2el", [o.latency for o in done]))
    result["errors"] = sorted({o.error for o in failed})[:10]
    cached = [o.cached_tokens for o in prefilled if o.cached_tokens is not None]
    return result, (sum(cached) if cached else 0), ("usage" if cached else "none")


SERVER_TOKENS = {"prefill": "engine:prefill_tokens", "generation": "vllm:generation_tokens"}
# the engine server's steps and the wall time inside them, where it counts them: a window's steps, their mean
# length and the share of the window they took tell a slower engine step from time lost around the engine
SERVER_STEPS = {"steps": "engine:steps", "step_seconds": "engine:step_seconds"}


async def counters(base_url: str, names: dict[str, str], optional: tuple[str, ...] = ()) -> dict[str, float] | None:
    """The server's counters `names` ({key: family name}, each summed over its labels' ``_total`` samples) from
    /metrics; None when it answers none, or lacks one of them that is not `optional`."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for key, name in names.items():
            if family.name == name:
                found[key] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return found if all(key in found for key in names if key not in optional) else None


async def server_tokens(base_url: str) -> dict[str, float] | None:
    """The server's own counts of prompt tokens computed (chunk by chunk) and tokens generated, and of its steps
    where it has them; None where it lacks either count of tokens (vLLM counts a prompt only at its first output)."""
    return await counters(base_url, {**SERVER_TOKENS, **SERVER_STEPS}, optional=tuple(SERVER_STEPS))


async def prefix_cache_hits(base_url: str) -> float | None:
    """The server's ``vllm:prefix_cache_hits_total`` (summed over labels), or None if absent."""
    found = await counters(base_url, {"hits": "vllm:prefix_cache_hits"})
    return None if found is None else found["hits"]


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
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="steady state: keep --max-concurrency requests in flight and measure a window of this "
                        "many seconds (after --ramp), instead of one batch of --num-prompts")
    p.add_argument("--ramp", type=float, default=w.ramp, metavar="SECONDS",
                   help="steady state: seconds between the fill (the first wave's output lengths spread over "
                        "1..--output-len, each prompt prefilled) and the measured window")
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
                        f"workload (compiles per-shape kernels outside the window; also when ${WARMUP_ENV} is 1)")
    p.add_argument("--turns", action="store_true",
                   help="with --base-url and --duration: fill the server once, then measure one window per "
                        "`window` line on stdin, the server paused (POST /pause?mode=keep) between windows; one "
                        "JSON line per window; `stop` or the end of stdin resumes it and ends")
    p.add_argument("--max-failed-fraction", type=float, default=0.0,
                   help="the probe fails when more than this fraction of requests fail")
    p.add_argument("--output-weight", type=float, default=DEFAULT_WEIGHTS[0])
    p.add_argument("--input-weight", type=float, default=DEFAULT_WEIGHTS[1])
    p.add_argument("--cached-weight", type=float, default=DEFAULT_WEIGHTS[2])
    args = p.parse_args(argv)
    if not 1 <= args.windows <= 100:  # their seeds stay clear of the warm-up's and of the next pair's
        p.error("--windows must be between 1 and 100")
    try:
        args.workload = Workload(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                                 range_ratio=args.range_ratio, shared_prefix_fraction=args.shared_prefix_fraction,
                                 token_low=args.token_id_range[0], token_high=args.token_id_range[1],
                                 request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                                 windows=args.windows, duration=args.duration, ramp=args.ramp, warmup=args.warmup)
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(str(x) for x in e['loc']).replace('_', '-') or 'workload'}: {e['msg']}"
                             for e in exc.errors())
        p.error(problems)
    if args.turns and not (args.base_url and args.duration):
        p.error("--turns needs --base-url (a running server) and --duration (a steady state)")
    if os.environ.get(WARMUP_ENV, "").strip() == "1":
        args.warmup = True
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
    return engine_server_argv(config)


async def warm_up(base_url: str, model: str, workload: Workload, request_timeout: float) -> float:
    """One concurrent batch as wide as the workload's, of its own prompt and output lengths but other
    prompts (their prefixes do not prime the measured ones): the lengths decide which kernels run (a
    chunked prefill's remainder, the long-decode path past its threshold) and Triton compiles each at
    first use, which must happen here, not in the window. With 1,024-token warm-up prompts, samples
    of one config on an H200 (8 x 8,400-token prompts) spread from 23k to 37k. Returns its wall time."""
    if workload.steady:  # a few seconds of the stream itself: a whole batch could take minutes at one sequence
        warm = workload.model_copy(update=dict(duration=max(3.0, workload.ramp), ramp=0.0,
                                               seed=workload.seed + WARMUP_OFFSET))
        began = time.perf_counter()
        outcomes, *_ = await drive_steady(base_url, model, warm, request_timeout)
        if not any(o.token_times for o in outcomes):
            raise ProbeError(f"the warm-up streamed no token: {sorted({o.error for o in outcomes if o.error})[:3]}")
        return time.perf_counter() - began
    batch = min(workload.num_prompts, workload.concurrency)
    warm = workload.model_copy(update=dict(num_prompts=batch, request_rate=math.inf,
                                           seed=workload.seed + WARMUP_OFFSET))
    outcomes, duration, _ = await drive(base_url, model, warm, request_timeout)
    if not any(o.success for o in outcomes):
        raise ProbeError(f"every warm-up request failed: {sorted({o.error for o in outcomes})[:3]}")
    return duration


async def measure_window(base_url: str, model: str, workload: Workload, args: argparse.Namespace,
                         server: LiveServer | None, start_at: float | None = None) -> dict:
    """One measured pass of ``workload`` (from ``start_at``, when given): `vllm bench serve`'s fields, the
    score, CPU figures."""
    clock = server or (RunningServer(args.server_pid) if args.server_pid else None)
    cpu_clock = clock.cpu_seconds if clock is not None else lambda: None
    lag = None
    client_cpu = time.process_time()
    if workload.steady:
        counters: dict[str, float] = {}
        outcomes, begin, start, end, cpu, filled, fill_ended, gpus = await drive_steady(
            base_url, model, workload, args.request_timeout, cpu_clock, start_at, counters)
        if start_at is not None:  # the fill's length is the state's own: it is part of the lag
            lag = time.time() - (end - start) - workload.ramp - start_at
        result, cached, source = window_result(outcomes, start, end, counters, gpus)
        result["ramp"] = workload.ramp
        result["fill_seconds"] = start - workload.ramp - begin
        result["fill_prefilled"] = filled  # of the first wave's max_concurrency prompts, when the ramp began
        result["fill_ended"] = fill_ended
    else:
        hits_before = await prefix_cache_hits(base_url)
        outcomes, duration, cpu = await drive(base_url, model, workload, args.request_timeout, cpu_clock, start_at)
        lag = time.time() - duration - start_at if start_at is not None else None
        ok = [o for o in outcomes if o.success]
        if ok and all(o.cached_tokens is not None for o in ok):
            cached, source = sum(o.cached_tokens for o in ok), "usage"
        elif hits_before is not None and (hits_after := await prefix_cache_hits(base_url)) is not None:
            cached, source = hits_after - hits_before, "metrics"
        else:
            cached, source = 0, "none"
        result = summarize(outcomes, duration)
    return described(result, cached, source, cpu, base_url, model, workload, args, client_cpu, lag)


def window_result(outcomes: list[Outcome], start: float, end: float, counters: dict[str, float],
                  gpus: list | None) -> tuple[dict, float, str]:
    """A steady-state window's fields: the client's counts, replaced by the server's own where it gave them
    (`counters`: prompt tokens as their chunks ran, not at their first output; its steps), and the GPUs' clocks."""
    result, cached, source = summarize_window(outcomes, start, end)
    if gpus is not None:  # clocks, temperature, power: a drift within a run is told from the machine's
        result["gpus"] = gpus
    result["tokens_source"] = "client"
    if counters:
        duration = result["duration"]
        result.update(client_input_tokens=result["total_input_tokens"],
                      client_output_tokens=result["total_output_tokens"],
                      # the server counts the prompt tokens it computed: cached ones are added back for the score
                      total_input_tokens=round(counters["prefill"] + cached),
                      total_output_tokens=round(counters["generation"]),
                      output_throughput=counters["generation"] / duration,
                      total_token_throughput=(counters["prefill"] + cached + counters["generation"]) / duration,
                      tokens_source="server")
        if counters.get("steps"):
            result.update(server_steps=round(counters["steps"]),
                          server_step_ms=1e3 * counters["step_seconds"] / counters["steps"],
                          server_step_busy=counters["step_seconds"] / duration)
    return result, cached, source


def described(result: dict, cached: float, source: str, cpu: float | None, base_url: str, model: str,
              workload: Workload, args: argparse.Namespace, client_cpu: float, lag: float | None) -> dict:
    """A pass's result with the workload it ran, the score and the CPU figures."""
    result.update({"backend": "openai", "model_id": model, "base_url": base_url,
                   "num_prompts": workload.num_prompts,
                   "request_rate": workload.request_rate if math.isfinite(workload.request_rate) else "inf",
                   "max_concurrency": workload.max_concurrency, "input_len": workload.input_len,
                   "output_len": workload.output_len,
                   "shared_prefix_fraction": workload.shared_prefix_fraction,
                   "seed": workload.seed, "cached_tokens_source": source})
    # the client's own CPU time over the pass: near the window's length, the client itself was the bottleneck
    result["client_cpu_seconds"] = time.process_time() - client_cpu
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
    workload = args.workload.model_copy(update={"seed": seed})
    warmup = await warm_up(base_url, model, workload, args.request_timeout) if args.warmup else None
    windows = []
    for i in range(args.windows):
        windows.append(await measure_window(base_url, model,
                                            workload.model_copy(update={"seed": seed + WINDOW_STRIDE * i}),
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


async def set_paused(client: httpx.AsyncClient, base_url: str, paused: bool) -> None:
    """Pause the server keeping its requests where they are (the engine server's and vLLM's `POST /pause?mode=keep`),
    or resume it; ProbeError when it does not answer 200."""
    path = "/pause?mode=keep" if paused else "/resume"
    answer = await client.post(base_url + path)
    if answer.status_code != 200:
        raise ProbeError(f"POST {path} answered HTTP {answer.status_code}: {answer.text[:300]}")


async def take_turns(base_url: str, args: argparse.Namespace, lines: Callable[[], Awaitable[str]],
                     emit: Callable[[dict], None]) -> int:
    """``--turns``: the steady state filled once, then one window per ``window`` line that `lines` gives, the
    server paused between them. A window that began from an idle server would pay for the fill each time (on an
    H200 at 128 sequences 6-14 s of a 25-40 s sample); paused with its requests kept, the server takes up its
    steady state where it left it. The first line emitted says how the fill went, then one per window (a
    sample's fields, `turn` its index); ``stop`` or the end of `lines` resumes the server and ends. Returns the
    windows taken."""
    model = args.model or await served_model(base_url)
    workload = args.workload.model_copy(update={"seed": args.seed + PAIR_STRIDE * args.pair})
    clock = RunningServer(args.server_pid) if args.server_pid else None
    cpu_clock = clock.cpu_seconds if clock is not None else lambda: None
    warmup = await warm_up(base_url, model, workload, args.request_timeout) if args.warmup else None
    url = f"{base_url}/v1/completions"
    stream = workload.stream()
    limit = workload.concurrency
    limits = httpx.Limits(max_connections=limit + 2, max_keepalive_connections=limit + 2)
    turns, paused = 0, False
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        prompt, _ = next(stream)
        first = await send(client, url, model, prompt, 1)
        if not first.success:
            raise ProbeError(f"the initial test request failed: {first.error}")
        begin = time.perf_counter()
        outcomes: list[Outcome] = []
        wave, tasks = keep_filled(client, url, model, workload, stream, outcomes, lambda: True)
        try:
            fill_ended = await wait_for_fill(wave, outcomes, workload.fill_limit)
            fill = {"fill_seconds": time.perf_counter() - begin, "fill_prefilled": sum(map(prefilled, wave)),
                    "fill_ended": fill_ended, **({"warmup_seconds": warmup} if warmup is not None else {})}
            await set_paused(client, base_url, True)
            paused = True
            emit({"filled": True, **fill})
            while (line := (await lines()).strip()) != "stop" and line:
                if line != "window":
                    raise ProbeError(f"stdin: {line[:40]!r} is not a command (window, stop)")
                await set_paused(client, base_url, False)
                paused = False
                await asyncio.sleep(TURN_RAMP)
                client_cpu, cpu_start = time.process_time(), cpu_clock()
                before = await server_tokens(base_url)
                start = time.perf_counter()
                end = start + workload.duration
                await asyncio.sleep(max(0.0, end - time.perf_counter()))
                cpu_end = cpu_clock()
                after = await server_tokens(base_url)
                gpus = await asyncio.to_thread(gpu_now)
                await set_paused(client, base_url, True)
                paused = True
                counters = ({k: after[k] - before[k] for k in after if k in before}
                            if before is not None and after is not None else {})
                cpu = cpu_end - cpu_start if cpu_start is not None and cpu_end is not None else None
                result, cached, source = window_result(outcomes, start, end, counters, gpus)
                result.update(ramp=TURN_RAMP, turn=turns, **(fill if turns == 0 else {}))
                result = described(result, cached, source, cpu, base_url, model, workload, args, client_cpu, None)
                result["pair"] = args.pair
                if reason := failure(result, args.max_failed_fraction):
                    result["error"] = reason
                emit(result)
                turns += 1
                outcomes[:] = [o for o in outcomes if not o.token_times or o.token_times[-1] >= start]
        finally:
            if paused:
                try:
                    await set_paused(client, base_url, False)  # a paused server would wait out its shutdown
                except (httpx.HTTPError, ProbeError):
                    pass
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return turns


def turns_main(args: argparse.Namespace) -> int:
    """``--turns`` from the command line: commands on stdin, one JSON line per answer on stdout, the last one
    ``{"turns": n}`` (or ``{"error": ...}`` and exit 1)."""
    def emit(result: dict) -> None:
        print(json.dumps(result), flush=True)

    async def lines() -> str:
        return await asyncio.to_thread(sys.stdin.readline)

    base_url = args.base_url.rstrip("/")
    try:
        wait_healthy(base_url, args.health_timeout)
        emit({"turns": asyncio.run(take_turns(base_url, args, lines, emit))})
    except (ProbeError, ServerFailed, httpx.HTTPError) as exc:
        emit({"error": f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)})
        return 1
    return 0


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
    if result.get("steady_state") and result["total_output_tokens"] == 0:
        return "no token was streamed in the measured window"
    if result["completed"] == 0 and not result.get("steady_state"):
        return "no request completed"
    if result["failed"] > max_failed_fraction * total:
        return (f"{result['failed']} of {total} requests failed, more than the allowed "
                f"fraction {max_failed_fraction:g}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.turns:
        return turns_main(args)
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
