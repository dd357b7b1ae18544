"""What one streamed token costs the serving probe's client, in CPU: the probe keeps every stream of a load in one
asyncio thread, so at 200 streams of a fast server its cost per token sets whether the client, not the server,
bounds a window. A stand-in server (its own process, so its CPU does not count) sends one completion event to
every open stream each step, as an engine step does; the client streams ``--streams`` requests of ``--tokens``
tokens each, and its CPU time over them is divided by the tokens received.

    python benchmarks/client_cost.py [--streams 128] [--tokens 100] [--step-ms 10] [--rounds 3]

Clients: the probe's (`orchestrator.probes.client.send`: aiohttp), the same on uvloop's event loop where uvloop is
installed, and the same loop over httpx's streaming client (what the probe used before), each in a process of its
own, alternating; medians of ``--rounds``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time

EVENT = ("data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                                "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None,
                                             "stop_reason": None}], "usage": None}) + "\n\n").encode()


async def stand_in(step: float) -> None:
    """The server: an event to every open stream each ``step`` seconds; prints its port."""
    streams: set[asyncio.Queue] = set()

    async def tick():
        while True:
            await asyncio.sleep(step)
            for q in list(streams):
                q.put_nowait(None)

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                tokens = json.loads(await reader.readexactly(n))["max_tokens"]
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                q: asyncio.Queue = asyncio.Queue()
                streams.add(q)
                for _ in range(tokens):
                    await q.get()
                    writer.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
                streams.discard(q)
                usage = {"prompt_tokens": 3, "completion_tokens": tokens}
                end = ("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n").encode()
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    asyncio.get_running_loop().create_task(tick())
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


async def httpx_send(client, url: str, tokens: int) -> int:
    """The probe's loop as it was over httpx: its lines, each event parsed."""
    got = 0
    async with client.stream("POST", url, json={"model": "m", "prompt": [1, 2, 3], "max_tokens": tokens,
                                               "stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                got += bool(json.loads(data).get("choices"))
    return got


async def one_round(port: int, kind: str, streams: int, tokens: int) -> tuple[float, float]:
    """(CPU microseconds per token, share of a core) of one client over one load."""
    from orchestrator.probes.client import send, session
    url = f"http://127.0.0.1:{port}/v1/completions"
    if kind == "httpx":
        import httpx
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        client = httpx.AsyncClient(timeout=60, limits=limits)
        go = lambda: httpx_send(client, url, tokens)  # noqa: E731
    else:
        client = session(streams, 60)
        go = lambda: send(client, url, "m", [1, 2, 3], tokens)  # noqa: E731
    async with client:
        await asyncio.gather(*(go() for _ in range(streams)))  # connections open before the clock
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        results = await asyncio.gather(*(go() for _ in range(streams)))
        cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    got = sum(r if isinstance(r, int) else len(r.token_times) for r in results)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return 1e6 * cpu / got, cpu / (t1 - t0)


def client_main(port: int, kind: str, streams: int, tokens: int) -> None:
    main = one_round(port, kind, streams, tokens)
    if kind == "aiohttp+uvloop":
        import uvloop
        print(json.dumps(uvloop.run(main)))
    else:
        print(json.dumps(asyncio.run(main)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve", type=float, help=argparse.SUPPRESS)
    p.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        return asyncio.run(stand_in(a.serve))
    if a.client:
        return client_main(int(a.client[0]), a.client[1], a.streams, a.tokens)
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(a.step_ms / 1e3)], stdout=subprocess.PIPE,
                              text=True)
    try:
        port = server.stdout.readline().strip()
        import importlib.util
        kinds = ["aiohttp+uvloop"] * bool(importlib.util.find_spec("uvloop")) + ["aiohttp", "httpx"]
        runs: dict[str, list] = {k: [] for k in kinds}
        for _ in range(a.rounds):
            for kind in kinds:  # each client in a process of its own, alternating
                out = subprocess.run([sys.executable, __file__, "--client", port, kind, "--streams", str(a.streams),
                                      "--tokens", str(a.tokens)], capture_output=True, text=True, check=True)
                runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
    rate = a.streams / (a.step_ms / 1e3)
    print(f"{a.streams} streams x {a.tokens} tokens, an event to each every {a.step_ms:g} ms ({rate:,.0f} tokens/s); "
          f"medians of {a.rounds}")
    print("| client | CPU per token | share of a core |\n|---|---|---|")
    for kind in kinds:
        us = statistics.median(r[0] for r in runs[kind])
        share = statistics.median(r[1] for r in runs[kind])
        print(f"| {kind} | {us:.0f} us | {share:.0%} |")


if __name__ == "__main__":
    main()
