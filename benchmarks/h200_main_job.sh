#!/usr/bin/env bash
# The README's main job on one GPU machine reached by commands of at most 10 minutes:
#   bash benchmarks/h200_main_job.sh start [run args]   # installs the wheels, starts the run detached, then polls
#   bash benchmarks/h200_main_job.sh poll               # polls; send it again right after the last one returns
#   RESUME=.resume/state.tgz bash benchmarks/h200_main_job.sh start [run args]
#                                                       # continues a run cut short on an earlier machine
#   RESUME=.resume/state.tgz bash benchmarks/h200_main_job.sh calibrate --num-layers 4 --starts 10
#                                                       # an A/A calibration of the state a run left, then polls
#                                                       # (--arms coresident: one window after the other)
# Each call polls `orchestrator status` until the run ends or POLL_SECONDS pass (default 480, so that the call,
# the wheels' install included, ends well inside a command's 10 minutes: a command cut there returns no output).
# The status JSON, the log and the database are written to $OUT after every poll, and the report (Markdown and
# PNG) once the run has ended.
# The machine keeps /tmp only while it stays up, so the calls must follow each other without a pause.
# Every poll also returns the state folder (state.tgz: the history, the intent log and pre-images, the engine
# workspace). A machine lent for a limited time may go before the run ends: started again with RESUME naming that
# file (copied to .resume/, which git ignores, and carried: carry [".whl", ".resume"]), the state folder is put back
# where it was and the run that was cut short is continued (docs/orchestrator.md, "Continuing"), the calibration
# found recorded.
# The run works from a copy of the project in /tmp/proj: each command on such a machine re-copies the working tree,
# which would pull the code from under a run started inside it. Triton's kernels come back with each poll while the
# run goes (triton-engine.tgz, benchmarks/triton_cache.py; $OUT returns at most 8 files, which the finished run's
# fill): put it in .cache/jit and carry it, and the next machine's servers start without compiling them.
set -u
TREE=$(cd "$(dirname "$0")/.." && pwd)
ROOT=/tmp/proj
RUN=${RUN_DIR:-/tmp/main-job}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="$ROOT:/tmp/site" PYTHONUNBUFFERED=1
orch() { (cd "$RUN" && python3 -m orchestrator.cli "$@"); }
WHAT="orchestrator.cli [a-z]* --device cuda"
if [ "${1:-poll}" = start ] || [ "${1:-poll}" = calibrate ]; then
  if [ "$1" = start ]; then COMMAND=run; else COMMAND=calibrate; fi
  shift
  if pgrep -f "$WHAT" > /dev/null; then echo "a run is going: poll it"; exit 3; fi
  rm -rf "$ROOT" && cp -r "$TREE" "$ROOT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl || exit 9
  mkdir -p "$RUN"
  if [ -f "$TREE/.cache/jit/triton-engine.tgz" ]; then
    python3 "$TREE/benchmarks/triton_cache.py" unpack "$TREE/.cache/jit/triton-engine.tgz" "$HOME"
  fi
  if [ -n "${RESUME:-}" ]; then
    tar xzf "$TREE/$RESUME" -C "$RUN" || exit 8
    echo "resumed: the state folder of $RESUME"; orch status 2>&1 | tail -30
  fi
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
  # setsid forks when its caller leads a process group, so $! is not the run's pid: the run is found by its
  # command line (a second `start` while one runs is refused by the state folder's lock, and says so in its log)
  (cd "$RUN" && setsid nohup python3 -m orchestrator.cli $COMMAND --device cuda --preset qwen3.6-35b-a3b "$@" \
     >> "$RUN/run.log" 2>&1 < /dev/null &)
  sleep 2
  echo "started: orchestrator $COMMAND --device cuda --preset qwen3.6-35b-a3b $*"
fi
running() { pgrep -f "$WHAT" > /dev/null; }
deadline=$(( $(date +%s) + ${POLL_SECONDS:-480} ))
while running && [ "$(date +%s)" -lt "$deadline" ]; do sleep 10; done
orch status 2>&1 | tail -40
# What the run has decided so far comes back with every poll, so a run cut short still leaves its figures.
orch status --json > "$OUT/status.json" 2>/dev/null
cp "$RUN/run.log" "$OUT/"
python3 -c "import sqlite3,sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
  "$RUN/state/orchestrator.db" "$OUT/orchestrator.db" 2>/dev/null
# the state folder: the database as just copied (consistent), then the rest (an intent newer than it is recovered
# from the intent log; one older would lack its pre-image)
if [ -f "$OUT/orchestrator.db" ]; then
  rm -rf /tmp/state-copy && mkdir -p /tmp/state-copy
  (cd "$RUN" && tar cf - --exclude=state/server-logs --exclude=state/tmp --exclude='state/orchestrator.db*' state) \
    | tar xf - -C /tmp/state-copy && cp "$OUT/orchestrator.db" /tmp/state-copy/state/ \
    && tar czf "$OUT/state.tgz" -C /tmp/state-copy state
fi
# The servers' logs and the probes' stderr (the probe runner keeps them in temporary folders) come back too:
# a stalled sample is diagnosed from them.
tar czf "$OUT/logs.tgz" -C "$RUN/state" server-logs 2>/dev/null
find /tmp "$RUN" -maxdepth 4 -path '*proc-*' -name stderr 2>/dev/null | head -50 | tar czf "$OUT/probe-stderr.tgz" -T - 2>/dev/null
if running; then
  python3 "$TREE/benchmarks/triton_cache.py" pack "$HOME" "$OUT/triton-engine.tgz" --limit-mib 13
  echo "RUNNING: send the poll command again now"; exit 0
fi
echo "FINISHED"; tail -5 "$RUN/run.log"
orch report --out "$RUN/report" > /dev/null 2>&1 && cp "$RUN"/report/*.md "$RUN"/report/*.png "$OUT/" 2>/dev/null
ls -la "$OUT"
