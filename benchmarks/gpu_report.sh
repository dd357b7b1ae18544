#!/usr/bin/env bash
# The engine's GPU report (python -m engine.gpu_report) on a machine reached by commands of at most 10 minutes:
#   bash benchmarks/gpu_report.sh start [report args]   # installs the wheels, starts the report detached, then polls
#   bash benchmarks/gpu_report.sh poll                  # polls; send it again right after the last one returns
# e.g. `start --sections checks,gdn,moe,engine,served,profile`: the engine and served sections start servers of
# all 40 layers, which takes the report past one command's 10 minutes. Each call waits until the report ends or
# POLL_SECONDS pass (default 480), then copies what it has printed (report.log) and, once it has ended, its JSON
# (gpu_report.json) into $OUT. The wheels (.whl/, benchmarks/make_wheels.sh; carry [".whl"]) are what the served
# section's server and client need beyond the GPU image; a vLLM already unpacked into /tmp/site
# (../shared/vllm-h200/serve.sh) stays importable, and the decode section then times vLLM's own Triton decode too.
# The report runs from a copy of the project in /tmp/gpu-report-proj: each command on such a machine re-copies the
# working tree, which would pull the code from under a job started inside it. Triton's kernels come back with the
# JSON (triton-engine.tgz, benchmarks/triton_cache.py): put it in .cache/jit and carry it, and the next machine's
# engine starts without compiling them.
set -u
TREE=$(cd "$(dirname "$0")/.." && pwd)
ROOT=/tmp/gpu-report-proj
RUN=${RUN_DIR:-/tmp/gpu-report}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHAT="engine.gpu_report"
running() { pgrep -f "$WHAT" > /dev/null; }
if [ "${1:-poll}" = start ]; then
  shift
  if running; then echo "a report is running: poll it"; exit 3; fi
  rm -rf "$ROOT" "$RUN" && cp -r "$TREE" "$ROOT" && mkdir -p "$RUN"
  if [ -f "$TREE/.cache/jit/triton-engine.tgz" ]; then
    python3 "$TREE/benchmarks/triton_cache.py" unpack "$TREE/.cache/jit/triton-engine.tgz" "$HOME"
  fi
  if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$ROOT"/.whl/*.whl \
      || echo "the wheels did not install: the served section will say what it misses, the others run"
  fi
  (cd "$ROOT" && PYTHONPATH="$ROOT:/tmp/site" PYTHONUNBUFFERED=1 OUT="$RUN" \
     setsid nohup python3 -m engine.gpu_report "$@" >> "$RUN/report.log" 2>&1 < /dev/null &)
  sleep 2
  echo "started: python -m engine.gpu_report $*"
fi
[ -f "$RUN/report.log" ] || { echo "no report has been started on this machine (it keeps /tmp only while it stays up)"; exit 4; }
deadline=$(( $(date +%s) + ${POLL_SECONDS:-480} ))
while running && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
cp "$RUN/report.log" "$OUT/" 2>/dev/null
if running; then tail -5 "$RUN/report.log"; echo "RUNNING: send the poll command again now"; exit 0; fi
cp "$RUN/gpu_report.json" "$OUT/" 2>/dev/null
python3 "$TREE/benchmarks/triton_cache.py" pack "$HOME" "$OUT/triton-engine.tgz" --limit-mib 13
echo "FINISHED"; sed -n '/^## Summary/,$p' "$RUN/report.log"
