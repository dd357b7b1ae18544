"""The engine server's limits on what one request may hold, against a real server and client: a body too large
is a 413, too many prompts or JSON too deep to parse a 400, and the server goes on serving."""
from __future__ import annotations

import json

import httpx
import pytest

from serving_support import start_server


@pytest.fixture(scope="module")
def small_server(tiny_config):
    proc, url = start_server(tiny_config, "--max-request-bytes", "4096", "--max-prompts-per-request", "4")
    yield url
    proc.stop()


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, **kw)


def assert_error(resp: httpx.Response, status: int, *fragments: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


def body_of(size: int) -> bytes:
    """A valid completion request padded to exactly `size` bytes."""
    head = b'{"prompt": [1, 2, 3], "max_tokens": 2, "user": "'
    tail = b'"}'
    return head + b"u" * (size - len(head) - len(tail)) + tail


def test_a_body_over_the_limit_is_a_413_and_one_at_the_limit_is_served(small_server):
    at_limit = post(small_server, content=body_of(4096), headers={"content-type": "application/json"})
    assert at_limit.status_code == 200, at_limit.text
    error = assert_error(post(small_server, content=body_of(4097), headers={"content-type": "application/json"}),
                         413, "request body of 4097 bytes exceeds the limit of 4096 bytes")
    assert error["type"] == "RequestTooLargeError"


def test_a_chunked_body_over_the_limit_is_a_413(small_server):
    def chunks():
        body = body_of(6000)
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]
    resp = post(small_server, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in resp.request.headers  # sent chunked: only the bytes can tell
    assert_error(resp, 413, "request body exceeds the limit of 4096 bytes")


def test_more_prompts_than_the_cap_is_a_400(small_server):
    error = assert_error(post(small_server, json={"prompt": [[1, 2]] * 5, "max_tokens": 1}), 400,
                         "at most 4 prompts per request, got 5")
    assert error["param"] == "prompt"
    ok = post(small_server, json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


@pytest.mark.parametrize("body", [
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 1}',
    b'{"prompt": "hi", "stream_options": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    b'{"prompt": ' + b"[" * 500 + b"1" + b"]" * 500 + b', "max_tokens": 1}',
    b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}",
], ids=["nested arrays", "nested objects", "moderately nested", "huge integer"])
def test_json_too_deep_or_too_large_to_parse_is_the_documented_400(server, body):
    resp = post(server, content=body, headers={"content-type": "application/json"})
    assert_error(resp, 400)
    assert resp.json()["error"]["type"] == "BadRequestError"
    assert httpx.get(f"{server}/health").status_code == 200
    good = post(server, json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert good.status_code == 200 and json.loads(good.text)["usage"]["completion_tokens"] == 2


def test_the_defaults_are_documented_and_a_bad_limit_is_refused(tiny_config):
    import subprocess

    from engine import server
    from serving_support import PY, env
    assert (server.MAX_REQUEST_BYTES, server.MAX_PROMPTS) == (16 << 20, 256)
    proc = subprocess.run([PY, "-m", "engine.server", "--config", str(tiny_config), "--max-prompts-per-request",
                           "0"], capture_output=True, text=True, timeout=60, env=env())
    assert proc.returncode == 2 and "--max-prompts-per-request must be at least 1" in proc.stderr


@pytest.mark.parametrize("body", [
    b'{"prompt": "\\ud800", "max_tokens": 1}',
    b'{"prompt": "a\\udc00b", "max_tokens": 1}',
    b'{"prompt": ["ok", "\\ud800"], "max_tokens": 1}',
    b'{"prompt": "hi", "max_tokens": 1, "user": "\\ud800"}',
    b'{"prompt": "hi", "max_tokens": 1, "model": "\\udfff"}',
], ids=["prompt", "inside a prompt", "in a batch", "user", "model"])
def test_a_lone_surrogate_is_a_400_and_the_server_goes_on(server, body):
    """Valid JSON, but no Unicode text: a string holding half of a UTF-16 surrogate pair."""
    resp = post(server, content=body, headers={"content-type": "application/json"})
    error = assert_error(resp, 400, "request body is not valid JSON")
    assert error["type"] == "BadRequestError"
    assert httpx.get(f"{server}/health").status_code == 200
    pair = post(server, content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1, "return_token_ids": true}',
                headers={"content-type": "application/json"})
    assert pair.status_code == 200 and pair.json()["choices"][0]["prompt_token_ids"] == list("😀".encode())


def test_a_prompt_longer_than_the_model_allows_is_refused_before_its_body_is_read(server):
    """256 prompts of 256 tokens at most (the tiny config): a 16 MB body is refused by its Content-Length at once,
    while the client is still sending; a whole request of the longest prompt, pretty-printed, is served."""
    import socket
    from urllib.parse import urlsplit
    size = 16_000_000
    address = urlsplit(server)
    with socket.create_connection((address.hostname, address.port), timeout=20) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {address.netloc}\r\ncontent-type: application/json\r\n"
                     f"content-length: {size}\r\n\r\n".encode() + b'{"max_tokens": 1, "prompt": "' + b"a" * 10_000)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)  # a server that waits for all 16 MB times out here
            if not chunk:
                break
            answer += chunk
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    error = json.loads(text)["error"]
    assert error["type"] == "RequestTooLargeError" and error["code"] == 413
    assert f"request body of {size} bytes exceeds the limit of" in error["message"]
    assert "256 prompts of at most 256 tokens" in error["message"]
    longest = json.dumps({"prompt": [[255] * 255] * 256, "max_tokens": 1}, indent=1).encode()
    ok = post(server, content=longest, headers={"content-type": "application/json"})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256
