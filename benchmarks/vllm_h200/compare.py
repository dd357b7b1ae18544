"""The kept stack against vLLM's defaults on the seed's long workload, 200 requests of 1,000 random tokens in and
2,000 out, all in flight: each configuration served by fresh `vllm serve` starts (exactly as the staged run starts
its servers, without sleep mode), in pairs whose order alternates (D K, K D, D K, ...), each sample on a server of
its own, judged by the paired interval of the project's judge (every pair's two servers are fresh, so its log
ratio carries both start effects and the interval counts them). Started by `run.sh compare`:

    python3 compare.py ORCHESTRATOR_YAML WORK     # PAIRS (default 3; at least 2) pairs of starts

Writes WORK/compare-<config>-<pair>.json (the serving probe's result), WORK/compare.json (samples and decision)
and WORK/compare.md (the table).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from orchestrator import decide
from orchestrator.config import load

WORKLOAD = ["--num-prompts", "200", "--input-len", "1000", "--output-len", "2000", "--max-concurrency", "200",
            "--shared-prefix-fraction", "0", "--request-timeout", "1800"]


def sample(project, config: Path, work: Path, name: str, pair: int) -> dict:
    """One fresh server of `config` (the staged run's command line with another serve config, and the serve
    environment beside it: the kept stack's, none for the defaults), measured once."""
    argv = project.target.serve_argv()
    argv[argv.index("--config") + 1] = str(config)
    model = project.target.config.served_model_name
    out = work / f"compare-{name}-{pair}.json"
    proc = subprocess.run([sys.executable, "-m", "orchestrator.probes.serving", "--server-cmd", shlex.join(argv),
                           *(["--model", model] if model else []), "--health-timeout", "900", "--stop-timeout", "60",
                           "--server-log-dir", str(work / "compare-logs"), *WORKLOAD, "--seed", str(pair)],
                          env={**os.environ, **project.target.env(config)}, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:] or f"exit {proc.returncode}"}
    out.write_text(json.dumps(result))
    print(f"{name} #{pair}: " + (f"score {result['score']:,.0f}, output {result['output_throughput']:,.1f} tok/s"
                                 if "score" in result else f"failed: {str(result.get('error'))[:300]}"), flush=True)
    return result


def main(argv: list[str]) -> int:
    project = load(Path(argv[0]))
    work = Path(argv[1])
    pairs = max(2, int(os.environ.get("PAIRS", "3")))
    configs = {"defaults": work / "defaults.yaml", "kept": Path(project.target.serve_config)}
    samples: dict[str, list[dict]] = {"defaults": [], "kept": []}
    for pair in range(pairs):
        for name in (("defaults", "kept") if pair % 2 == 0 else ("kept", "defaults")):
            samples[name].append(sample(project, configs[name], work, name, pair))
    if any("score" not in s for arm in samples.values() for s in arm):
        print("a sample failed: no decision")
        return 1
    policy = project.policy.model_copy(update=dict(interleave=True, rule="stat", min_pairs=2, max_pairs=pairs))
    d = decide.Judge(policy).decide([s["score"] for s in samples["defaults"]], [s["score"] for s in samples["kept"]],
                                    final=True)
    (work / "compare.json").write_text(json.dumps({"samples": samples, "decision": d.to_dict()}))
    rows = ["| serve config | start | score | output tok/s | total tok/s | mean TPOT ms | median TTFT ms "
            "| duration s |", "|---|---|---|---|---|---|---|---|"]
    for name, arm in samples.items():
        rows += [f"| {name} | {i + 1} | {s['score']:,.0f} | {s['output_throughput']:,.1f} | "
                 f"{s['total_token_throughput']:,.1f} | {s['mean_tpot_ms']:.1f} | {s['median_ttft_ms']:,.0f} | "
                 f"{s['duration']:.1f} |" for i, s in enumerate(arm)]
    verdict = (f"kept stack against vLLM's defaults on the score: {d.gain:+.1%} "
               f"[{d.ci_low:+.1%}, {d.ci_high:+.1%}] ({d.confidence:.0%} interval, {pairs} pairs of fresh servers); "
               f"{d.verdict} at the bar of {d.min_gain:+.1%}")
    (work / "compare.md").write_text("\n".join(rows + ["", verdict]) + "\n")
    print("\n".join(rows + ["", verdict]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
