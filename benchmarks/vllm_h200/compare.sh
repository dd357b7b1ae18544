#!/usr/bin/env bash
# The kept stack against vLLM's defaults on the issue's long workload, 200 requests of 1,000 random
# tokens in and 2,000 out, all in flight, with the serving probe (vllm bench serve's fields plus the
# seed's score); each config served by a fresh `vllm serve` started exactly as the staged run starts it.
# Started by `run.sh compare` (environment and PYTHONPATH set there); writes WORK/compare-*.json.
set -euo pipefail
WORK=$1
HERE=$(cd "$(dirname "$0")" && pwd)
serve_cmd() {  # the staged run's server command line, for another serve config
    python3 - "$HERE/orchestrator.yaml" "$1" <<'PY'
import shlex, sys
from pathlib import Path
from orchestrator.config import load
argv = load(Path(sys.argv[1])).target.serve_argv()
argv[argv.index("--config") + 1] = sys.argv[2]
print(shlex.join(argv))
PY
}
for name in defaults kept; do
    config=$WORK/defaults.yaml
    [[ $name == kept ]] && config=$WORK/serve/serve.yaml
    echo "== $name: $config"; cat "$config"
    python3 -m orchestrator.probes.serving --server-cmd "$(serve_cmd "$config")" --model qwen36 \
        --health-timeout 600 --stop-timeout 60 --server-log-dir "$WORK/compare-logs" \
        --num-prompts 200 --input-len 1000 --output-len 2000 --max-concurrency 200 \
        --shared-prefix-fraction 0 --seed 0 --request-timeout 1800 > "$WORK/compare-$name.out" || true
    tail -n 1 "$WORK/compare-$name.out" > "$WORK/compare-$name.json"
done
python3 - "$WORK" <<'PY'
import json, sys
from pathlib import Path
rows = []
for name in ("defaults", "kept"):
    r = json.loads((Path(sys.argv[1]) / f"compare-{name}.json").read_text())
    if "error" in r:
        print(f"{name}: {r['error'][:500]}")
        continue
    rows.append((name, r["score"], r["output_throughput"], r["total_token_throughput"], r["mean_tpot_ms"],
                 r["median_ttft_ms"], r["completed"], r["duration"]))
print("| serve config | score | output tok/s | total tok/s | mean TPOT ms | median TTFT ms | completed | duration s |")
print("|---|---|---|---|---|---|---|---|")
for row in rows:
    print("| {} | {:,.0f} | {:,.1f} | {:,.1f} | {:.1f} | {:,.0f} | {} | {:.1f} |".format(*row))
PY
