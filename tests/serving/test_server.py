"""The engine server against a real HTTP client: its answers equal `LLM.generate` for the same
prompts, however they are sent."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving_support import PY, TINY_CONFIG, env, start_server, write_config
from engine import tokenizer


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


async def stream(client: httpx.AsyncClient, url: str, **body) -> list:
    """The decoded `data:` events of a streamed completion, "[DONE]" included."""
    events = []
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line:
                assert line.startswith("data: ")
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_health_and_models(server):
    assert httpx.get(f"{server}/health").status_code == 200
    models = httpx.get(f"{server}/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 256


def test_text_prompt_equals_generate(server, llm):
    text = "The capital of France is"
    expected = llm.generate([tokenizer.encode(text)], 12)[0]
    body = complete(server, model="tiny", prompt=text, max_tokens=12, temperature=0,
                    return_token_ids=True).json()
    choice = body["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["prompt_token_ids"] == tokenizer.encode(text)
    assert choice["text"] == tokenizer.decode(expected)
    assert choice["finish_reason"] == "length"
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["usage"]["prompt_tokens"] == len(text.encode())
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == len(text.encode()) + 12
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]


def test_streamed_token_ids_equal_generate_and_end_with_done(server, llm):
    prompt = [7, 300, 12, 99, 5, 5, 200, 41, 17]
    expected = llm.generate([prompt], 10)[0]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream(client, server, prompt=prompt, max_tokens=10, return_token_ids=True,
                                stream_options={"include_usage": True})

    events = asyncio.run(go())
    assert events[-1] == "[DONE]"
    usage_event, chunks = events[-2], events[:-2]
    assert usage_event["choices"] == []
    assert usage_event["usage"]["completion_tokens"] == 10
    assert usage_event["usage"]["prompt_tokens"] == len(prompt)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(expected)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_stream_interval_sends_the_first_token_alone_then_chunks_of_that_many(tmp_path, llm):
    """stream-interval 4: the same tokens and text as generate, in chunks of 1, 4, 4 and the rest; several
    requests at once each keep their own count."""
    server, url = start_server(write_config(tmp_path, TINY_CONFIG + "stream-interval: 4\n"))
    prompts = [[7, 300, 12, 99, 5, 5, 200, 41, 17], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8]]
    expected = llm.generate(prompts, 10)

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(stream(client, url, prompt=p, max_tokens=10, return_token_ids=True)
                                          for p in prompts))

    try:
        answers = asyncio.run(go())
    finally:
        server.stop()
    for events, tokens in zip(answers, expected):
        chunks = [e["choices"][0] for e in events[:-1]]
        assert [len(c["token_ids"]) for c in chunks] == [1, 4, 4, 1]
        assert [t for c in chunks for t in c["token_ids"]] == tokens
        assert "".join(c["text"] for c in chunks) == tokenizer.decode(tokens)
        assert [c["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_streamed_text_never_splits_a_character(server):
    # a multi-byte prompt makes a multi-byte continuation likely; any split would show as U+FFFD
    prompt = "naïve café, 東京 — ünïcödé " * 3
    full = complete(server, prompt=prompt, max_tokens=24).json()["choices"][0]["text"]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream(client, server, prompt=prompt, max_tokens=24)

    chunks = asyncio.run(go())[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full


def test_batch_of_prompts_answers_each_in_order(server, llm):
    prompts = [[1, 2, 3, 4], [400, 300, 200], [9] * 20]
    expected = llm.generate(prompts, 6)
    body = complete(server, prompt=prompts, max_tokens=6, return_token_ids=True).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == expected
    assert body["usage"]["prompt_tokens"] == 27
    assert body["usage"]["completion_tokens"] == 18
    texts = ["abc", "xyz!"]
    body = complete(server, prompt=texts, max_tokens=4).json()
    expected = llm.generate([tokenizer.encode(t) for t in texts], 4)
    assert [c["text"] for c in body["choices"]] == [tokenizer.decode(e) for e in expected]


def test_concurrent_requests_share_a_batch_and_equal_generate(server, llm):
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (3, 17, 33, 8, 50, 1)]
    expected = llm.generate(prompts, 48)
    running_seen = []

    async def watch(stop: asyncio.Event, client: httpx.AsyncClient):
        while not stop.is_set():
            text = (await client.get(f"{server}/metrics")).text
            running_seen.extend(s.value for f in text_string_to_metric_families(text)
                                for s in f.samples if s.name == "vllm:num_requests_running")
            await asyncio.sleep(0.01)

    async def one(client, i):
        if i % 2:
            events = await stream(client, server, prompt=prompts[i], max_tokens=48, return_token_ids=True)
            return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
        resp = await client.post(f"{server}/v1/completions",
                                 json={"prompt": prompts[i], "max_tokens": 48, "return_token_ids": True})
        return resp.json()["choices"][0]["token_ids"]

    async def go():
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            watcher = asyncio.create_task(watch(stop, client))
            got = await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
            stop.set()
            await watcher
        return got

    assert asyncio.run(go()) == expected
    assert max(running_seen) >= 2, "requests in flight together never ran together"


def test_repeated_prefix_reports_cached_tokens(server):
    rng = random.Random(11)
    prefix = [rng.randrange(256) for _ in range(40)]  # two full 16-token blocks and a part
    before = metrics(server)
    first = complete(server, prompt=prefix, max_tokens=2).json()["usage"]
    second = complete(server, prompt=prefix + [1, 2, 3], max_tokens=2).json()["usage"]
    after = metrics(server)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 32
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits == 32
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert queries >= 40 + 43


def test_metrics_count_requests_and_tokens(server):
    before = metrics(server)
    complete(server, prompt=[1, 2, 3, 4, 5], max_tokens=7)
    after = metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total"):
        assert name in after
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 5
    assert after["vllm:time_to_first_token_seconds_count"] > before["vllm:time_to_first_token_seconds_count"]
    # one step per token of a lone request (its 5-token prompt in one chunk gives the first), each timed
    assert after["engine:steps_total"] - before["engine:steps_total"] == 7
    assert after["engine:step_seconds_total"] > before["engine:step_seconds_total"]


BAD_REQUESTS = {
    "malformed JSON": b'{"prompt": "hi", "max_tokens": ',
    "body not an object": b'["hi"]',
    "negative max_tokens": {"prompt": "hi", "max_tokens": -1},
    "absurd max_tokens": {"prompt": "hi", "max_tokens": 10**9},
    "prompt longer than max-model-len": {"prompt": [1] * 300, "max_tokens": 1},
    "unknown field": {"prompt": "hi", "max_tokens": 2, "best_of_luck": 3},
    "sampling temperature": {"prompt": "hi", "max_tokens": 2, "temperature": 0.7},
    "token id outside the vocabulary": {"prompt": [1, 512], "max_tokens": 2},
    "empty prompt": {"prompt": "", "max_tokens": 2},
    "prompt of the wrong type": {"prompt": {"text": "hi"}, "max_tokens": 2},
    "missing prompt": {"max_tokens": 2},
    "max_tokens as a string": {"prompt": "hi", "max_tokens": "2"},
    "several choices": {"prompt": "hi", "max_tokens": 2, "n": 2},
}


def test_every_bad_request_is_a_400_while_a_good_one_completes(server, llm):
    good_prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = llm.generate([good_prompt], 120)[0]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            good = asyncio.create_task(stream(client, server, prompt=good_prompt, max_tokens=120,
                                              return_token_ids=True))
            answers = {}
            for name, body in BAD_REQUESTS.items():
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                answers[name] = await client.post(f"{server}/v1/completions", **kw)
            assert not good.done(), "the good request ended before the bad ones were answered"
            return answers, await good

    answers, events = asyncio.run(go())
    for name, resp in answers.items():
        assert resp.status_code == 400, (name, resp.text)
        error = resp.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError", name
        assert error["message"], name
    assert "maximum context length is 256" in answers["prompt longer than max-model-len"].json()["error"]["message"]
    assert answers["unknown field"].json()["error"]["param"] == "best_of_luck"
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == expected


def test_unknown_model_is_a_404(server):
    resp = complete(server, model="gpt-4", prompt="hi", max_tokens=1)
    assert resp.status_code == 404
    assert "gpt-4" in resp.json()["error"]["message"]


def test_sigterm_lets_a_running_request_finish_then_exits(tmp_path, llm):
    server, url = start_server(write_config(tmp_path))
    prompt = [10, 20, 30]
    expected = llm.generate([prompt], 200)[0]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(stream(client, url, prompt=prompt, max_tokens=200,
                                              return_token_ids=True))
            while not (await client.get(f"{url}/metrics")).text.count('num_requests_running{model_name="tiny"} 1.0'):
                await asyncio.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            return await task

    try:
        events = asyncio.run(go())
        # uvicorn re-raises the signal it caught once shutdown is done, so either code is clean
        assert server.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == expected
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_bad_config_exits_2_naming_file_and_key(tmp_path):
    config = write_config(tmp_path, "model: tiny\nmax-num-seqs: many\n")
    proc = subprocess.run([PY, "-m", "engine.server", "--config", str(config), "--port", "1"],
                          capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 2
    assert f"{config}: max-num-seqs" in proc.stderr


def test_engine_failure_answers_500_then_health_turns_503(wrong_kernels):
    """A kernel that crashes mid-step takes the engine loop down: the request in flight gets a
    500 naming the error, and the server says it is unhealthy instead of hanging."""
    from engine.llm_engine import LLMEngine
    from engine.server import Limits, build_app

    engine = LLMEngine({"model": "tiny", "device": "cpu", "dtype": "float32", "kv-cache-memory": 1 << 24,
                        "attention-decode-long": "crash", "decode-long-threshold": 100})
    app = build_app(engine, tokenizer, Limits("tiny", engine.config.max_model_len, engine.config.vocab_size))

    async def go():
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            assert (await client.get("/health")).status_code == 200
            ok = await client.post("/v1/completions", json={"prompt": [1] * 10, "max_tokens": 2})
            assert ok.status_code == 200
            resp = await client.post("/v1/completions", json={"prompt": [1] * 700, "max_tokens": 2})
            assert resp.status_code == 500
            assert "illegal memory access" in resp.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503
            late = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert late.status_code == 503

    asyncio.run(go())


def test_a_queued_request_whose_client_went_away_leaves_the_queue_at_once(tmp_path):
    """One sequence at a time: a streamed request waiting behind a long one, its client gone, is dropped from
    the queue while the long one still runs, not prefilled later for nobody (a probe's window ends by going
    away from the requests it still has in flight)."""
    server, url = start_server(write_config(tmp_path, TINY_CONFIG.replace("max-num-seqs: 8", "max-num-seqs: 1")))

    def gauge(name: str) -> float:
        return metrics(url)[f"vllm:num_requests_{name}"]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            long = asyncio.create_task(stream(client, url, prompt=[10, 20, 30], max_tokens=240))
            while gauge("running") < 1:
                await asyncio.sleep(0.01)
            queued = asyncio.create_task(stream(client, url, prompt=[40, 50], max_tokens=4))
            while gauge("waiting") < 1:
                await asyncio.sleep(0.01)
            queued.cancel()
            gone = asyncio.get_running_loop().time()
            while gauge("waiting") > 0 and asyncio.get_running_loop().time() - gone < 5:
                await asyncio.sleep(0.01)
            seen = gauge("waiting"), gauge("running"), long.done()
            long.cancel()
            return seen

    try:
        waiting, running, long_done = asyncio.run(go())
    finally:
        server.stop()
    assert (waiting, running, long_done) == (0, 1, False)


def test_a_paused_server_keeps_its_requests_where_they_are_and_goes_on_after_resume(server, llm):
    """`/pause?mode=keep` (vLLM's development endpoint): no step runs until `/resume`, a request under way keeps
    its stream and its place, one sent meanwhile queues, and both answer what they would have unpaused."""
    prompt, other = [9, 81, 14, 3, 77, 2], [5, 6, 7]
    expected, expected_other = llm.generate([prompt], 60)[0], llm.generate([other], 4)[0]

    def generated() -> float:
        return metrics(server)["vllm:generation_tokens_total"]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            start = generated()
            running = asyncio.create_task(stream(client, server, prompt=prompt, max_tokens=60, return_token_ids=True))
            while generated() - start < 5:
                await asyncio.sleep(0.01)
            assert (await client.post(f"{server}/pause", params={"mode": "keep"})).status_code == 200
            assert (await client.get(f"{server}/is_paused")).json() == {"is_paused": True}
            frozen = generated()
            queued = asyncio.create_task(stream(client, server, prompt=other, max_tokens=4, return_token_ids=True))
            await asyncio.sleep(1.0)
            seen = generated() - frozen, frozen - start, running.done(), queued.done()
            assert (await client.post(f"{server}/resume")).status_code == 200
            assert (await client.get(f"{server}/is_paused")).json() == {"is_paused": False}
            return seen, await running, await queued

    (moved, before, running_done, queued_done), events, queued_events = asyncio.run(go())
    assert (moved, running_done, queued_done) == (0, False, False)
    assert 5 <= before < 60
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == expected
    assert [t for e in queued_events[:-1] for t in e["choices"][0]["token_ids"]] == expected_other


def test_pause_modes_that_end_requests_are_refused_and_nothing_pauses(server, llm):
    for mode in ("abort", "wait"):
        resp = httpx.post(f"{server}/pause", params={"mode": mode})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "mode", resp.text
        assert mode in resp.json()["error"]["message"]
    assert httpx.post(f"{server}/pause").status_code == 400  # vLLM's default mode is abort
    assert httpx.get(f"{server}/is_paused").json() == {"is_paused": False}
    body = complete(server, prompt=[1, 2, 3], max_tokens=3, return_token_ids=True).json()
    assert body["choices"][0]["token_ids"] == llm.generate([[1, 2, 3]], 3)[0]
