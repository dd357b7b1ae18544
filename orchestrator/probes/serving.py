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
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp
from pydantic import ValidationError

from orchestrator.probes.client import (Outcome, ProbeError, drive, drive_steady, prefilled, prefix_cache_hits,
                                        served_model, set_paused, steady_load, wait_for_fill, watch_window)
from orchestrator.probes.live_server import (LiveServer, ServerFailed, Terminated, engine_server_argv,
                                             group_cpu_seconds, on_sigterm, server_label, wait_healthy)
from orchestrator.probes.results import (DEFAULT_WEIGHTS, import_result, summarize, window_result, with_cpu,
                                         with_score)
from orchestrator.probes.workload import Workload

WINDOW_STRIDE = 7919  # seed offset of each further measured window

WARMUP_OFFSET = 1_000_003  # seed offset of the warm-up batch
# A steady stream's warm-up (``settle``) reads its output rate over steps of WARM_SECONDS and ends at the first step
# whose rate rose less than WARM_RISE over the step before, once it has run a window's length (and two steps); after
# WARM_LIMIT seconds it ends whatever the rates. On one H100 at 128 sequences, the first 10-s window on a fresh
# vLLM server after a fixed 3-s warm-up measured 18.5% below the later ones (9 fresh servers against 11 later
# windows): the server kept getting faster well past its first seconds of load.
WARM_SECONDS = 3.0
WARM_RISE = 0.05
WARM_LIMIT = 60.0

# Seed offset of each pair (--pair, $ORCHESTRATOR_PAIR): larger than every offset within one probe, so no
# two pairs share a prompt. Both samples of a pair send the same prompts; a server reused for the next
# pair's sample (the staging loop's A B, B A order) finds none of them in its prefix cache.
PAIR_STRIDE = 10_000_019

# A throughput sample's pair index (the staging loop's `repeat`): the workload's seed is offset by it, so both
# samples of a pair send the same prompts and no two pairs do; a server that serves the last sample of one pair
# and the first of the next (A B, B A) never finds the earlier sample's prompts in its prefix cache.
PAIR_ENV = "ORCHESTRATOR_PAIR"

# The instant (seconds since the epoch) at which a sample's measured window begins: the staging loop gives both
# samples of a simultaneous pair the same one (orchestrator.pairing).
START_AT_ENV = "ORCHESTRATOR_START_AT"

# --turns: seconds between resuming a filled server and a turn's window (the step under way at the pause ends)
TURN_RAMP = 0.5

# Set for the first sample on a fresh live server: a warm-up first (per-shape compilation, first-use allocations:
# ``warm_up``), whatever --warmup says.
WARMUP_ENV = "ORCHESTRATOR_WARMUP"


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
    p.add_argument("--best-of", default="score", choices=["score", "cpu_score", "output_throughput", "score_streamed"],
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
    if args.best_of == "score_streamed" and not args.duration:
        p.error("--best-of score_streamed needs --duration (a steady state's window counts the streamed prompts)")
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


def output_rate(outcomes: list[Outcome], start: float, end: float) -> float:
    """Chunks streamed per second between ``start`` and ``end`` (perf_counter)."""
    return sum(start <= t < end for o in outcomes for t in o.token_times) / (end - start)


async def settle(outcomes: list[Outcome], least: float) -> dict:
    """Waits while a running stream (`outcomes`, as they are sent) warms the server: steps of WARM_SECONDS until
    ``least`` seconds have passed and the last step's output rate rose less than WARM_RISE over the one before,
    or WARM_LIMIT seconds. A server that is still compiling, allocating or filling a cache gets faster step by
    step; one that is warm measures the same twice. Returns the warm-up's seconds, each step's rate, and whether
    it settled (a warm-up cut at its limit says so: its windows may still be measuring a server that warms)."""
    began = mark = time.perf_counter()
    rates: list[float] = []
    while True:
        await asyncio.sleep(WARM_SECONDS)
        now = time.perf_counter()
        rates.append(output_rate(outcomes, mark, now))
        mark = now
        settled = len(rates) >= 2 and rates[-1] <= rates[-2] * (1 + WARM_RISE)
        if (settled and now - began >= least) or now - began >= WARM_LIMIT:
            return {"warmup_seconds": now - began, "warmup_rates": [round(r, 1) for r in rates],
                    "warmup_settled": settled}


async def warm_up(base_url: str, model: str, workload: Workload, request_timeout: float) -> dict:
    """Runs the workload's shape on other prompts (their prefixes do not prime the measured ones) before a window:
    the lengths decide which kernels run (a chunked prefill's remainder, the long-decode path past its threshold)
    and Triton compiles each at first use, which must happen here, not in the window. A steady workload runs its
    stream until the server settles (``settle``: at least a window's length); a batch workload runs one batch as
    wide as its own (with 1,024-token warm-up prompts, samples of one config on an H200, 8 x 8,400-token prompts,
    spread from 23k to 37k). Returns ``warmup_seconds`` (and a steady warm-up's rates)."""
    if workload.steady:
        warm = workload.model_copy(update=dict(seed=workload.seed + WARMUP_OFFSET))
        async with steady_load(base_url, model, warm, request_timeout) as load:
            await wait_for_fill(load.wave, load.outcomes, warm.fill_limit)
            found = await settle(load.outcomes, max(workload.duration, WARM_SECONDS))
        if not any(o.token_times for o in load.outcomes):
            raise ProbeError("the warm-up streamed no token: "
                             f"{sorted({o.error for o in load.outcomes if o.error})[:3]}")
        return found
    batch = min(workload.num_prompts, workload.concurrency)
    warm = workload.model_copy(update=dict(num_prompts=batch, request_rate=math.inf,
                                           seed=workload.seed + WARMUP_OFFSET))
    outcomes, duration, _ = await drive(base_url, model, warm, request_timeout)
    if not any(o.success for o in outcomes):
        raise ProbeError(f"every warm-up request failed: {sorted({o.error for o in outcomes})[:3]}")
    return {"warmup_seconds": duration}


async def measure_window(base_url: str, model: str, workload: Workload, args: argparse.Namespace,
                         server: LiveServer | None, start_at: float | None = None) -> dict:
    """One measured pass of ``workload`` (from ``start_at``, when given): `vllm bench serve`'s fields, the
    score, CPU figures."""
    cpu_clock = server_cpu_clock(args, server)
    lag = None
    client_clock = time.process_time(), time.perf_counter()
    if workload.steady:
        w = await drive_steady(base_url, model, workload, args.request_timeout, cpu_clock, start_at)
        if start_at is not None:  # the fill's length is the state's own: it is part of the lag
            lag = time.time() - (w.end - w.start) - workload.ramp - start_at
        result, cached, source = window_result(w.outcomes, w.start, w.end, w.watched.counters, w.watched.gpus,
                                               w.watched.host)
        result.update(ramp=workload.ramp, fill_seconds=w.start - workload.ramp - w.begin, fill_prefilled=w.filled,
                      fill_ended=w.fill_ended)
        cpu = w.watched.cpu
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
    return described(result, cached, source, cpu, base_url, model, workload, args, client_clock, lag)


def described(result: dict, cached: float, source: str, cpu: float | None, base_url: str, model: str,
              workload: Workload, args: argparse.Namespace, client_clock: tuple[float, float],
              lag: float | None) -> dict:
    """A pass's result with the workload it ran, the score and the CPU figures."""
    result.update({"backend": "openai", "model_id": model, "base_url": base_url,
                   "num_prompts": workload.num_prompts,
                   "request_rate": workload.request_rate if math.isfinite(workload.request_rate) else "inf",
                   "max_concurrency": workload.max_concurrency, "input_len": workload.input_len,
                   "output_len": workload.output_len,
                   "shared_prefix_fraction": workload.shared_prefix_fraction,
                   "seed": workload.seed, "cached_tokens_source": source})
    # the client's own CPU time over the pass (from ``client_clock``, its CPU and wall clocks at the pass's start),
    # and the share of one core that is: near 1, the client itself, one asyncio thread, bounded the pass
    cpu_start, wall_start = client_clock
    result["client_cpu_seconds"] = time.process_time() - cpu_start
    result["client_busy"] = result["client_cpu_seconds"] / max(time.perf_counter() - wall_start, 1e-9)
    if lag is not None:
        result["start_lag_seconds"] = lag  # how late after the agreed instant the window began
    if args.server_pid:
        result["server_cpus"] = server_cpus(args.server_pid)  # where the staging loop pinned it
    return with_cpu(with_score(result, cached, (args.output_weight, args.input_weight, args.cached_weight)), cpu)


WINDOW_FIELDS = ("seed", "duration", "completed", "failed", "output_throughput", "score", "server_cpu_seconds",
                 "cpu_score")


class RunningServer:
    """A server this probe did not start (``--base-url``), known by its pid: its CPU clock only."""

    def __init__(self, pid: int):
        self.pid = pid

    def cpu_seconds(self) -> float | None:
        return group_cpu_seconds(self.pid)


def server_cpu_clock(args: argparse.Namespace, server: LiveServer | None = None) -> Callable[[], float | None]:
    """The CPU clock of the server measured: the one this probe started, else the one ``--server-pid`` names."""
    clock = server or (RunningServer(args.server_pid) if args.server_pid else None)
    return clock.cpu_seconds if clock is not None else lambda: None


def server_cpus(pid: int | None) -> list[int] | None:
    """The CPUs the measured server runs on (the staging loop may pin it, and move it before its windows)."""
    try:
        return sorted(os.sched_getaffinity(pid)) if pid else None
    except (OSError, AttributeError):
        return None


async def pair_workload(base_url: str, args: argparse.Namespace) -> tuple[str, Workload]:
    """The model served, and the workload with this pair's seed (each pair draws its own prompts)."""
    model = args.model or await served_model(base_url)
    return model, args.workload.model_copy(update={"seed": args.seed + PAIR_STRIDE * args.pair})


async def benchmark(base_url: str, args: argparse.Namespace, server: LiveServer | None) -> dict:
    """``--windows`` passes of the workload on one healthy server, each from its own prompts (its own
    seed), reported as the best by ``--best-of``: interference from other processes on a shared
    machine only ever slows a pass down, so the fastest one is the least disturbed."""
    ready = server.age() if server is not None else None
    model, workload = await pair_workload(base_url, args)
    seed = workload.seed
    warmup = await warm_up(base_url, model, workload, args.request_timeout) if args.warmup else {}
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
    result.update(warmup)
    if server is not None and (code := server.exited()) is not None:
        result["server_exit_code"] = code
    return result


async def take_turns(base_url: str, args: argparse.Namespace, lines: Callable[[], Awaitable[str]],
                     emit: Callable[[dict], None]) -> int:
    """``--turns``: the steady state filled once, then one window per ``window`` line that `lines` gives, the
    server paused between them. A window that began from an idle server would pay for the fill each time (on an
    H200 at 128 sequences 6-14 s of a 25-40 s sample); paused with its requests kept, the server takes up its
    steady state where it left it. The first line emitted says how the fill went, then one per window (a
    sample's fields, `turn` its index); ``stop`` or the end of `lines` resumes the server and ends. The warm-up
    (``--warmup``) is a few seconds of the stream itself past its fill, not a fill of its own: the fill's prefills
    and those seconds' steps compile what the windows run. Returns the windows taken."""
    model, workload = await pair_workload(base_url, args)
    cpu_clock = server_cpu_clock(args)
    turns, paused = 0, False
    async with steady_load(base_url, model, workload, args.request_timeout, spare=2) as load:
        try:
            fill_ended = await wait_for_fill(load.wave, load.outcomes, workload.fill_limit)
            fill = {"fill_seconds": time.perf_counter() - load.begin, "fill_prefilled": sum(map(prefilled, load.wave)),
                    "fill_ended": fill_ended, "fill_server_cpus": server_cpus(args.server_pid)}
            if args.warmup:
                fill.update(await settle(load.outcomes, max(workload.duration, WARM_SECONDS)))
            await set_paused(load.client, base_url, True)
            paused = True
            emit({"filled": True, **fill})
            while (line := (await lines()).strip()) != "stop" and line:
                if line != "window":
                    raise ProbeError(f"stdin: {line[:40]!r} is not a command (window, stop)")
                await set_paused(load.client, base_url, False)
                paused = False
                await asyncio.sleep(TURN_RAMP)
                client_clock = time.process_time(), time.perf_counter()
                start, started = client_clock[1], time.time()
                end = start + workload.duration
                watched = await watch_window(base_url, end, cpu_clock)
                await set_paused(load.client, base_url, True)
                paused = True
                result, cached, source = window_result(load.outcomes, start, end, watched.counters, watched.gpus,
                                                       watched.host)
                result.update(ramp=TURN_RAMP, turn=turns, window_started=started, **(fill if turns == 0 else {}))
                result = described(result, cached, source, watched.cpu, base_url, model, workload, args,
                                   client_clock, None)
                result["pair"] = args.pair
                if reason := failure(result, args.max_failed_fraction):
                    result["error"] = reason
                emit(result)
                turns += 1
                load.outcomes[:] = [o for o in load.outcomes if not o.token_times or o.token_times[-1] >= start]
        finally:
            if paused:
                try:
                    await set_paused(load.client, base_url, False)  # a paused server would wait out its shutdown
                except (aiohttp.ClientError, asyncio.TimeoutError, ProbeError):
                    pass
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
    except (ProbeError, ServerFailed, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        emit({"error": str(exc) if isinstance(exc, (ProbeError, ServerFailed)) else f"{type(exc).__name__}: {exc}"})
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
