"""A steady load ends when its request loops are cancelled, even where a request swallows the cancel.

On vLLM (one H100), a warm-up's load kept 8 of its 128 loops sending for minutes after the warm-up had ended:
a cancel that arrives while an HTTP stream closes can come out as the client's own error, which ``send`` records
as the request's failure, and the loop went on to its next request. Here ``send`` swallows every cancel that way.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from orchestrator.probes import client, serving
from orchestrator.probes.workload import Workload

WORKLOAD = Workload(num_prompts=8, input_len=16, output_len=8, max_concurrency=4, duration=0.2, ramp=0.0)


def swallowing_send(sent: list[int]):
    async def send(http, url, model, prompt, max_tokens, out=None):
        out = out if out is not None else client.Outcome()
        out.prompt_len, out.max_tokens = len(prompt), max_tokens
        sent.append(max_tokens)
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:  # what an HTTP client's error raised on close does to a cancel
            out.error = "ReadError: closed mid-stream"
            return out
        now = asyncio.get_running_loop().time()
        out.success, out.first_at, out.latency, out.output_tokens = True, now, 0.05, max_tokens
        out.token_times = [now]
        return out
    return send


def finishes(coro, seconds: float):
    """Runs ``coro`` on a loop of its own and returns its result, or fails once ``seconds`` have passed (a load
    that never ends cannot be cancelled either: the daemon thread is left to the process's exit)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(coro)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"still running after {seconds} s"
    return result[0]


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    sent: list[int] = []
    monkeypatch.setattr(client, "send", swallowing_send(sent))
    return sent


def test_a_load_whose_requests_swallow_the_cancel_still_ends(sent):
    async def load() -> int:
        async with client.steady_load("http://127.0.0.1:9", "m", WORKLOAD, 5.0) as running:
            await asyncio.sleep(0.3)
            return len(running.outcomes)

    begun = finishes(load(), 10)
    assert begun >= WORKLOAD.concurrency
    after = len(sent)
    assert after <= begun + 1 + WORKLOAD.concurrency  # the test request, what was sent, at most one more a loop


def test_a_warm_up_ends_once_settled_though_its_requests_swallow_the_cancel(sent, monkeypatch):
    monkeypatch.setattr(serving, "WARM_SECONDS", 0.1)
    found = finishes(serving.warm_up("http://127.0.0.1:9", "m", WORKLOAD, 5.0), 20)
    assert found["warmup_seconds"] < serving.WARM_LIMIT
    assert len(found["warmup_rates"]) >= 2
