"""The vllm target's configuration probe: what a live `vllm serve` resolved its options to.

    python -m orchestrator.probes.vllm_config --base-url URL --serve-config serve.yaml [--package DIR]
    {"configuration": {"engine": {...}, "env": {...}, "frontend": {...}, "package": "sha256..."}, "ignored": {}}

A plugin that sets what vLLM already defaults to (`async-scheduling: true` where the version schedules
asynchronously by default), or a capture size the resolved config clamps away, runs exactly what the kept state
runs: measuring it would only give the noise a chance to keep it. The staging loop compares this reading of the
candidate's server with the kept state's and rolls such a change back unmeasured (rule `configuration`).

The reading is what decides what the server runs:
- ``engine``: the engine config the server resolved (`GET /server_info?config_format=json`, which vLLM serves in
  development mode, as the sleep routes), flattened to dotted keys, without what differs from one start to the
  next (``VOLATILE``: an instance id, ports, cache folders, compile times, the KV cache's block count; object
  addresses masked, sets sorted);
- ``env``: the server's ``VLLM_*`` settings, as it reports them;
- ``frontend``: the serve config's keys that are no engine argument (``api-server-count``): the API server's own
  options, absent from the engine config;
- ``package``: a digest of the package's files, so that a patch of vLLM's code is never "the same".

A server started by the probe itself (``--server-cmd``) runs in development mode.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
from ruamel.yaml import YAML, YAMLError

from orchestrator.probes.live_server import LiveServer, ServerFailed, Terminated, on_sigterm, wait_healthy
from orchestrator.loading import ConfigError
from orchestrator.targets.vllm_options import DEV_MODE_ENV, SourceError, default_package, normalize, read

SERVER_INFO = "/server_info?config_format=json"
# keys of the engine config that differ between two starts of one config: ids, ports and folders; what the start
# measured (compile times; the KV cache's blocks, which the memory left beside a sleeping server sizes: an option that
# changes them shows as its own key)
VOLATILE = re.compile(r"(^|\.)(instance_id|engine_id|_api_process_rank|cache_dir|local_cache_dir|debug_dump_path"
                      r"|[a-z_]*port(_list)?|[a-z_]*compilation_time|num_gpu_blocks|num_cpu_blocks"
                      r"|kv_cache_size_tokens|kv_cache_max_concurrency)$")
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # an object shown by its repr (vLLM dumps what JSON cannot hold as str)
# settings that differ between two starts of one config: addresses, and names vLLM draws per process tree where
# none is set (0.34.0's VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME, a uuid: read as a difference, every candidate looked
# changed to the configuration probes)
ENV_VOLATILE = re.compile(r"PORT|HOST|_IP$|RPC_BASE_PATH|SHM_BUFFER_NAME$")


class ProbeFailure(Exception):
    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys; lists as their JSON text, a list of plain values sorted (vLLM
    dumps a set as a list, in an order that changes from one process to the next; its lists of sizes are sets)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list):
        if all(isinstance(v, (str, int, float, bool)) for v in value):
            value = sorted(value, key=lambda v: (type(v).__name__, v))
        value = json.dumps(value, sort_keys=True, default=str)
    if isinstance(value, str):
        value = ADDRESS.sub(" at 0x…", value)
    return {prefix: value}


def engine_reading(vllm_config: Any) -> dict[str, Any]:
    if not isinstance(vllm_config, dict):
        raise ProbeFailure(f"{SERVER_INFO} gave vllm_config as {type(vllm_config).__name__}, not a JSON object")
    return {k: v for k, v in sorted(flatten(vllm_config).items()) if not VOLATILE.search(k)}


def frontend_reading(serve_config: Path, engine_fields: frozenset[str]) -> dict[str, Any]:
    """The serve config's keys that are no engine argument (vLLM's API server reads them itself)."""
    try:
        data = YAML(typ="safe").load(serve_config.read_text(encoding="utf-8")) or {}
    except (OSError, ValueError, YAMLError) as exc:
        raise ProbeFailure(f"{serve_config}: cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ProbeFailure(f"{serve_config}: not a mapping of serve options")
    fields = {f.replace("_", "-") for f in engine_fields}
    return {normalize(str(k)): v for k, v in sorted(data.items()) if normalize(str(k)) not in fields}


def package_digest(package: Path) -> str:
    """sha256 over the package's files (caches left out): a Python file's bytes, another's size and modification
    time (the compiled libraries are hundreds of megabytes; a file put back by a rollback reads as changed, so a
    candidate after it is measured, never wrongly skipped)."""
    h = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(package)).encode() + b"\0")
        if path.suffix == ".py":
            h.update(path.read_bytes())
        else:
            st = path.stat()
            h.update(f"{st.st_size} {st.st_mtime_ns}".encode())
        h.update(b"\0")
    return h.hexdigest()


def server_info(url: str, timeout: float) -> dict:
    try:
        resp = httpx.get(f"{url}{SERVER_INFO}", timeout=timeout)
    except httpx.HTTPError as exc:
        raise ProbeFailure(f"GET {url}{SERVER_INFO}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ProbeFailure(f"GET {url}{SERVER_INFO} answered {resp.status_code} (vLLM serves it only with "
                           f"{DEV_MODE_ENV}=1): {resp.text[:200]}")
    try:
        info = resp.json()
    except ValueError:
        raise ProbeFailure(f"GET {url}{SERVER_INFO} answered no JSON: {resp.text[:200]}") from None
    if not isinstance(info, dict) or "vllm_config" not in info:
        raise ProbeFailure(f"GET {url}{SERVER_INFO} holds no vllm_config")
    return info


def reading(info: dict, serve_config: Path, package: Path) -> dict[str, Any]:
    try:
        engine_fields = read(package).engine_fields
    except SourceError as exc:
        raise ProbeFailure(f"the vllm package {package}: {exc}") from None
    env = info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}
    return {"engine": engine_reading(info["vllm_config"]),
            "env": {k: v for k, v in sorted(env.items()) if not ENV_VOLATILE.search(k)},
            "frontend": frontend_reading(serve_config, engine_fields),
            "package": package_digest(package)}


def run(args: argparse.Namespace) -> dict:
    try:
        package = Path(args.package) if args.package else default_package()
    except ConfigError as exc:
        raise ProbeFailure(str(exc)) from None
    if args.base_url:
        url = args.base_url.rstrip("/")
        try:
            wait_healthy(url, args.startup_timeout)
        except ServerFailed as exc:
            raise ProbeFailure(str(exc), exc.reason) from None
        return {"configuration": reading(server_info(url, args.request_timeout), args.serve_config, package),
                "ignored": {}, "base_url": url}
    server = LiveServer(shlex.split(args.server_cmd), env={**os.environ, DEV_MODE_ENV: "1"},
                        stop_timeout=args.stop_timeout, log_dir=args.server_log_dir, log_label="vllm-config")
    try:
        server.start()
        server.wait_healthy(args.startup_timeout)
        info = server_info(server.url, args.request_timeout)
    except ServerFailed as exc:
        raise ProbeFailure(str(exc), exc.reason) from None
    finally:
        server.stop()
    return {"configuration": reading(info, args.serve_config, package), "ignored": {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.probes.vllm_config", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--server-cmd", help="server command line; the literal {host} and {port} are filled in")
    src.add_argument("--base-url", help="an already running server (in development mode)")
    p.add_argument("--serve-config", type=Path, required=True, help="the `vllm serve --config` YAML it runs")
    p.add_argument("--package", help="the vllm package folder (default: the target's, else the one importable)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--stop-timeout", type=float, default=15.0)
    p.add_argument("--server-log-dir", type=Path)
    p.add_argument("--request-timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result, code = run(args), 0
    except ProbeFailure as exc:
        result, code = {"error": str(exc), **({"reason": exc.reason} if exc.reason else {})}, 1
    except Terminated:
        result, code = {"error": "terminated"}, 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result, sort_keys=True, default=str), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
