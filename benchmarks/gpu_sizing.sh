#!/usr/bin/env bash
# Sizes the engine's GPU workload for the staged run: server start, measured window and score of a few
# serve configs under two workloads, and the correctness probe's time, each under its own timeout.
# On the GPU machine, from the repository root, after benchmarks/make_wheels.sh's wheels are installed:
#   bash benchmarks/gpu_sizing.sh   (results under $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/sizing; rm -rf "$W"; mkdir -p "$W"
LAYERS=${LAYERS:-8}
mk() {  # name, extra sed expressions on the baseline
  mkdir -p "$W/$1"; sed -e "s/^model: tiny/model: qwen3.6-35b-a3b/" -e "s/^device: auto/device: cuda/" \
    -e "s/^max-model-len: 4096/max-model-len: 32768/" "${@:2}" engine/configs/baseline.yaml > "$W/$1/serve.yaml"
  echo "num-layers: $LAYERS" >> "$W/$1/serve.yaml"
}
mk base
mk seqs -e "s/^max-num-seqs: 1/max-num-seqs: 256/"
mk opt -e "s/^max-num-seqs: 1/max-num-seqs: 256/" -e "s/^max-num-batched-tokens: 8192/max-num-batched-tokens: 32768/" \
  -e "s/^attention-decode: v1/attention-decode: [v2_triton, v1]/" -e "s/^attention-decode-long: v1 .*/attention-decode-long: [v2_triton, v2]/" \
  -e "s/^attention-prefill: loop/attention-prefill: [triton, pregather]/" -e "s/^moe-dispatch: gather/moe-dispatch: [triton, sorted]/"
LONG="--num-prompts 16 --input-len 9000 --shared-prefix-fraction 0.9 --output-len 32 --max-concurrency 16"
probe() {  # label, timeout, config, workload...
  local t0=$(date +%s.%N)
  timeout "$2" python3 -m orchestrator.probes.serving --serve-config "$W/$3/serve.yaml" --health-timeout 300 "${@:4}" \
    > "$W/$1.json" 2> "$W/$1.err"
  local rc=$? t1=$(date +%s.%N)
  python3 - "$1" "$rc" "$t0" "$t1" "$W/$1.json" <<'PY'
import json, sys
label, rc, t0, t1, path = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
try:
    r = json.loads(open(path).read().strip().splitlines()[-1])
except Exception:
    r = {}
total = t1 - t0
print(f"{label:14s} rc={rc:3d} total={total:6.1f}s window={r.get('duration', 0):6.1f}s start+stop={total - r.get('duration', 0):5.1f}s "
      f"score={r.get('score', 0):9.1f} out_tok/s={r.get('output_throughput', 0):8.1f} err={str(r.get('error', ''))[:150]}", flush=True)
PY
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
probe opt-1 90 opt $LONG
probe opt-2 90 opt $LONG
probe seqs 90 seqs $LONG
probe base 60 base $LONG
t0=$(date +%s); timeout 150 python3 -m orchestrator.probes.engine_correct --reference "$W/ref.json" --config "$W/opt/serve.yaml" \
  > "$W/correct.json" 2> "$W/correct.err"; rc=$?
echo "correct rc=$rc $(( $(date +%s)-t0 ))s $(tail -c 700 "$W/correct.json")"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
tar -C "$W" -czf "$OUT/sizing.tgz" --exclude='*.yaml.tmp' .
