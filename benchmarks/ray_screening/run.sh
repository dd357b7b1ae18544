#!/usr/bin/env bash
# The screening benchmark (README.md): one vLLM params search (max-num-batched-tokens, plugins/) staged on one GPU,
# then screened through Ray on two or four GPUs of the same host, and through Ray on one GPU; the wall times and
# the decisions of each. From the repository root:
#
#   bash benchmarks/ray_screening/run.sh wheels              # where pip works: Ray's wheels, split into parts
#   bash benchmarks/ray_screening/run.sh install DIR...      # on the GPU machine: the parts joined, Ray installed
#   bash benchmarks/ray_screening/run.sh start LABEL [opts]  # w1 | w2 | w4 | ray1 | duet2, detached
#   bash benchmarks/ray_screening/run.sh status LABEL        # poll: the status table, the log's tail
#   bash benchmarks/ray_screening/run.sh results             # wall time and decisions of every run, into $OUT
#
# Labels: w1 stages the search on one GPU without Ray; w2 and w4 screen it on two and four workers (a local Ray
# cluster, one GPU each: run them on nvidia-h200-x2 / -x4); ray1 screens it on one worker through Ray, the path the
# others take, on one GPU; duet2 screens it on two workers as a duet (policy.duet). VALUES="2048 4096 ..." replaces
# the searched values (default: plugins/batched-tokens-sweep). Needs vLLM in /tmp/site and the model folder
# /tmp/qwen36 (../shared/vllm-h200/serve.sh), the orchestrator's wheels (benchmarks/make_wheels.sh) and Ray's.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=$(cd "$HERE/../.." && pwd)
PROJ=/tmp/proj
SITE=/tmp/site
WORK=/tmp/ray-screening
PARTS=${PARTS:-$TREE/.whl-ray}   # Ray's wheel in parts: one travels per command (a call carries 64 MiB at most)

source "$TREE/benchmarks/vllm_machine.sh"
orch() { local label=$1; shift; python3 -m orchestrator.cli "$@" --config "$WORK/$label/orchestrator.yaml"; }

case ${1:-} in
    wheels)
        # Ray for the GPU image's Python 3.12, and what it needs that the image and the vLLM payload lack
        rm -rf "$PARTS" && mkdir -p "$PARTS/whl"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
            -d "$PARTS/whl" "ray==$(python3 -c 'import ray; print(ray.__version__)')" "msgpack>=1,<2"
        (cd "$PARTS" && tar -C whl -cf - . | split -b 45M -d -a 1 - part_ && sha256sum part_* > SHA256SUMS \
            && rm -rf whl && ls -la)
        ;;
    install)
        shift
        mkdir -p /tmp/ray-parts
        for dir in "$@"; do cp "$dir"/part_* "$dir"/SHA256SUMS /tmp/ray-parts/ 2>/dev/null || true; done
        (cd /tmp/ray-parts && sha256sum -c SHA256SUMS) || die "a part is missing or damaged: carry each in turn"
        rm -rf /tmp/ray-whl && mkdir -p /tmp/ray-whl && cat /tmp/ray-parts/part_* | tar -C /tmp/ray-whl -xf -
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" /tmp/ray-whl/*.whl
        python3 -c "import ray; print('ray', ray.__version__)"
        ;;
    start)
        label=${2:-}
        case $label in
            w1) workers=() ;;
            w2) workers=(--workers 2) ;;
            w4) workers=(--workers 4) ;;
            ray1) workers=(--workers 1 --ray-address local) ;;
            duet2) workers=(--workers 2) ;;
            *) die "start LABEL: one of w1 w2 w4 ray1 duet2" ;;
        esac
        shift 2
        for pid in "$WORK"/*/run.pid; do alive "$pid" && die "a run is going ($pid): poll it with 'run.sh status'"; done
        [[ -f $SITE/vllm/engine/arg_utils.py ]] || die "no vLLM in $SITE: run ../shared/vllm-h200/serve.sh first"
        [[ -f /tmp/qwen36/config.json ]] || die "no model folder /tmp/qwen36: run ../shared/vllm-h200/serve.sh first"
        stop_payload_server
        rm -rf "$PROJ" && cp -r "$TREE" "$PROJ"
        if [[ -n ${VALUES:-} ]]; then
            python3 - "$PROJ/benchmarks/ray_screening/plugins/batched-tokens-sweep/plugin.yaml" $VALUES <<'PY'
import sys, yaml
path, values = sys.argv[1], [int(v) for v in sys.argv[2:]]
manifest = yaml.safe_load(open(path))
manifest["params"]["max_num_batched_tokens"] = values
open(path, "w").write(yaml.safe_dump(manifest, sort_keys=False))
PY
        fi
        rm -rf "${WORK:?}/$label" && mkdir -p "$WORK/$label/serve"
        cp "$HERE/serve.yaml" "$WORK/$label/serve/serve.yaml"
        sed "s#/RUN/#/$label/#g" "$HERE/orchestrator.yaml" > "$WORK/$label/orchestrator.yaml"
        if [[ $label == duet2 ]]; then
            printf '  workers: 2\n  duet: true\n' >> "$WORK/$label/orchestrator.yaml"
            workers=()
        fi
        nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true
        python3 -c "import ray; print('ray', ray.__version__)" 2>/dev/null || [[ $label == w1 ]] \
            || die "Ray is not installed: run.sh install DIR (its parts from run.sh wheels)"
        date +%s > "$WORK/$label/started"
        (cd "$PROJ" && detach "$WORK/$label/run.pid" "$WORK/$label/run.log" \
            python3 -m orchestrator.cli run --config "$WORK/$label/orchestrator.yaml" "${workers[@]}" "$@")
        echo "$label: orchestrator run ${workers[*]} $* started (pid $(cat "$WORK/$label/run.pid")), log $WORK/$label/run.log"
        ;;
    status)
        label=${2:-}
        [[ -d $WORK/$label ]] || die "status LABEL: no run $label in $WORK"
        alive "$WORK/$label/run.pid" && echo "$label running (pid $(cat "$WORK/$label/run.pid"))" || echo "$label not running"
        orch "$label" status || true
        tail -n 15 "$WORK/$label/run.log" 2>/dev/null || true
        ;;
    results)
        out=${OUT:-$WORK/results}
        mkdir -p "$out"
        for dir in "$WORK"/*/; do
            label=$(basename "$dir")
            [[ -f $dir/orchestrator.yaml ]] || continue
            orch "$label" status --json > "$out/status-$label.json" 2>/dev/null || true
            orch "$label" status > "$out/status-$label.txt" 2>&1 || true
            orch "$label" report --out "$out/report-$label" > /dev/null 2>&1 || true
            cp "$dir/run.log" "$out/run-$label.log" 2>/dev/null || true
        done
        python3 "$HERE/compare.py" "$out" | tee "$out/ray-screening.md"
        ;;
    *)
        sed -n '2,17p' "$0"
        exit 2
        ;;
esac
