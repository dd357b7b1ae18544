"""Live correctness probe: greedy completions of a fixed set of token-id prompts through a running
server's ``/v1/completions``, compared with those recorded on the baseline; plus, with
``--check-command``, the target's check of the kernels that server runs.

    python -m orchestrator.probes.greedy --reference state/vllm-reference.json \\
        (--server-cmd 'vllm serve --config serve.yaml --host {host} --port {port}' | --base-url URL)

The reference is recorded by the first run that finds none, only when the baseline is being probed
(``ORCHESTRATOR_PLUGIN`` unset or ``baseline``): a candidate never defines what is right. Prompts
are sent one at a time, so every state decodes each prompt at batch size one and batching changes
no arithmetic between states. The baseline is asked twice when recorded; where its two passes
differ (a nondeterministic kernel), later comparisons are by agreement, since equality would fail
the baseline itself.

Modes: ``exact`` (every prompt's tokens and text equal the reference's) unless the probed state
holds a plugin that declares it changes numerics (``$ORCHESTRATOR_CHANGES_NUMERICS`` names them),
then ``agreement`` as in the engine's probe: a prompt "diverges early" when it differs within its
first ``--early-tokens`` tokens, and the probe fails when more than ``--max-early-fraction`` of the
prompts do (a broken change makes nearly every prompt diverge at once). ``--mode`` forces either.

The last stdout line is one JSON object with ``passed`` (probe protocol); exit 1 when not passed. A
server that never became healthy adds ``"reason": "timeout"``, one that exited ``"crashed"``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from orchestrator.plugin import NUMERICS_ENV, declared_numerics
from orchestrator.probes.live_server import (LiveServer, ServerFailed, Terminated, on_sigterm, server_label,
                                             wait_healthy)
from orchestrator.probes.reference import ProbeFailure, compare, read_reference, write_reference

FORMAT = 1
LENGTHS = (1, 7, 16, 17, 33, 64, 150, 300)  # prompt lengths: single-token, block edges, multi-block
MAX_TOKENS = 16
TOKEN_RANGE = (0, 256)  # ids every vocabulary has, the project's tiny engine's included
SEED = 20240611
CHECK_TIMEOUT = 900


def prompt_set(lengths: tuple[int, ...] = LENGTHS, low: int = TOKEN_RANGE[0], high: int = TOKEN_RANGE[1],
               seed: int = SEED) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------- talking to the server


def served_model(client: httpx.Client, base_url: str) -> str:
    resp = client.get(f"{base_url}/v1/models")
    data = resp.json().get("data") if resp.status_code == 200 else None
    if not data:
        raise ProbeFailure(f"{base_url}/v1/models answered {resp.status_code} without a model")
    return data[0]["id"]


def complete(client: httpx.Client, base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion: its text and, where the server returns them, its token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    try:
        resp = client.post(f"{base_url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise ProbeFailure(f"a completion of a {len(prompt)}-token prompt failed: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ProbeFailure(f"a completion of a {len(prompt)}-token prompt answered HTTP {resp.status_code}: "
                           f"{resp.text[:300]}")
    choice = resp.json()["choices"][0]
    ids = choice.get("token_ids")
    return {"text": choice.get("text", ""), "token_ids": list(ids) if isinstance(ids, list) else None}


def generate(base_url: str, model: str | None, prompts: list[list[int]], max_tokens: int,
             timeout: float, passes: int = 1) -> tuple[str, list[list[dict]]]:
    """(model name, the completions of each pass over the prompts), one request at a time."""
    with httpx.Client(timeout=timeout) as client:
        model = model or served_model(client, base_url)
        return model, [[complete(client, base_url, model, p, max_tokens) for p in prompts] for _ in range(passes)]


# ---------------------------------------------------------------- the reference


def may_record() -> bool:
    return os.environ.get("ORCHESTRATOR_PLUGIN", "baseline") in ("", "baseline")


# ---------------------------------------------------------------- judging


def mode_of(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(exact | agreement, the plugins said to change numerics)."""
    declared = declared_numerics()
    if args.mode != "auto":
        return args.mode, declared
    return ("agreement" if declared else "exact"), declared


def judge(reference: dict, model: str, outputs: list[dict], mode: str, args: argparse.Namespace) -> dict:
    if reference["model"] != model:
        raise ProbeFailure(f"{args.reference}: recorded for model {reference['model']!r}, the server serves "
                           f"{model!r}; remove the file to record anew")
    expected = reference["outputs"]
    with_ids = all(o.get("token_ids") is not None for o in expected + outputs)
    if with_ids:
        cmp = compare([o["token_ids"] for o in expected], [o["token_ids"] for o in outputs], args.early_tokens)
        cmp["exact"] = cmp["exact"] and [o["text"] for o in expected] == [o["text"] for o in outputs]
    elif mode == "agreement":
        raise ProbeFailure("the server returned no token_ids (return_token_ids), which agreement mode compares")
    else:
        texts = [o["text"] for o in expected], [o["text"] for o in outputs]
        cmp = {"exact": texts[0] == texts[1], "differing_prompts": sum(a != b for a, b in zip(*texts))}
    cmp.update(mode=mode, compared="token_ids" if with_ids else "text")
    if mode == "exact":
        cmp["passed"] = cmp["exact"]
        if not cmp["passed"]:
            differ = sum(a != b for a, b in zip(expected, outputs))
            cmp["error"] = f"greedy outputs of {differ} of {len(expected)} prompts differ from the baseline's"
    else:
        cmp["passed"] = cmp["early_divergence_fraction"] <= args.max_early_fraction
        if not cmp["passed"]:
            cmp["error"] = (f"{cmp['early_divergence_fraction']:.0%} of prompts diverge from the baseline within "
                            f"{args.early_tokens} tokens (at most {args.max_early_fraction:.0%} allowed)")
    return cmp


def _popen(command: str) -> subprocess.Popen:
    return subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate()


def start_checks(command: str | None) -> subprocess.Popen | None:
    """The target's kernel check (``--check-command``), started; None when no command is given or it cannot start
    (``kernel_checks`` then tries again and says why)."""
    if not command:
        return None
    try:
        return _popen(command)
    except OSError:
        return None


def kernel_checks(command: str | None, started: subprocess.Popen | None = None) -> list[dict]:
    """The kernel check's result (``started`` if given, else run now): each entry of its result's ``checked``, or
    one entry for the whole; nothing when no command is given."""
    if not command:
        return []
    try:
        proc = started or _popen(command)
    except OSError as exc:
        return [{"passed": False, "error": f"cannot run the kernel check {command!r}: {exc}"}]
    try:
        out, err = proc.communicate(timeout=CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return [{"passed": False, "error": f"the kernel check timed out after {CHECK_TIMEOUT} s"}]
    lines = [line for line in out.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return [{"passed": False, "error": f"the kernel check exited {proc.returncode} without a JSON result: "
                                            f"{err.strip()[-500:]}"}]
    checked = result.get("checked") or []
    return checked if checked else [{"passed": bool(result.get("passed")) and proc.returncode == 0}]


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.probes.greedy", description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, required=True,
                   help="the baseline's completions (recorded there when absent and the baseline is probed)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--server-cmd", help="server command line; the literal {host} and {port} are filled in")
    src.add_argument("--base-url", help="an already running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds the server may take to answer /health with 200")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the server")
    p.add_argument("--server-log-dir", type=Path, help="keep the server's log in this folder")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--mode", choices=["auto", "exact", "agreement"], default="auto",
                   help=f"auto: agreement when ${NUMERICS_ENV} names a plugin, else exact")
    p.add_argument("--early-tokens", type=int, default=4,
                   help="agreement mode: a prompt differing within this many tokens diverges early")
    p.add_argument("--max-early-fraction", type=float, default=0.25,
                   help="agreement mode: the largest fraction of prompts that may diverge early")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths in tokens")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--token-id-range", type=int, nargs=2, default=list(TOKEN_RANGE), metavar=("LOW", "HIGH"))
    p.add_argument("--check-command", help="a command checking the kernels the server runs (its last stdout line: "
                   "JSON with `passed` and `checked`), run beside the completions of --base-url, after "
                   "those of a server of the probe's own")
    args = p.parse_args(argv)
    if min(args.lengths) < 1 or args.max_tokens < 1:
        p.error("--lengths and --max-tokens must be at least 1")
    if not 0 <= args.token_id_range[0] < args.token_id_range[1]:
        p.error("--token-id-range needs 0 <= LOW < HIGH")
    return args


def serve_and_generate(args: argparse.Namespace, prompts: list[list[int]],
                       passes: int) -> tuple[str, list[list[dict]], dict]:
    """(model, completions of each pass, facts about the server) from ``--base-url`` or a server of our own."""
    if args.base_url:
        url = args.base_url.rstrip("/")
        try:
            wait_healthy(url, args.startup_timeout)
        except ServerFailed as exc:
            raise ProbeFailure(str(exc), exc.reason) from None
        model, outputs = generate(url, args.model, prompts, args.max_tokens, args.request_timeout, passes)
        return model, outputs, {"base_url": url}
    server = LiveServer(shlex.split(args.server_cmd), stop_timeout=args.stop_timeout,
                        log_dir=args.server_log_dir, log_label=server_label("greedy"))
    try:
        server.start()
        server.wait_healthy(args.startup_timeout)
        model, outputs = generate(server.url, args.model, prompts, args.max_tokens, args.request_timeout, passes)
    except ServerFailed as exc:
        raise ProbeFailure(str(exc), exc.reason) from None
    except ProbeFailure as exc:
        if (code := server.exited()) is not None:
            raise ProbeFailure(f"{exc}; the server exited with code {code}; its last output:\n{server.tail()}",
                               "crashed") from None
        raise
    finally:
        server.stop()
    facts = {"server_stopped_by": server.stopped_by}
    if server.log_dir is not None:
        facts["server_log"] = str(server.log_path)
    return model, outputs, facts


def run(args: argparse.Namespace) -> dict:
    prompts = prompt_set(tuple(args.lengths), *args.token_id_range)
    reference = read_reference(args.reference, FORMAT) if args.reference.exists() else None
    if reference is None and not may_record():
        raise ProbeFailure(f"{args.reference} holds no reference; it is recorded when the baseline is probed "
                           f"(this is {os.environ.get('ORCHESTRATOR_PLUGIN')!r})")
    if reference is not None and (reference["prompts"], reference["max_tokens"]) != (prompts, args.max_tokens):
        raise ProbeFailure(f"{args.reference}: recorded with other prompts or max_tokens than this probe sends; "
                           "remove the file to record anew")
    mode, declared = mode_of(args)
    # the baseline is asked twice: exact comparison means something only where it reproduces itself
    # a running server's kernels are checked while it answers; ours first releases the card
    started = start_checks(args.check_command) if args.base_url else None
    try:
        model, passes, facts = serve_and_generate(args, prompts, 2 if reference is None else 1)
    except BaseException:
        if started is not None:
            _stop(started)
        raise
    outputs = passes[0]
    checks = kernel_checks(args.check_command, started)
    result: dict = {"model": model, "reference": str(args.reference), "prompts": len(prompts), **facts}
    if reference is None:
        deterministic = passes[0] == passes[1]
        write_reference(args.reference, {"format": FORMAT, "model": model, "max_tokens": args.max_tokens,
                                          "prompts": prompts, "outputs": outputs, "deterministic": deterministic})
        result.update(recorded=True, deterministic=deterministic, mode=mode, passed=True)
    else:
        if mode == "exact" and reference.get("deterministic") is False:
            mode = "agreement"
            result["note"] = "the baseline's outputs differed between two passes: judged by agreement"
        result.update(recorded=False, changes_numerics=declared, **judge(reference, model, outputs, mode, args))
    result["kernel_checks"] = checks
    bad = [c for c in checks if not c.get("passed")]
    if bad:
        names = ", ".join(f"{c.get('op', '?')}/{c.get('variant', '?')}" + (f" ({c['error']})" if c.get("error") else "")
                          for c in bad)
        result["passed"] = False
        result["error"] = "; ".join(filter(None, [result.get("error"), f"kernels.check failed: {names}"]))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = run(args)
    except ProbeFailure as exc:
        result = {"passed": False, "error": str(exc), **({"reason": exc.reason} if exc.reason else {})}
    except Terminated:
        print(json.dumps({"passed": False, "error": "terminated by SIGTERM; the server was stopped"}))
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    verdict = "passed" if result["passed"] else f"FAILED: {(str(result.get('error')) or '?').splitlines()[0]}"
    print(f"greedy probe: {verdict}", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
