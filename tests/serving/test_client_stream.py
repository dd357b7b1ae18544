"""The probe's streaming client against a real HTTP server that misbehaves in each way a server can: every request
ends as an outcome (its error named), never as an exception out of the load, and a good stream is timed token by
token with the usage its last event gives."""
from __future__ import annotations

import asyncio
import json

from orchestrator.probes.client import send, session

CHUNK = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " a", "finish_reason": None}]}


def event(body) -> bytes:
    return b"data: " + (body if isinstance(body, bytes) else json.dumps(body).encode()) + b"\n\n"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# what the server sends for each prompt's first token id: the events of a stream, or a whole response
BEHAVIOURS = {
    1: [event(CHUNK)] * 3 + [event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                                            "prompt_tokens_details": {"cached_tokens": 4}}}),
                             event(b"[DONE]")],
    2: [event(CHUNK), event({"error": {"message": "out of blocks"}})],
    3: [event(CHUNK), event(CHUNK)],  # ends without [DONE]
    4: [event(CHUNK), b"data: {not json\n\n", event(b"[DONE]")],
    5: [event(b"[DONE]")],  # no token at all
    6: [event([1, 2])],  # an event that is no JSON object
}


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            which = json.loads(await reader.readexactly(length))["prompt"][0]
            if which == 500:
                body = b"engine dead"
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for data in BEHAVIOURS[which]:
                writer.write(chunked(data))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def outcomes(prompts: list[int]):
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    try:
        async with session(4, 10.0) as client:
            return await asyncio.gather(*(send(client, url, "m", [p, 9, 9], 3) for p in prompts))
    finally:
        server.close()


def test_each_way_a_stream_fails_is_an_outcome_and_a_good_one_is_timed():
    good, error, cut, garbled, empty, not_object, refused = asyncio.run(outcomes([1, 2, 3, 4, 5, 6, 500]))
    assert good.success and good.error == ""
    assert (good.output_tokens, good.prompt_len, good.cached_tokens) == (3, 7, 4)
    assert len(good.token_times) == 3 and len(good.itl) == 2 and all(g > 0 for g in good.itl)
    assert 0 < good.ttft <= good.latency
    assert not error.success and error.error.startswith("server error in stream") and "out of blocks" in error.error
    assert not cut.success and cut.error == "stream ended without data: [DONE]" and len(cut.token_times) == 2
    assert not garbled.success and garbled.error.startswith("JSONDecodeError")
    assert not empty.success and empty.error == "stream held no tokens"
    assert not not_object.success and not_object.error.startswith("stream event is not a JSON object")
    assert not refused.success and refused.error == "HTTP 500: engine dead"


def test_a_server_that_is_not_there_is_an_outcome_too():
    async def nowhere():
        async with session(1, 2.0) as client:
            return await send(client, "http://127.0.0.1:9/v1/completions", "m", [1], 1)

    out = asyncio.run(nowhere())
    assert not out.success and out.error.startswith("Client")  # aiohttp's ClientConnectorError

