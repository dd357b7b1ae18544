"""The serving probe's client: streaming requests timed as `vllm bench serve` times them, the two loads a probe
drives (one batch, or a steady state kept full), and what a server says of itself (its counters, its model, its
pause).

A steady state is filled once per load (`keep_filled`, `wait_for_fill`) and measured over windows of it
(`watch_window`): one window per fill for a sample of its own (`drive_steady`), or one per turn of a server
paused between them (serving.py's ``--turns``)."""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import aiohttp
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.fingerprint import gpu_now
from orchestrator.probes.workload import Workload

class ProbeError(Exception):
    """A failure reported as the probe's JSON ``error``."""


@dataclass
class Outcome:
    """One request as the client saw it."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    max_tokens: int = 0  # asked for: with ignore_eos, what a request still streaming will have streamed
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    first_at: float | None = None  # perf_counter() of the first token
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each streamed chunk


def session(connections: int, timeout: float) -> aiohttp.ClientSession:
    """The HTTP client of a load: ``connections`` kept open, and ``timeout`` seconds for a connection or between two
    reads of a stream (not for a whole request: one of 2,000 tokens streams for minutes). aiohttp, as `vllm bench
    serve`: a streamed token costs it a third of the CPU httpx's client took (benchmarks/client_cost.py), so that
    one client thread keeps 200 streams of a fast server fed."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout))


async def send(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
               max_tokens: int, out: Outcome | None = None) -> Outcome:
    """One streaming completion, timed the way `vllm bench serve` times it; into `out` as it streams, so that a
    request cancelled midway keeps what it received."""
    out = out if out is not None else Outcome()
    out.prompt_len, out.max_tokens = len(prompt), max_tokens
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = last = time.perf_counter()
    chunks, done = 0, False
    try:
        async with client.post(url, json=payload) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"
                return out
            async for raw in resp.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if not isinstance(msg, dict):
                    out.error = f"stream event is not a JSON object: {data[:100].decode(errors='replace')}"
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
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: bad JSON, a line too long
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
    async with session(limit, request_timeout) as client:
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


FILL_NOTICE = 5.0  # seconds of fill after which the probe says on stderr how far it got

# A queue of prompts that has not drained over this many seconds, and this many of the server's steps, marks a
# server that admits a prompt only as another request ends: a steady state already (wait_for_fill).
FILL_HOLD = 1.0

FILL_HOLD_STEPS = 4


def keep_filled(client: aiohttp.ClientSession, url: str, model: str, workload: Workload, stream,
                outcomes: list[Outcome], running: Callable[[], bool]) -> tuple[list[Outcome], list[asyncio.Task]]:
    """The steady state's load: ``max_concurrency`` request loops, the first wave's output lengths from
    ``Workload.fill``, each request replaced by the stream's next one as it ends while ``running()``. Returns the
    first wave and the loops; every request sent goes into ``outcomes``."""
    wave = [Outcome() for _ in range(workload.concurrency)]

    async def keep_busy(out: Outcome, fill_len: int) -> None:
        outcomes.append(out)
        await send(client, url, model, next(stream)[0], fill_len, out=out)
        while running() and not asyncio.current_task().cancelling():  # a cancel the HTTP client swallowed
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


@dataclass
class Load:
    """A steady state's load as it runs: every request sent (into `outcomes`, as sent), the first wave of them,
    and when it began (perf_counter)."""
    client: aiohttp.ClientSession
    outcomes: list[Outcome]
    wave: list[Outcome]
    begin: float


@asynccontextmanager
async def steady_load(base_url: str, model: str, workload: Workload, request_timeout: float,
                      running: Callable[[], bool] = lambda: True, start_at: float | None = None,
                      spare: int = 1) -> AsyncIterator[Load]:
    """``max_concurrency`` requests of the workload's stream kept in flight (``keep_filled``) while ``running()``,
    from the wall-clock instant ``start_at`` if given, once the server has answered a one-token test request;
    those still running at the exit are cancelled (the server aborts them). The client keeps ``spare``
    connections beside them for the probe's own calls."""
    url = f"{base_url}/v1/completions"
    stream = workload.stream()
    async with session(workload.concurrency + spare, request_timeout) as client:
        prompt, _ = next(stream)
        first = await send(client, url, model, prompt, 1)  # the server answers: one token says so
        if not first.success:
            raise ProbeError(f"the initial test request failed: {first.error}")
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        outcomes: list[Outcome] = []
        begin = time.perf_counter()
        wave, tasks = keep_filled(client, url, model, workload, stream, outcomes, running)
        try:
            yield Load(client, outcomes, wave, begin)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Watched:
    """What the server and the machine said of a window: the differences of the server's counters
    (``server_tokens``; empty where it gave none), the CPU seconds of the server's clock, the GPUs' clocks at
    its end (``gpu_now``), the whole machine's CPU load over it (``host_load``)."""
    counters: dict[str, float]
    cpu: float | None
    gpus: list | None
    host: dict[str, float] = field(default_factory=dict)


def host_load(before, after, seconds: float) -> dict[str, float]:
    """The machine's CPU over a window, from two readings of ``psutil.cpu_times()``: ``host_busy_cores``, the
    cores busy on average (the server's, the probes' and anything else's), and ``host_steal``, the share of the
    machine's CPU time a hypervisor gave to other guests. A window that ran slow for no reason of its own shows
    one of them high."""
    if before is None or after is None or seconds <= 0:
        return {}
    delta = {name: getattr(after, name) - getattr(before, name) for name in after._fields}
    total = sum(delta[name] for name in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
                if name in delta)
    if total <= 0:
        return {}
    idle = delta["idle"] + delta.get("iowait", 0.0)
    steal = delta.get("steal", 0.0)
    return {"host_busy_cores": (total - idle - steal) / seconds, "host_steal": steal / total}


def cpu_times():
    try:
        return psutil.cpu_times()
    except (psutil.Error, OSError):
        return None


async def watch_window(base_url: str, end: float, cpu_clock: Callable[[], float | None] = lambda: None) -> Watched:
    """Waits until ``end`` (perf_counter), reading the server's counters and ``cpu_clock`` now and then."""
    cpu_start = cpu_clock()
    host_start, began = cpu_times(), time.perf_counter()
    before = await server_tokens(base_url)
    before = await at_step_end(base_url, before, end)
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    cpu_end = cpu_clock()
    host = host_load(host_start, cpu_times(), time.perf_counter() - began)
    after = await server_tokens(base_url) if before is not None else None
    gpus = await asyncio.to_thread(gpu_now)
    counters = ({k: after[k] - before[k] for k in after if k in before}
                if before is not None and after is not None else {})
    cpu = cpu_end - cpu_start if cpu_start is not None and cpu_end is not None else None
    return Watched(counters, cpu, gpus, host)


async def at_step_end(base_url: str, reading: dict[str, float] | None, end: float) -> dict[str, float] | None:
    """The server's counters as the first step after `reading` ended (before ``end``, perf_counter), where it tells
    when its steps end: a window that starts there and ends at the last step end before its close counts whole
    steps over exactly the time they took (``step_ended``'s difference), whatever the steps' length. A server
    just resumed from a pause would otherwise date its first step from the end of the last one before it."""
    if reading is None or "step_ended" not in reading:
        return reading
    while time.perf_counter() + STEP_POLL < end:
        await asyncio.sleep(STEP_POLL)
        now = await server_tokens(base_url)
        if now is None or now.get("step_ended") != reading["step_ended"]:
            return now
    return reading


@dataclass
class SteadyWindow:
    """One window of a steady state filled for it (``drive_steady``)."""
    outcomes: list[Outcome]
    begin: float  # when the fill began (perf_counter), and the window's bounds
    start: float
    end: float
    filled: int  # of the first wave's max_concurrency prompts, when the ramp began
    fill_ended: str  # how (``wait_for_fill``)
    watched: Watched


async def drive_steady(base_url: str, model: str, workload: Workload, request_timeout: float,
                       cpu_clock: Callable[[], float | None] = lambda: None,
                       start_at: float | None = None) -> SteadyWindow:
    """Keeps ``max_concurrency`` requests of the workload's stream in flight (``steady_load``): first the fill
    (``Workload.fill``), then ``ramp`` seconds, then the measured ``duration``, after which those still running
    are cancelled."""
    window_end = math.inf
    async with steady_load(base_url, model, workload, request_timeout, lambda: time.perf_counter() < window_end,
                           start_at) as load:
        fill_ended = await wait_for_fill(load.wave, load.outcomes, workload.fill_limit)
        filled = sum(map(prefilled, load.wave))
        window_start = time.perf_counter() + workload.ramp
        window_end = window_start + workload.duration
        await asyncio.sleep(workload.ramp)
        watched = await watch_window(base_url, window_end, cpu_clock)
    return SteadyWindow(load.outcomes, load.begin, window_start, window_end, filled, fill_ended, watched)


SERVER_TOKENS = {"prefill": "engine:prefill_tokens", "generation": "vllm:generation_tokens"}

# the engine server's steps and the wall time inside them, where it counts them: a window's steps, their mean
# length and the share of the window they took tell a slower engine step from time lost around the engine;
# and when the last of them ended (a gauge), so that a window can count whole steps over the time they took
SERVER_STEPS = {"steps": "engine:steps", "step_seconds": "engine:step_seconds",
                "step_ended": "engine:last_step_end_time_seconds"}
STEP_POLL = 0.05  # seconds between two readings while a window waits for its first step end

# what vLLM says of a window besides its tokens: its own inter-token latency, its engine iterations (the count and
# sum of its iteration-tokens histogram), preemptions and queueing. A window slower than its neighbours is then the
# server's (its inter-token latency and iterations slower too) or the client's (the server's as usual)
SERVER_VLLM = {"itl_sum": "vllm:inter_token_latency_seconds#sum",
               "itl_count": "vllm:inter_token_latency_seconds#count",
               "iterations": "vllm:iteration_tokens_total#count", "iteration_tokens": "vllm:iteration_tokens_total#sum",
               "preemptions": "vllm:num_preemptions",
               "queue_sum": "vllm:request_queue_time_seconds#sum",
               "queue_count": "vllm:request_queue_time_seconds#count"}


async def counters(base_url: str, names: dict[str, str], optional: tuple[str, ...] = ()) -> dict[str, float] | None:
    """The server's counters and gauges `names` ({key: family name}; a counter summed over its labels' ``_total``
    samples, a gauge over its labels' values, ``family#sum`` and ``family#count`` a histogram's) from /metrics;
    None when it answers none, or lacks one of them that is not `optional`."""
    try:
        async with session(1, 10.0) as client, client.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for key, spec in names.items():
            name, _, part = spec.partition("#")
            if family.name != name:
                continue
            if part:
                found[key] = sum(s.value for s in family.samples if s.name == f"{name}_{part}")
            else:
                found[key] = sum(s.value for s in family.samples
                                 if s.name.endswith("_total") or family.type == "gauge")
    return found if all(key in found for key in names if key not in optional) else None


async def server_tokens(base_url: str) -> dict[str, float] | None:
    """The server's own counts of prompt tokens computed (chunk by chunk) and tokens generated, of its steps, and
    vLLM's figures of its iterations and latency (``SERVER_VLLM``), each where it has them; None where it answers
    no /metrics. Its token counts replace the client's only where it has both (vLLM counts a prompt only at its
    first output, so it has no count of prompt tokens computed)."""
    names = {**SERVER_TOKENS, **SERVER_STEPS, **SERVER_VLLM}
    return await counters(base_url, names, optional=tuple(names))


async def prefix_cache_hits(base_url: str) -> float | None:
    """The server's ``vllm:prefix_cache_hits_total`` (summed over labels), or None if absent."""
    found = await counters(base_url, {"hits": "vllm:prefix_cache_hits"})
    return None if found is None else found["hits"]


async def served_model(base_url: str) -> str:
    async with session(1, 10.0) as client, client.get(f"{base_url}/v1/models") as resp:
        body = await resp.json(content_type=None) if resp.status == 200 else {}
    if not isinstance(body, dict) or not body.get("data"):
        raise ProbeError(f"{base_url}/v1/models answered {resp.status} without a model")
    return body["data"][0]["id"]


async def set_paused(client: aiohttp.ClientSession, base_url: str, paused: bool) -> None:
    """Pause the server keeping its requests where they are (the engine server's and vLLM's `POST /pause?mode=keep`),
    or resume it; ProbeError when it does not answer 200."""
    path = "/pause?mode=keep" if paused else "/resume"
    async with client.post(base_url + path) as answer:
        if answer.status != 200:
            raise ProbeError(f"POST {path} answered HTTP {answer.status}: {(await answer.text())[:300]}")
