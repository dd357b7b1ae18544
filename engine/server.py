"""OpenAI-compatible HTTP server for the reference engine, so the serving probe can measure it
exactly as it measures ``vllm serve``.

    python -m engine.server --config SERVE.yaml --host 127.0.0.1 --port 8000

One thread owns the ``LLMEngine`` and runs its step loop: the engine is not thread-safe, and one
loop is what lets concurrent requests share a continuous batch. Each completion request is a
``CompletionStream``: an asyncio queue that the engine thread feeds with that request's step
outputs, and the answer built from them. Routes live on a module-level router and find the worker,
tokenizer, limits and metrics in ``app.state``, as vLLM's API server finds its handlers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from pydantic_core import from_json

from engine import tokenizer
from engine.config import ConfigError, load_config
from engine.llm_engine import LLMEngine

# engine.stats key -> (vLLM counter name without _total, help text)
STAT_COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens", "Prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Generation tokens processed."),
    # not vLLM's: prompt tokens counted chunk by chunk as prefill runs (vLLM counts a prompt at its first output)
    "prefill_tokens": ("engine:prefill_tokens", "Prompt tokens computed, counted as each prefill chunk runs."),
    "requests_finished": ("vllm:request_success", "Requests finished."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "preemptions": ("vllm:num_preemptions", "Requests preempted."),
    # not vLLM's: what a long-lived server's steps cost against a fresh one's (orchestrator/probes/serving.py)
    "steps": ("engine:steps", "Engine steps that ran something."),
    "step_seconds": ("engine:step_seconds", "Wall time inside those steps."),
}
# not vLLM's: when the counters above last moved. A window measured between two step ends counts whole steps
# over exactly the time they took; between two arbitrary instants it would miss part of a step at each end,
# up to one step's tokens (a step of 300-600 ms is 3-6% of a 10-s window)
STEP_ENDED = ("engine:last_step_end_time_seconds", "Unix time at which the last step that ran something ended.")


class BadRequest(Exception):
    """A client error answered with a 400 (or ``status``) and an OpenAI-style body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError",
            503: "ServiceUnavailableError"}
    body = {"error": {"message": message, "type": kind.get(status, "InternalServerError"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------- the engine thread


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    started: bool = False
    held: list[int] = field(default_factory=list)  # tokens of this request not sent yet (stream-interval)


class EngineWorker:
    """Runs the engine's step loop on its own thread and routes step outputs to request queues."""

    def __init__(self, engine: Any, stream_interval: int = 1):
        self.engine = engine
        self.stream_interval = stream_interval
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None
        self.stats: dict[str, float] = dict(engine.stats)
        self.num_running = 0
        self.num_waiting = 0
        self.paused = False  # written by the engine thread only, between steps

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt: list[int], max_tokens: int, q: asyncio.Queue, index: int) -> str:
        """Queue a request; its outputs arrive on ``q`` as ``(index, StepOutput)`` or ``(index, exc)``."""
        request_id = uuid.uuid4().hex
        self._inbox.put(("add", request_id, prompt, max_tokens,
                         _Stream(asyncio.get_running_loop(), q, index)))
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def set_paused(self, paused: bool) -> None:
        """Stop stepping (or step again) once the step under way has ended: requests keep their place, their
        cache and their open streams, and requests that arrive meanwhile queue. Returns once no step runs (or the
        loop has ended: then none ever will)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(("pause", paused, loop, done))
        while not done.done() and self._thread.is_alive():
            await asyncio.wait([done], timeout=0.5)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished() and not self.paused
                self._drain(block=not busy)
                if self.engine.has_unfinished() and not self.paused:
                    self._publish(self.engine.step())
        except BaseException as exc:  # the engine is unusable now: fail everyone who waits
            self.error = exc
        finally:
            reason = self.error or RuntimeError("server is shutting down")
            for stream in self._streams.values():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, reason))
            self._streams.clear()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                self._handle(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, item: tuple) -> None:
        if item[0] == "pause":
            _, self.paused, loop, done = item
            loop.call_soon_threadsafe(done.set_result, None)
            return
        if item[0] == "abort":
            if self._streams.pop(item[1], None) is not None:
                self.engine.abort(item[1])
                self._count()
            return
        _, request_id, prompt, max_tokens, stream = item
        try:
            self.engine.add_request(prompt, max_tokens, request_id=request_id)
        except ValueError as exc:  # the engine's own limits, e.g. a batch budget
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                             (stream.index, BadRequest(str(exc), "prompt")))
            return
        self._streams[request_id] = stream
        self._count()

    def _publish(self, outputs: list) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted while the step ran
                continue
            first = not stream.started
            stream.started = True
            if out.finished:
                del self._streams[out.request_id]
            if self.stream_interval > 1:  # the first token at once (its latency is the prompt's), then in chunks
                stream.held += out.new_token_ids
                if not (first or out.finished or len(stream.held) >= self.stream_interval):
                    continue
                out, stream.held = replace(out, new_token_ids=stream.held), []
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, out))
        self._count()

    def _count(self) -> None:
        self.stats = dict(self.engine.stats)
        running = sum(s.started for s in self._streams.values())
        self.num_running, self.num_waiting = running, len(self._streams) - running


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


PromptType = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class CompletionRequest(BaseModel):
    """The subset of OpenAI's completion request the engine honours; anything else is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: PromptType
    max_tokens: StrictInt = 16
    temperature: float = 0.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    logprobs: None = None
    echo: Literal[False] = False
    seed: int | None = None
    user: str | None = None


class Detokenizer:
    """Turns a growing token list into text deltas without splitting a UTF-8 character."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def add(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta


MAX_REQUEST_BYTES = 16 << 20  # a 256-prompt batch of 8k token ids is about 12 MiB of JSON
MAX_PROMPTS = 256
# JSON bytes a request may spend per token the model could take: a token id of six digits and its separator take
# 8, a byte of a text prompt at most 6 (\u0001); twice that leaves room for whitespace
BYTES_PER_TOKEN = 16
OTHER_FIELDS_BYTES = 64 << 10


@dataclass
class Limits:
    model_name: str
    max_model_len: int
    vocab_size: int
    max_request_bytes: int = MAX_REQUEST_BYTES  # larger bodies get a 413 before they are parsed
    max_prompts: int = MAX_PROMPTS  # prompts of one request (a batch): more is a 400
    # what this server runs, in /v1/models: the kernel chosen for each kernel key, its device and dtype
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def body(self) -> tuple[int, str]:
        """The bytes a request body may hold and why: ``max_request_bytes``, or less where the model's context
        could not take more (``max_prompts`` prompts of ``max_model_len`` tokens), so that a prompt far too long
        is refused before it is read."""
        fits = self.max_prompts * self.max_model_len * BYTES_PER_TOKEN + OTHER_FIELDS_BYTES
        if fits < self.max_request_bytes:
            return fits, f" ({self.max_prompts} prompts of at most {self.max_model_len} tokens)"
        return self.max_request_bytes, ""


@dataclass
class _Choice:
    prompt: list[int]
    detok: Detokenizer
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    cached: int = 0
    finished: bool = False

    def finish_reason(self) -> str | None:
        if not self.finished:
            return None
        return "length" if len(self.token_ids) >= self.max_tokens else "stop"


def _prompts(req: CompletionRequest, tokenizer: Any, limits: Limits) -> list[list[int]]:
    """The prompts as token ids; each one's length is checked before its tokens are made or looked at."""
    raw = req.prompt
    batch = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
    if not batch:
        raise BadRequest("prompt must not be empty", "prompt")
    if len(batch) > limits.max_prompts:
        raise BadRequest(f"at most {limits.max_prompts} prompts per request, got {len(batch)}", "prompt")
    prompts = []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        n = tokenizer.count(p) if isinstance(p, str) else len(p)
        if not n:
            raise BadRequest(f"{where} must not be empty", "prompt")
        if n + req.max_tokens > limits.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                f"you requested {n + req.max_tokens} tokens ({n} in {where}, "
                f"{req.max_tokens} in the completion). Please reduce the length of the prompt "
                f"or completion.", "max_tokens" if n < limits.max_model_len else "prompt")
        ids = tokenizer.encode(p) if isinstance(p, str) else p
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise BadRequest(f"{where} holds token id {bad[0]} outside the vocabulary "
                             f"[0, {limits.vocab_size})", "prompt")
        prompts.append(ids)
    return prompts


def _validate(body: bytes, limits: Limits) -> CompletionRequest:
    try:  # pydantic's parser: no recursion of Python's, and a string must be Unicode text (no lone surrogate)
        data = from_json(body, allow_inf_nan=False)
    except ValueError as exc:  # malformed, not UTF-8, too deep, a lone surrogate, an integer of 4,300 digits
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    try:
        req = CompletionRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["loc"][:1] == ("prompt",) and err["type"] != "missing":
            raise BadRequest("prompt must be a string, a list of token ids, or a list of either",
                             "prompt") from None
        loc = ".".join(str(p) for p in err["loc"])
        raise BadRequest(f"{loc or 'body'}: {err['msg']}", loc or None) from None
    if req.model is not None and req.model != limits.model_name:
        raise BadRequest(f"The model `{req.model}` does not exist.", "model", status=404)
    if req.temperature != 0.0:
        raise BadRequest("only greedy decoding is served: temperature must be 0", "temperature")
    if req.max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
    return req


def _usage(choices: list[_Choice]) -> dict:
    prompt = sum(len(c.prompt) for c in choices)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached for c in choices)}}


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, refused with a 413 once it exceeds ``limits.body``: by its Content-Length before
    anything is read, else (chunked) as soon as the bytes received pass the limit."""
    limit, why = limits.body
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body of {declared} bytes exceeds the limit of {limit} bytes{why}", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadRequest(f"request body exceeds the limit of {limit} bytes{why}", status=413)
    return bytes(body)


class CompletionStream:
    """One completion request in flight: its prompts handed to the engine thread, the step outputs
    coming back on its queue, and the two ways of answering (one JSON body, or server-sent events).
    Whichever way it ends, the prompts still running are aborted."""

    def __init__(self, req: CompletionRequest, prompts: list[list[int]], worker: EngineWorker,
                 tokenizer: Any, limits: Limits, metrics: "ServerMetrics"):
        self.req, self.worker, self.tokenizer, self.metrics = req, worker, tokenizer, metrics
        self.start = time.monotonic()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [_Choice(p, Detokenizer(tokenizer), req.max_tokens) for p in prompts]
        self.ids = [worker.submit(p, req.max_tokens, self.queue, i) for i, p in enumerate(prompts)]
        self.head = {"id": f"cmpl-{self.ids[0]}", "object": "text_completion",
                     "created": int(time.time()), "model": limits.model_name}

    async def events(self):
        """Yields (choice index, text delta, step output) until every choice has finished."""
        first = True
        while not all(c.finished for c in self.choices):
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if first:
                self.metrics.ttft.observe(time.monotonic() - self.start)
                first = False
            choice = self.choices[index]
            choice.token_ids += item.new_token_ids
            choice.cached, choice.finished = item.num_cached_tokens, item.finished
            yield index, choice.detok.add(item.new_token_ids, item.finished), item
        self.metrics.e2e.observe(time.monotonic() - self.start)

    def abort_unfinished(self) -> None:
        for rid, choice in zip(self.ids, self.choices):
            if not choice.finished:
                self.worker.abort(rid)

    def choice_body(self, index: int, text: str, token_ids: list[int]) -> dict:
        choice = self.choices[index]
        body = {"index": index, "text": text, "logprobs": None, "finish_reason": choice.finish_reason()}
        if self.req.return_token_ids:
            body["token_ids"] = token_ids
            body["prompt_token_ids"] = choice.prompt
        return body

    async def response(self) -> Response:
        """The whole completion as one JSON body."""
        try:
            async for _ in self.events():
                pass
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.param)
        except Exception as exc:
            return error_response(f"engine failed: {exc!r}", 500)
        finally:
            self.abort_unfinished()
        return JSONResponse({**self.head, "choices": [
            self.choice_body(i, self.tokenizer.decode(c.token_ids), c.token_ids)
            for i, c in enumerate(self.choices)], "usage": _usage(self.choices)})

    async def sse(self):
        """Server-sent events: one per step output, the usage if asked, then ``[DONE]``."""
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        try:
            async for index, text, out in self.events():
                chunk = {**self.head, "choices": [self.choice_body(index, text, out.new_token_ids)]}
                if include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                yield f"data: {json.dumps({**self.head, 'choices': [], 'usage': _usage(self.choices)})}\n\n"
        except Exception as exc:  # headers are sent: report in-band, as vLLM does
            status = exc.status if isinstance(exc, BadRequest) else 500
            err = {"error": {"message": str(exc) or repr(exc), "code": status}}
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            self.abort_unfinished()
        yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- the app


class ServerMetrics:
    """vLLM's metric names: the engine's counters and queue gauges, read from the worker at scrape
    time, and the latency histograms each request stream observes."""

    def __init__(self, worker: EngineWorker, model_name: str):
        self.worker, self.model_name = worker, model_name
        self.registry = CollectorRegistry()
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], registry=self.registry).labels(model_name=model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             ["model_name"], registry=self.registry).labels(model_name=model_name)
        self.registry.register(self)

    def collect(self):
        stats = self.worker.stats
        for key, (name, doc) in STAT_COUNTERS.items():
            if key in stats:
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], stats[key])
                yield family
        for name, value, doc in (
            ("vllm:num_requests_running", self.worker.num_running, "Requests producing tokens."),
            ("vllm:num_requests_waiting", self.worker.num_waiting, "Requests not yet started."),
            (STEP_ENDED[0], stats.get("step_ended", 0.0), STEP_ENDED[1]),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    worker = request.app.state.worker
    if not worker.alive:
        return error_response(f"engine stopped: {worker.error!r}", 503)
    return Response(status_code=200)


@router.post("/pause")
async def pause(request: Request, mode: str = "abort") -> Response:
    """vLLM's `/pause` (its development endpoints): `mode=keep` freezes every request where it is until `/resume`,
    so that a server measured in turns with another on one GPU goes on from the state it was in, with no
    refill. vLLM's other modes (`abort`, its default, and `wait`) end or finish the requests first: not offered."""
    if mode != "keep":
        raise BadRequest(f"mode {mode!r}: this server pauses with mode=keep only", "mode")
    return await _set_paused(request, True)


@router.post("/resume")
async def resume(request: Request) -> Response:
    return await _set_paused(request, False)


async def _set_paused(request: Request, paused: bool) -> Response:
    worker = request.app.state.worker
    if not worker.alive:
        return error_response(f"engine stopped: {worker.error!r}", 503)
    await worker.set_paused(paused)
    return Response(status_code=200)


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    return {"is_paused": request.app.state.worker.paused}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    limits = request.app.state.limits
    return {"object": "list", "data": [{
        "id": limits.model_name, "object": "model", "created": 0, "owned_by": "engine",
        "root": limits.model_name, "max_model_len": limits.max_model_len, "engine": limits.engine}]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type="text/plain; version=0.0.4")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = request.app.state
    req = _validate(await read_body(request, state.limits), state.limits)
    prompts = _prompts(req, state.tokenizer, state.limits)
    if not state.worker.alive:
        return error_response(f"engine stopped: {state.worker.error!r}", 503)
    stream = CompletionStream(req, prompts, state.worker, state.tokenizer, state.limits, state.metrics)
    if req.stream:
        return StreamingResponse(stream.sse(), media_type="text/event-stream")
    return await stream.response()


def build_app(engine: Any, tokenizer: Any, limits: Limits, stream_interval: int = 1) -> FastAPI:
    """The HTTP app around ``engine`` (anything with the ``LLMEngine`` step API)."""
    worker = EngineWorker(engine, stream_interval)

    async def lifespan(_app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.worker, app.state.tokenizer, app.state.limits = worker, tokenizer, limits
    app.state.metrics = ServerMetrics(worker, limits.model_name)
    app.add_exception_handler(BadRequest, _bad_request)
    app.include_router(router)
    return app


async def _bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
    return error_response(str(exc), exc.status, exc.param)


# ---------------------------------------------------------------- command line


def pin(cpus: set[int]) -> None:
    """Every thread of this process, and those it starts later, on ``cpus`` only."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="serve config (YAML) of the engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="name in /v1/models (default: the config's model)")
    parser.add_argument("--shutdown-timeout", type=int, default=30,
                        help="seconds SIGTERM waits for running requests before cancelling them")
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                        help="larger request bodies are answered 413")
    parser.add_argument("--max-prompts-per-request", type=int, default=MAX_PROMPTS,
                        help="a batch of more prompts is answered 400")
    parser.add_argument("--kv-cache-memory", type=int, metavar="BYTES",
                        help="size the KV cache at this many bytes, whatever the config says: two servers living "
                             "side by side on one GPU each take a fixed share instead of a fraction of the card")
    parser.add_argument("--cpu-affinity", type=int, nargs="+", metavar="CPU",
                        help="run on these CPUs only (Linux): the staging loop puts both servers of a simultaneous "
                             "comparison on one core, which interleaves them finely")
    args = parser.parse_args(argv)
    if args.max_request_bytes < 1 or args.max_prompts_per_request < 1:
        parser.error("--max-request-bytes and --max-prompts-per-request must be at least 1")
    if args.kv_cache_memory is not None and args.kv_cache_memory < 1:
        parser.error("--kv-cache-memory must be at least 1")
    if args.cpu_affinity:
        try:
            pin(set(args.cpu_affinity))
        except (OSError, AttributeError) as exc:
            parser.error(f"--cpu-affinity {' '.join(map(str, args.cpu_affinity))}: {exc}")
    # the engine logs its kernel choices and cache size at INFO: the first thing to read in a server log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        config = load_config(args.config)
        if args.kv_cache_memory is not None:
            config = config.updated(kv_cache_memory=args.kv_cache_memory)
        engine = LLMEngine(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    limits = Limits(args.served_model_name or config.model, config.max_model_len, config.vocab_size,
                    args.max_request_bytes, args.max_prompts_per_request,
                    {"kernels": dict(engine.kernel_choice), "device": config.torch_device().type,
                     "dtype": str(config.torch_dtype()).removeprefix("torch.")})
    disable_created_metrics()  # vLLM exposes no *_created series either
    logging.getLogger("engine").info("serving %s on http://%s:%d", limits.model_name,
                                             args.host, args.port)
    uvicorn.run(build_app(engine, tokenizer, limits, config.stream_interval), host=args.host, port=args.port,
                log_level="warning", timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
