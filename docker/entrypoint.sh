#!/usr/bin/env bash
# Container entry point: stage the shipped optimizations on this image's vLLM, then serve what was kept.
#
#   docker run --gpus all -v orchestrator-state:/var/lib/orchestrator -e MODEL=Qwen/Qwen3-30B-A3B IMAGE [vllm serve options]
#
# The state volume holds orchestrator.yaml, serve/serve.yaml (the `vllm serve --config` file plugins edit),
# the run history and the file snapshots; both configs are written on first start and may be edited.
# serve.yaml has a folder of its own because the folder of the serve config is a target root: one that
# held the state would be snapshotted, and restored, with the run history in it.
# ORCHESTRATOR_SKIP_RUN=1 serves the kept configuration without staging again.
set -euo pipefail

home=${ORCHESTRATOR_HOME:-/opt/orchestrator}
state=${ORCHESTRATOR_STATE:-/var/lib/orchestrator}
config=$state/orchestrator.yaml
serve=$state/serve/serve.yaml

die() { echo "entrypoint: $*" >&2; exit 2; }

if [[ -f $state/serve.yaml && ! -f $serve ]]; then
    die "$state/serve.yaml is where an earlier image kept the serve config, beside the state: move it to $serve" \
        "and set 'serve_config: serve/serve.yaml' in $config"
fi
if [[ ! -f $serve ]]; then
    [[ -n ${MODEL:-} ]] || die "no $serve yet: set MODEL (a Hugging Face id or a path) for the first start"
    mkdir -p "$state/serve"
    { echo "model: $MODEL"; cat "$home/docker/serve.yaml"; } > "$serve.tmp"
    mv "$serve.tmp" "$serve"
fi
grep -Eq '^model:[[:space:]]*[^[:space:]#]' "$serve" || die "$serve names no model: add a 'model:' line"
if [[ ! -f $config ]]; then
    # the first start's `vllm serve` arguments are also the staged servers' (their --host and --port are the probes')
    serve_args=$(python3 -c '
import json, sys
out, skip = [], False
for a in sys.argv[1:]:
    if skip:
        skip = False
    elif a in ("--host", "--port"):
        skip = True
    elif not a.startswith(("--host=", "--port=")):
        out.append(a)
print(json.dumps(out))' "$@")
    cat > "$config.tmp" <<YAML
# Written on first start; edit probes and policy here (docs/vllm.md).
# Each plugin is judged on live \`vllm serve\` servers of the candidate and the kept configuration: greedy
# outputs, then the seed's workload (128 requests of 1,000 tokens in flight, 200 out, 10 s of steady state a
# sample: the target's default). Where the image's vLLM has sleep mode the kept configuration's server sleeps
# while a candidate's is measured (sleep: auto), and the calibration says whether woken servers measure as
# they did.
target:
  kind: vllm
  serve_config: serve/serve.yaml
  serve_args: $serve_args
plugins: $home/optimizations
state: .
policy:
  # an A/A calibration first (three fresh servers, two pairs each), then every decision judged by an interval
  # that counts the start effects it found
  min_gain: 0.03
  repeats: 1
  min_pairs: 2
  max_pairs: 4
  calibrate: {starts: 3, pairs: 2}
YAML
    mv "$config.tmp" "$config"
fi

# Runs a command as a child so that a `docker stop` (SIGTERM to PID 1) reaches it and its cleanup.
child=
forward() {
    if [[ -n $child ]]; then
        kill -TERM "$child" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
    exit 143
}
trap forward TERM INT
run() { "$@" & child=$!; wait "$child"; }

if [[ ${ORCHESTRATOR_SKIP_RUN:-0} != 1 ]]; then
    status=0
    run orchestrator run --config "$config" || status=$?
    case $status in
        0) ;;
        2) die "orchestrator run rejected the configuration in $config (see above)" ;;
        *) echo "entrypoint: orchestrator run failed ($status); restoring the last kept state" >&2
           run orchestrator recover --config "$config" ;;
    esac
fi
trap - TERM INT
# with the serve environment the kept plugins wrote beside the serve config (serve-env.yaml), as staging served it
exec python3 -m orchestrator.targets.serve_env exec "$state/serve/serve-env.yaml" -- vllm serve --config "$serve" "$@"
