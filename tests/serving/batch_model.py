"""A batch-serving engine reduced to its cost model, to test what a steady-state window measures.

Each step decodes one token of every sequence past its prompt and prefills chunks of the others' prompts within a
token budget, and takes ``base + per_decode * decodes + per_prefill * prompt tokens`` seconds: a step's time grows
with its batch, as a GPU engine's does. A sequence's last prompt chunk gives its first token, as vLLM's does.

    python batch_model.py --port P [--base S --per-decode S --per-prefill S --budget N --max-seqs N]
                                   [--cold-seconds S --cold-factor F]

serves it over HTTP as the engine server does (streaming /v1/completions, /health, /v1/models, /metrics with
the engine's token and step counters), sleeping each step's time (on a fresh server, up to ``cold_factor`` times
it while it has been busy less than ``cold_seconds``, as a GPU server that still compiles and allocates).
``steady_rates`` runs the same steps in virtual time with every slot busy for as long as it takes to forget the
start: the truth a window should find.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily


@dataclass(eq=False)  # each request is itself: compared by identity
class Seq:
    prompt: int
    out: int
    prefilled: int = 0
    generated: int = 0
    tokens: asyncio.Queue | None = field(default=None, repr=False)  # the server's stream, if any

    @property
    def done(self) -> bool:
        return self.generated >= self.out


@dataclass
class Costs:
    base: float = 0.010
    per_decode: float = 0.0005
    per_prefill: float = 0.0002
    budget: int = 2048  # tokens per step
    max_seqs: int = 1 << 20  # sequences run at once; the rest wait in arrival order
    cold_seconds: float = 0.0  # a fresh server's steps take up to cold_factor times as long until it has been busy
    cold_factor: float = 1.0  # this long, the factor falling to 1 as it goes (kernels compiled as they are met)

    def step(self, running: list[Seq]) -> tuple[float, int, int]:
        """Advance every running sequence by one step; (its seconds, prompt tokens, generated tokens)."""
        decoding = [s for s in running if s.prefilled == s.prompt]
        left = self.budget - len(decoding)
        prefill = generated = 0
        for s in running:
            if s.prefilled < s.prompt and left > 0:
                chunk = min(left, s.prompt - s.prefilled)
                s.prefilled += chunk
                prefill += chunk
                left -= chunk
                if s.prefilled == s.prompt:
                    s.generated += 1
                    generated += 1
        for s in decoding:
            s.generated += 1
        generated += len(decoding)
        return self.base + self.per_decode * len(decoding) + self.per_prefill * prefill, prefill, generated


def steady_rates(costs: Costs, concurrency: int, prompt: int, out: int, cycles: int = 6) -> tuple[float, float]:
    """Prompt and generated tokens per second with `concurrency` requests always in flight, from a steady state
    (their progress spread evenly), counted after `cycles` request lives over as many more."""
    running = [Seq(prompt, out, prefilled=prompt, generated=k * out // concurrency) for k in range(concurrency)]
    clock = prefill = generated = 0.0
    start = None
    steps = 0
    while True:
        seconds, p, g = costs.step(running)
        clock += seconds
        steps += 1
        if start is None and steps >= cycles * out:
            start, prefill, generated = clock, 0.0, 0.0
        elif start is not None:
            prefill, generated = prefill + p, generated + g
            if steps >= 2 * cycles * out:
                return prefill / (clock - start), generated / (clock - start)
        running = [s if not s.done else Seq(prompt, out) for s in running]


def serve(costs: Costs, port: int) -> None:
    app = FastAPI()
    running: list[Seq] = []
    counts = {"prefill": 0.0, "generated": 0.0, "steps": 0.0, "step_seconds": 0.0}
    wake = asyncio.Event()

    class Counters:  # the engine server's names
        def collect(self):
            for name, key in (("engine:prefill_tokens", "prefill"), ("vllm:generation_tokens", "generated"),
                              ("engine:steps", "steps"), ("engine:step_seconds", "step_seconds")):
                family = CounterMetricFamily(name, key, labels=["model_name"])
                family.add_metric(["batch-model"], counts[key])
                yield family

    registry = CollectorRegistry()
    registry.register(Counters())

    async def loop() -> None:
        while True:
            if not running:
                wake.clear()
                await wake.wait()
            batch = running[:costs.max_seqs]
            seconds, p, g = costs.step(batch)
            if counts["step_seconds"] < costs.cold_seconds:  # still warming: compiling, allocating
                seconds *= 1 + (costs.cold_factor - 1) * (1 - counts["step_seconds"] / costs.cold_seconds)
            await asyncio.sleep(seconds)
            counts["prefill"] += p
            counts["generated"] += g
            counts["steps"] += 1
            counts["step_seconds"] += seconds
            for s in batch:
                if s.generated:
                    s.tokens.put_nowait(s.generated)
                if s.done and s in running:  # (one aborted while the step ran is gone already)
                    running.remove(s)

    @app.on_event("startup")
    async def start() -> None:
        asyncio.get_running_loop().create_task(loop())

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "batch-model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode())

    @app.post("/v1/completions")
    async def complete(request: Request) -> StreamingResponse:
        body = await request.json()
        seq = Seq(len(body["prompt"]), int(body["max_tokens"]), tokens=asyncio.Queue())
        running.append(seq)
        wake.set()

        async def events():
            sent = 0
            try:
                while sent < seq.out:
                    upto = await seq.tokens.get()
                    for _ in range(upto - sent):
                        yield f"data: {json.dumps({'choices': [{'text': 'x', 'index': 0}]})}\n\n"
                    sent = upto
                usage = {"prompt_tokens": seq.prompt, "completion_tokens": seq.out}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
            finally:
                if seq in running:  # the client went away: abort it, as an engine does
                    running.remove(seq)

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    for name, default in vars(Costs()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args()
    serve(Costs(**{k: getattr(args, k) for k in vars(Costs())}), args.port)


if __name__ == "__main__":
    main()
