#!/usr/bin/env bash
# The staged run of the shipped vLLM plugins on one H200 (README.md). On the GPU machine, from the
# repository root (with .whl/ from benchmarks/make_wheels.sh), after ../shared/vllm-h200/serve.sh has
# unpacked vLLM 0.34.0 into /tmp/site and written the model folder /tmp/qwen36:
#
#   bash benchmarks/vllm_h200/run.sh stage [orchestrator run options]  # starts `orchestrator run` detached
#   bash benchmarks/vllm_h200/run.sh status                             # poll: the status table, the log's tail
#   bash benchmarks/vllm_h200/run.sh compare                            # after it: kept stack vs vLLM defaults
#   bash benchmarks/vllm_h200/run.sh results                            # status --json and the figures into $OUT
#
# Each command returns within seconds; `stage` and `compare` leave their work running detached (logs in
# /tmp/h200-run) so that the machine's per-command limit does not cut them short.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SITE=/tmp/site          # vLLM 0.34.0 and what it needs (serve.sh unpacks it); the orchestrator's wheels join it
WORK=/tmp/h200-run      # serve config, state, logs (paths in orchestrator.yaml)
CONFIG=$HERE/orchestrator.yaml

# One folder for both: the wheels the payload also carries have the payload's versions
# (benchmarks/make_wheels.sh), so installing them there replaces nothing vLLM was tested with.
export PYTHONPATH="$REPO:$SITE"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a
export PATH="$(dirname "$(command -v python3)"):$PATH"
if [[ -z ${CUDA_HOME:-} ]] && command -v nvcc >/dev/null; then
    CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
    export CUDA_HOME
fi

die() { echo "run.sh: $*" >&2; exit 2; }
orch() { python3 -m orchestrator.cli "$@" --config "$CONFIG"; }
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The payload's own server (serve.sh starts one on port 8000) holds 90 % of the card: stop its group.
stop_payload_server() {
    alive /tmp/serve.pid || return 0
    local pid
    pid=$(cat /tmp/serve.pid)
    echo "stopping the payload's server (pid $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    sleep 5
}

setup() {
    [[ -f $SITE/vllm/engine/arg_utils.py ]] || die "no vLLM in $SITE: run ../shared/vllm-h200/serve.sh first"
    [[ -f /tmp/qwen36/config.json ]] || die "no model folder /tmp/qwen36: run ../shared/vllm-h200/serve.sh first"
    if [[ ! -f $WORK/.wheels-installed ]]; then
        compgen -G "$REPO/.whl/*.whl" >/dev/null || die "no $REPO/.whl: run benchmarks/make_wheels.sh where pip works"
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$REPO"/.whl/*.whl
        mkdir -p "$WORK" && touch "$WORK/.wheels-installed"
    fi
    python3 -c "import orchestrator.cli, sqlite_utils, ruamel.yaml, pydantic, fastapi, torch
print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'pydantic', pydantic.VERSION,
      'fastapi', fastapi.__version__, 'cuda', torch.cuda.is_available())"
    python3 -m orchestrator.targets.vllm_options --package "$SITE/vllm" has max-num-seqs
    mkdir -p "$WORK/serve"
    [[ -f $WORK/serve/serve.yaml ]] || cp "$HERE/serve.yaml" "$WORK/serve/serve.yaml"
    stop_payload_server
}

case ${1:-} in
    stage)
        shift
        alive "$WORK/run.pid" && die "a run is going (pid $(cat "$WORK/run.pid")): poll with 'run.sh status'"
        setup
        orch plugins list
        setsid nohup python3 -m orchestrator.cli run --config "$CONFIG" "$@" > "$WORK/run.log" 2>&1 < /dev/null &
        echo $! > "$WORK/run.pid"
        echo "orchestrator run started (pid $(cat "$WORK/run.pid")), log $WORK/run.log"
        ;;
    status)
        alive "$WORK/run.pid" && echo "running (pid $(cat "$WORK/run.pid"))" || echo "not running"
        orch status || true
        tail -n 15 "$WORK/run.log" 2>/dev/null || true
        ls -t "$WORK/state/server-logs" 2>/dev/null | head -3 | while read -r f; do
            echo "== $f"; tail -n 5 "$WORK/state/server-logs/$f"; done
        ;;
    compare)
        alive "$WORK/run.pid" && die "the staged run is still going"
        alive "$WORK/compare.pid" && die "a comparison is going (pid $(cat "$WORK/compare.pid"))"
        setup
        cp "$HERE/defaults.yaml" "$WORK/defaults.yaml"
        setsid nohup bash "$HERE/compare.sh" "$WORK" > "$WORK/compare.log" 2>&1 < /dev/null &
        echo $! > "$WORK/compare.pid"
        echo "comparison started (pid $(cat "$WORK/compare.pid")), log $WORK/compare.log"
        ;;
    results)
        out=${OUT:-$WORK/results}
        mkdir -p "$out"
        orch status --json > "$out/status.json" || true
        orch status > "$out/status.txt" 2>&1 || true
        orch report --out "$out/report" > /dev/null 2>&1 || true
        cp "$WORK"/run.log "$WORK"/compare.log "$WORK"/compare-*.json "$out/" 2>/dev/null || true
        cp "$WORK/serve/serve.yaml" "$out/kept-serve.yaml"
        cat "$out/status.txt" "$out/kept-serve.yaml"
        tail -n 8 "$WORK/compare.log" 2>/dev/null || true
        ;;
    *)
        sed -n '2,13p' "$0"
        exit 2
        ;;
esac
