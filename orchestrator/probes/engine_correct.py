"""Engine correctness probe: a candidate serve config must reproduce the greedy completions of a
fixed prompt set, and every kernel variant it runs must pass ``kernels.check``.

    python -m orchestrator.probes.engine_correct --reference state/engine-reference.json \\
        [--config $ORCHESTRATOR_TARGET_ROOT/serve.yaml]

The reference completions are recorded on the first run, from the same model with every kernel
key set to the float64 ``reference`` variant, so they are right whichever config first asks for
them; later runs compare against the stored file. Float32 on the reference's device must match
exactly on the CPU, unless a plugin of the state declares that it changes numerics (``changes_numerics``,
named in ORCHESTRATOR_CHANGES_NUMERICS: a 16-bit recurrent state), which is judged by agreement.
Elsewhere kernels round differently and a random model has near-ties, so
there a prompt "diverges early" when it differs within its first ``--early-tokens`` tokens, and
the probe fails when more than ``--max-early-fraction`` of the prompts do: a wrong kernel makes
every prompt it touches diverge at once (see docs/serving.md for the measurements).

``--compare-dtype float32`` runs the prompt set in float32 whatever the deployment's dtype: in
bfloat16 on an H200 correct kernels already made 4 of the 14 prompts diverge early on the hybrid
model, as many as a wrong kernel does, while the kernels' own bfloat16 rounding is what
``kernels.check`` judges against float64 (in the deployment's dtype).

The last stdout line is one JSON object with ``passed`` (probe protocol); exit 1 when not passed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from engine.config import KERNEL_KEYS, ConfigError, EngineConfig, key_ops, load_config
from orchestrator.plugin import declared_numerics
from orchestrator.probes.reference import ProbeFailure, compare, read_reference, write_reference

FORMAT = 1
# Short prompts decode on attention-decode; long ones cross v2's 512-token partitions and the
# 16-token blocks, where size-dependent kernel bugs live.
SHORT_LENGTHS = (1, 7, 16, 17, 33, 64, 150, 300)
LONG_LENGTHS = (601, 640, 700, 730, 777, 800)
MAX_TOKENS = 24
LONG_SPLIT = 512  # decode-long-threshold that sends exactly the long prompts to attention-decode-long
CHECK_TIMEOUT = 900


def prompt_set(seed: int = 20240611) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in SHORT_LENGTHS + LONG_LENGTHS]


def fit(config: EngineConfig, prompts: list[list[int]], max_tokens: int, **update) -> EngineConfig:
    """``config`` with ``update`` applied and a max-model-len long enough for the prompt set."""
    need = max(map(len, prompts)) + max_tokens
    if need > config.hf.max_position_embeddings:
        raise ProbeFailure(f"the prompt set needs {need} positions, the model has "
                           f"{config.hf.max_position_embeddings}")
    return config.updated(**{"max_model_len": max(config.max_model_len, need), **update})


def identity(config: EngineConfig) -> dict:
    """What must match for two runs to be comparable: the same weights, dtype and device."""
    return {"model": config.model, "num_layers": config.hf.num_layers, "seed": config.seed,
            "dtype": str(config.torch_dtype()).removeprefix("torch."),
            "device": config.torch_device().type}


def record(config: EngineConfig, path: Path) -> dict:
    """Generates the reference with every kernel on its float64 reference variant; writes
    ``path`` atomically, so a failure leaves no partial file."""
    prompts = prompt_set()
    # float64 attention materialises whole score matrices: batches no longer than the longest
    # prompt keep the reference engine's profiling prefill small on any deployment's settings
    need = max(map(len, prompts)) + MAX_TOKENS
    ref_config = fit(config, prompts, MAX_TOKENS, max_model_len=need, max_num_batched_tokens=need,
                     **{key.replace("-", "_"): "reference" for key in KERNEL_KEYS})
    reference = {"format": FORMAT, **identity(config), "max_tokens": MAX_TOKENS,
                 "prompts": prompts, "outputs": generate(ref_config, prompts, MAX_TOKENS)[0]}
    write_reference(path, reference)
    return reference


def generate(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    """Greedy completions and the kernels chosen, from an engine that is freed before this returns:
    at most one engine holds the card at a time, whatever the probe does next. (The engine is imported here:
    the check of a live server, ``--served``, runs no engine and need not import torch.)"""
    from engine.llm import LLM

    with LLM(config) as llm:
        return llm.generate(prompts, max_tokens), dict(llm.kernel_choice)


def kernels_digest() -> str:
    """Hash of the kernel library's source: a check passed by the same code on the same device
    and dtype need not run again for every candidate of a run."""
    import hashlib

    import kernels

    h = hashlib.sha256()
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


class KernelChecks:
    """``python -m kernels.check`` for each distinct (op, variant) the engine ran, in parallel
    processes, started only once no engine of this probe holds the device (each check then has the
    card's memory to itself and the engine's KV cache reservation cannot starve it).

    Passed checks are remembered in ``cache`` under the kernels' source digest, device, dtype and
    shape list; a failed one runs again next time."""

    def __init__(self, device: str, dtype: str, mode: str, cache: Path | None = None):
        self.device, self.dtype = device, dtype
        self.small = mode == "small" or (mode == "auto" and self.device == "cpu")
        self.cache = cache

    @classmethod
    def of(cls, config: EngineConfig, mode: str, cache: Path | None = None) -> "KernelChecks":
        return cls(config.torch_device().type, str(config.torch_dtype()).removeprefix("torch."), mode, cache)

    def _key(self, digest: str, op: str, variant: str) -> str:
        return f"{digest}/{self.device}/{self.dtype}/{'small' if self.small else 'full'}/{op}/{variant}"

    def _load_cache(self) -> dict:
        try:
            data = json.loads(self.cache.read_text()) if self.cache else {}
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _save_cache(self, data: dict) -> None:
        tmp = self.cache.with_name(f".{self.cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, self.cache)

    def run(self, choice: dict[str, str]) -> list[dict]:
        wanted = sorted({(op, v) for k, v in choice.items() if v != "reference" for op in key_ops(k)})
        digest = kernels_digest() if self.cache else ""
        cached = self._load_cache()
        results: dict[tuple[str, str], dict] = {}
        procs: dict[tuple[str, str], subprocess.Popen] = {}
        try:
            for op, variant in wanted:
                if (hit := cached.get(self._key(digest, op, variant))) is not None:
                    results[op, variant] = {**hit, "cached": True}
                    continue
                argv = [sys.executable, "-m", "kernels.check", "--op", op, "--variant", variant,
                        "--device", self.device, "--dtype", self.dtype, *(["--small"] if self.small else [])]
                procs[op, variant] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True)
            for (op, variant), proc in procs.items():
                results[op, variant] = self._result(op, variant, proc)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        fresh = {self._key(digest, op, variant): r for (op, variant), r in results.items()
                 if r["passed"] and not r.get("cached")}
        if self.cache and fresh:
            self._save_cache({**self._load_cache(), **fresh})
        return [results[k] for k in wanted]

    @staticmethod
    def _result(op: str, variant: str, proc: subprocess.Popen) -> dict:
        try:
            out, err = proc.communicate(timeout=CHECK_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"op": op, "variant": variant, "passed": False,
                    "error": f"kernels.check timed out after {CHECK_TIMEOUT} s"}
        lines = [line for line in out.splitlines() if line.strip()]
        try:
            result = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            result = {"error": f"kernels.check exited {proc.returncode} without a JSON result: "
                               f"{err.strip()[-500:]}"}
        result.update(op=op, variant=variant, passed=bool(result.get("passed")) and proc.returncode == 0)
        return result


def judge(reference: dict, config: EngineConfig, args: argparse.Namespace,
          checked: EngineConfig | None = None) -> dict:
    """Greedy completions of ``config`` against the reference; kernel checks in ``checked``'s dtype
    (the deployment's, default ``config``'s)."""
    mine = identity(config)
    for key in ("model", "num_layers", "seed"):
        if reference.get(key) != mine[key]:
            raise ProbeFailure(f"{args.reference}: recorded for {key} {reference.get(key)!r}, the "
                               f"candidate has {mine[key]!r}; remove the file to record anew")
    declared = declared_numerics()
    exact = (reference["dtype"] == mine["dtype"] == "float32" and reference["device"] == mine["device"] == "cpu"
             and not declared)
    prompts, max_tokens = reference["prompts"], reference["max_tokens"]
    # Pass "as configured" is the deployment itself; when its decode-long-threshold sends no
    # prompt to attention-decode-long, a second pass at LONG_SPLIT runs that kernel end to end too.
    passes = {"as_configured": fit(config, prompts, max_tokens)}
    if config.decode_long_threshold >= max(map(len, prompts)) + max_tokens:
        passes["long_decode"] = fit(config, prompts, max_tokens, decode_long_threshold=LONG_SPLIT)
    result: dict = {"mode": "exact" if exact else "agreement", "changes_numerics": declared, "passes": {}}
    choice: dict[str, str] = {}
    for name, cfg in passes.items():
        try:
            outputs, chosen = generate(cfg, prompts, max_tokens)
        except ConfigError:
            raise
        except Exception as exc:  # a crashing kernel is an incorrect candidate, not a probe bug
            raise ProbeFailure(f"{name}: the engine failed: {type(exc).__name__}: {exc}") from None
        choice.update(chosen)
        cmp = compare(reference["outputs"], outputs, args.early_tokens)
        cmp["passed"] = cmp["exact"] if exact else cmp["early_divergence_fraction"] <= args.max_early_fraction
        result["passes"][name] = cmp
    result["kernels"] = choice
    cache = None if args.no_check_cache else args.reference.with_name("engine-kernel-checks.json")
    result["kernel_checks"] = ([] if args.kernel_checks == "none"
                               else KernelChecks.of(checked or config, args.kernel_checks, cache).run(choice))
    failed = _failures(result, exact, args)
    result["passed"] = not failed
    if failed:
        result["error"] = "; ".join(failed)
    return result


def _failures(result: dict, exact: bool, args: argparse.Namespace) -> list[str]:
    failed = [f"{name}: " + ("outputs differ from the reference" if exact else
                             f"{p['early_divergence_fraction']:.0%} of prompts diverge within "
                             f"{args.early_tokens} tokens (at most {args.max_early_fraction:.0%} allowed)")
              for name, p in result["passes"].items() if not p["passed"]]
    return failed + [f"kernels.check {c['op']}/{c['variant']} failed"
                     + (f": {c['error']}" if c.get("error") else "")
                     for c in result["kernel_checks"] if not c["passed"]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.probes.engine_correct",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, required=True,
                   help="stored reference completions (recorded there when absent); with --served, where the "
                        "passed kernel checks are remembered")
    p.add_argument("--served", metavar="URL",
                   help="only check the kernels a running engine server reports in /v1/models (its device and "
                        "dtype), printing {passed, checked}: the live greedy probe's --check-command")
    p.add_argument("--config", help="candidate serve config (default: $ORCHESTRATOR_TARGET_ROOT/serve.yaml)")
    p.add_argument("--early-tokens", type=int, default=4,
                   help="outside exact mode: a prompt differing within this many tokens diverges early")
    p.add_argument("--max-early-fraction", type=float, default=0.25,
                   help="outside exact mode: the largest fraction of prompts that may diverge early")
    p.add_argument("--compare-dtype", choices=["float32", "float16", "bfloat16"],
                   help="run the prompt set (and record the reference) in this dtype instead of the config's; "
                        "kernel checks keep the config's dtype")
    p.add_argument("--kernel-checks", choices=["auto", "full", "small", "none"], default="auto",
                   help="shape list for kernels.check of each kernel the engine runs; auto: full on "
                        "CUDA, small on CPU (the full list takes minutes there)")
    p.add_argument("--no-check-cache", action="store_true",
                   help="run every kernel check, even one passed before by the same kernel source on the "
                        "same device and dtype (remembered beside --reference)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    config_path = args.config
    if config_path is None:
        root = os.environ.get("ORCHESTRATOR_TARGET_ROOT")
        if not root:
            raise ProbeFailure("no serve config: pass --config or set ORCHESTRATOR_TARGET_ROOT")
        config_path = str(Path(root) / "serve.yaml")
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise ProbeFailure(str(exc)) from None
    compared = config.updated(dtype=args.compare_dtype) if args.compare_dtype else config
    recorded = not args.reference.exists()
    reference = record(compared, args.reference) if recorded else read_reference(args.reference, FORMAT, (("dtype", str), ("device", str)))
    return {**judge(reference, compared, args, checked=config), "recorded": recorded,
            "reference": str(args.reference)}


def served(args: argparse.Namespace) -> dict:
    """The kernel checks of what the engine server at ``args.served`` runs."""
    import httpx

    try:
        resp = httpx.get(f"{args.served.rstrip('/')}/v1/models", timeout=30)
        info = resp.json()["data"][0]["engine"]
        choice, device, dtype = dict(info["kernels"]), info["device"], info["dtype"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ProbeFailure(f"{args.served}/v1/models names no engine kernels: {exc}") from None
    cache = None if args.no_check_cache else args.reference.with_name("engine-kernel-checks.json")
    checked = [] if args.kernel_checks == "none" else KernelChecks(device, dtype, args.kernel_checks, cache).run(choice)
    failed = [f"kernels.check {c['op']}/{c['variant']} failed" + (f": {c['error']}" if c.get("error") else "")
              for c in checked if not c["passed"]]
    return {"passed": not failed, "checked": checked, "kernels": choice,
            **({"error": "; ".join(failed)} if failed else {})}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = served(args) if args.served else run(args)
    except (ProbeFailure, ConfigError) as exc:
        result = {"passed": False, "error": str(exc)}
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
