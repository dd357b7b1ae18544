#!/usr/bin/env bash
# The staged run of the shipped vLLM plugins on one H200 (README.md). On the GPU machine, from the
# repository root (with .whl/ from benchmarks/make_wheels.sh), once `receive` (or ../shared/vllm-h200/serve.sh)
# has unpacked vLLM 0.34.0 into /tmp/site and written the model folder /tmp/qwen36:
#
#   bash benchmarks/vllm_h200/run.sh parts                      # here, after build_payload.sh: the payload in 4 parts
#   bash benchmarks/vllm_h200/run.sh receive N                  # there, one call per part: the last unpacks vLLM
#                                                               # (LAYERS=20 with the last: a model of 20 layers,
#                                                               # which an H100 holds with 128 sequences' state)
#   bash benchmarks/vllm_h200/run.sh stage PART [run options]  # starts `orchestrator run --only` a part, detached
#   [OUT=$OUT] bash benchmarks/vllm_h200/run.sh status          # poll: the status table, the latest samples
#                                                               # (samples.py: their warm-ups), the log's tail;
#                                                               # with OUT=, what `results` gives less the report
#   bash benchmarks/vllm_h200/run.sh compare                    # the kept stack against vLLM's defaults
#   bash benchmarks/vllm_h200/run.sh cotenant                   # one server alone, beside a sleeping one, alone
#   [OUT=$OUT] bash benchmarks/vllm_h200/run.sh profile [SECONDS] # py-spy of the serving engine core: shares
#   bash benchmarks/vllm_h200/run.sh results                    # results.tgz (status, report, history),
#                                                               # jit-cache.tgz and triton-cache.tgz into $OUT
#   bash benchmarks/vllm_h200/run.sh unpack NAME FILES_AT       # here: into results/NAME, the cache into .cache/jit
#
# A part (PARTS below) fits about 20 minutes of the H200 (orchestrator.yaml gives the cost split); each starts
# from the serve config the part before kept: FROM=kept-serve.yaml (a part's `results`) to continue from one. The
# first part calibrates the first state it keeps; a part started FROM a kept stack calibrates that stack first,
# unless STATE=results/state brings the history of the part before (its calibration holds: same fingerprint).
# Each command returns within seconds; `stage` and `compare` leave their work running detached from a copy of
# the project in /tmp/proj (each command on such a machine re-copies the working tree, which would pull the code
# from under a job started inside it; logs in /tmp/h200-run).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=$(cd "$HERE/../.." && pwd)
PROJ=/tmp/proj          # the copy detached jobs run from
SITE=/tmp/site          # vLLM 0.34.0 and what it needs (serve.sh unpacks it); the orchestrator's wheels join it
WORK=${H200_WORK:-/tmp/h200-run}  # serve config, state, logs (paths in orchestrator.yaml; another only for tests)
CONFIG=$PROJ/benchmarks/vllm_h200/orchestrator.yaml

# The plugins that can change what this model serves at 128 requests in flight, three or four variants a part.
# Not staged: max-num-seqs-search (512 and 1,024 sequences; no decode batch passes the 128 in flight),
# gpu-memory-095 (the KV cache already holds several times the 128 x 1,200 tokens in flight), prefix-caching (the
# workload shares no prefix, and vLLM caches none for a hybrid model's state), and every plugin that patches
# source (0.34.0 lacks their anchors: not_applicable). Decided on one H100 (results/*-part2e): prefill-cudagraph-
# tokens kept (8,192 tokens), torch-compile regressed (0.34.0 compiles nothing of this model and falls back to
# decode-only graphs), and with it fusion-qk-norm-rope, a pass of the compilation this model does not get, is
# dropped. moe-backend has a part of its own: its first start builds FlashInfer's fused_moe_90, more than
# 9 minutes on an H100 machine's 16 cores (three leases ended inside the build), so it is staged only where a
# lease can give it 20 minutes. A part that calibrates (no STATE=) fits three.
declare -A PARTS=(
    [1]="max-num-seqs-256,max-batched-tokens-32k"
    [2]="prefill-cudagraph-tokens,torch-compile"
    [3]="ssm-state-bf16,api-server-count,stream-interval"
    [4]="quantization-fp8,kv-cache-fp8,max-batched-tokens-search,async-scheduling"
    [5]="moe-backend"
)

# The payload (../shared/vllm-h200/build_payload.sh) in parts small enough that one travels per call beside the
# project's tree (a call carries 64 MiB in all): carry .cache/vllm-payload/pN with `receive N`, and .whl with the last.
PAYLOAD=${H200_PAYLOAD:-$TREE/.cache/vllm-payload}
JIT=${H200_JIT:-$TREE/.cache/jit}  # the JIT cache a `results` brought back (carry it with `receive`)
RESULTS=${H200_RESULTS:-$HERE/results}
STAGE=${H200_STAGE:-/tmp/stage}  # where the parts gather
PAYLOAD_XZ=${PAYLOAD_XZ:-/tmp/vllm-h200/site312_slim.tar.xz}
PAYLOAD_PARTS=4
START_LINES=400  # of each server log that `results` brings back: its start, with no request lines

source "$TREE/benchmarks/vllm_machine.sh"
orch() { python3 -m orchestrator.cli "$@" --config "$CONFIG"; }

# The kernels a first server start compiles, so that the next machine's first start compiles none: FlashInfer's
# (its norm kernel: 2-3 minutes of a 30-minute lease) in jit-cache.tgz, and Triton's (the model's kernels: about a
# minute of the memory-profiling run) without their intermediate forms in triton-cache.tgz beside it, each within
# 13 MiB so that it travels with a payload part (carry .cache/jit/jit-cache.tgz with p0, .cache/jit/triton-cache.tgz
# with p1: a call carries 64 MiB), both into the folder $1; `receive` restores them
jit_caches() {
    local out=$1/jit-cache.tgz
    if [[ -d $HOME/.cache/flashinfer ]]; then
        du -sh "$HOME/.cache/flashinfer"
        tar -czf "$out" -C "$HOME" .cache/flashinfer
        (($(stat -c %s "$out") <= 13 * 1024 * 1024)) || { echo "FlashInfer's cache over 13 MiB: not brought back"; rm -f "$out"; }
    fi
    python3 "$TREE/benchmarks/triton_cache.py" pack "$HOME" "$1/triton-cache.tgz" --limit-mib 13
}

# results.tgz in $1: status, logs, the kept serve.yaml and the history (with the report where $2 says so)
pack() {
    local out=$1 pack=$WORK/pack
    rm -rf "$pack" && mkdir -p "$pack" "$out"
    orch status --json > "$pack/status.json" 2>/dev/null || true
    orch status > "$pack/status.txt" 2>&1 || true
    [[ ${2:-} == report ]] && { orch report --out "$pack/report" > /dev/null 2>&1 || true; }
    cp "$WORK"/run.log "$WORK"/compare.log "$WORK"/compare*.json "$WORK"/compare.md "$WORK"/cotenant.{log,json} \
        "$pack/" 2>/dev/null || true
    # the serve config: the kept stack only where no run is going; mid-run it may hold the change of the step
    # being measured (STATE= with FROM=serve-now.yaml continues, and the next run rolls that step back first),
    # so it gets a name that `compare` and `cotenant` are not given by mistake
    local serve=kept-serve.yaml
    alive "$WORK/run.pid" && serve=serve-now.yaml
    cp "$WORK/serve/serve.yaml" "$pack/$serve" 2>/dev/null || true
    # and the serve environment beside it (serve-env.yaml, where a kept plugin wrote one), named after it
    cp "$WORK/serve/serve-env.yaml" "$pack/${serve%.yaml}-env.yaml" 2>/dev/null || true
    # the history, every sample's metrics in it (through SQLite's backup: a copy of the file alone would lack
    # what its WAL holds), and the file images its steps recorded: STATE= gives it to the next part
    if [[ -f $WORK/state/orchestrator.db ]]; then
        mkdir -p "$pack/state"
        python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
            "$WORK/state/orchestrator.db" "$pack/state/orchestrator.db" || true
        cp -r "$WORK/state/blobs" "$WORK/state/intents.jsonl" "$pack/state/" 2>/dev/null || true  # not the lock
    fi
    cp /tmp/qwen36/config.json "$pack/model-config.json" 2>/dev/null || true
    # each server's start as it logged it (what a slow start spent its time on), without the per-request lines
    local log
    for log in "$WORK"/state/server-logs/*.log; do
        [[ -f $log ]] || continue
        mkdir -p "$pack/server-starts"
        grep -v -E '"(POST|GET) /' "$log" | head -n "$START_LINES" > "$pack/server-starts/${log##*/}" || true
    done
    tar -czf "$out/results.tgz" -C "$pack" .
}

setup() {
    [[ -f $SITE/vllm/engine/arg_utils.py ]] || die "no vLLM in $SITE: run ../shared/vllm-h200/serve.sh first"
    [[ -f /tmp/qwen36/config.json ]] || die "no model folder /tmp/qwen36: run ../shared/vllm-h200/serve.sh first"
    rm -rf "$PROJ" && cp -r "$TREE" "$PROJ"
    if [[ ! -f $WORK/.wheels-installed ]]; then
        compgen -G "$PROJ/.whl/*.whl" >/dev/null || die "no .whl: run benchmarks/make_wheels.sh where pip works"
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$PROJ"/.whl/*.whl
        mkdir -p "$WORK" && touch "$WORK/.wheels-installed"
    fi
    python3 -c "import orchestrator.cli, sqlite_utils, ruamel.yaml, pydantic, fastapi, torch
print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'pydantic', pydantic.VERSION,
      'fastapi', fastapi.__version__, 'cuda', torch.cuda.is_available())"
    python3 -m orchestrator.targets.vllm_options --package "$SITE/vllm" has max-num-seqs enable-sleep-mode
    mkdir -p "$WORK/serve"
    stop_payload_server
}

# from_serve FILE: the serve config FILE (a part's kept-serve.yaml or serve-now.yaml) into $WORK/serve, with the
# serve environment `pack` brought back beside it (FILE less .yaml, -env.yaml), or none where it brought none
from_serve() {
    local env=${1%.yaml}-env.yaml
    cp "$1" "$WORK/serve/serve.yaml"
    if [[ -f $env ]]; then cp "$env" "$WORK/serve/serve-env.yaml"; else rm -f "$WORK/serve/serve-env.yaml"; fi
}

# kept_job NAME WHAT: NAME.py (compare.py, cotenant.py) on the kept serve config (FROM=, else the last part's),
# detached from a fresh copy of the project, its log in $WORK/NAME.log
kept_job() {
    local name=$1 what=$2
    alive "$WORK/run.pid" && die "the staged run is still going"
    alive "$WORK/$name.pid" && die "$what is going (pid $(cat "$WORK/$name.pid"))"
    setup
    [[ -n ${FROM:-} ]] && from_serve "$FROM"
    [[ -f $WORK/serve/serve.yaml ]] || die "no kept serve config: stage a part first, or give FROM=kept-serve.yaml"
    (cd "$PROJ" && detach "$WORK/$name.pid" "$WORK/$name.log" \
        python3 "$PROJ/benchmarks/vllm_h200/$name.py" "$CONFIG" "$WORK")
    echo "$what started (pid $(cat "$WORK/$name.pid")), log $WORK/$name.log"
}

case ${1:-} in
    parts)
        [[ -f $PAYLOAD_XZ ]] || die "no $PAYLOAD_XZ: run ../shared/vllm-h200/build_payload.sh first"
        rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"
        size=$(stat -c %s "$PAYLOAD_XZ")
        split -b $(( (size + PAYLOAD_PARTS - 1) / PAYLOAD_PARTS )) -d -a 1 "$PAYLOAD_XZ" "$PAYLOAD/part_"
        for i in $(seq 0 $((PAYLOAD_PARTS - 1))); do mkdir -p "$PAYLOAD/p$i" && mv "$PAYLOAD/part_$i" "$PAYLOAD/p$i/"; done
        last=$PAYLOAD/p$((PAYLOAD_PARTS - 1))
        cp "$TREE/../shared/vllm-h200/mkmodel.py" "$last/"
        (cd "$PAYLOAD" && sha256sum p*/part_* | sed 's# p[0-9]*/# #' > "$last/SHA256SUMS")
        du -sh "$PAYLOAD"/p*
        ;;
    receive)
        i=${2:-}
        [[ -f $PAYLOAD/p$i/part_$i ]] || die "receive N: carry .cache/vllm-payload/pN with this call"
        mkdir -p "$STAGE" && cp "$PAYLOAD/p$i/part_$i" "$STAGE/"
        # carried kernels, so that the first start compiles none: FlashInfer's where this machine has none of its
        # own (a build it began is not mixed with another's), Triton's beside its own (each kernel's files are
        # named by its hash: one already here is the same kernel, and is kept)
        if [[ -f $JIT/jit-cache.tgz && ! -d $HOME/.cache/flashinfer ]]; then
            tar -xzf "$JIT/jit-cache.tgz" -C "$HOME" && echo "JIT cache restored into $HOME: FlashInfer's, $(tar -tzf "$JIT/jit-cache.tgz" | wc -l) entries"
        fi
        if [[ -f $JIT/triton-cache.tgz ]]; then
            python3 "$TREE/benchmarks/triton_cache.py" unpack "$JIT/triton-cache.tgz" "$HOME" | sed 's/^/JIT cache: /'
        fi
        if [[ -f $PAYLOAD/p$i/SHA256SUMS ]]; then  # the last part: check them all, unpack, write the model folder
            (cd "$STAGE" && sha256sum -c "$PAYLOAD/p$i/SHA256SUMS") || die "a part is missing or damaged in $STAGE"
            mkdir -p "$SITE"
            cat $(ls "$STAGE"/part_* | sort -V) | xz -d -T0 | tar -x -C "$SITE"
            python3 "$PAYLOAD/p$i/mkmodel.py" /tmp/qwen36
            [[ -n ${LAYERS:-} ]] && python3 "$HERE/layers.py" /tmp/qwen36 "$LAYERS"
        fi
        ls -la "$STAGE"
        nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
        ;;
    stage)
        part=${2:-}
        [[ -n ${PARTS[$part]:-} ]] || die "stage PART: one of $(printf "%s " "${!PARTS[@]}" | tr " " "\n" | sort | xargs)"
        shift 2
        alive "$WORK/run.pid" && die "a run is going (pid $(cat "$WORK/run.pid")): poll with 'run.sh status'"
        setup
        if [[ -n ${STATE:-} ]]; then  # the history of the part before, from its `results`: its calibration holds
            [[ -f $STATE/orchestrator.db ]] || die "STATE=$STATE: no orchestrator.db there (a part's results/state)"
            [[ -n ${FROM:-} ]] || die "STATE= needs FROM=, the serve config that history left (kept-serve.yaml, or serve-now.yaml of a part cut short)"
            [[ -e $WORK/state ]] && die "$WORK/state exists: STATE= starts a fresh machine from a part's history"
            cp -r "$STATE" "$WORK/state"
        fi
        if [[ -n ${FROM:-} ]]; then
            from_serve "$FROM"
            # a later part starts from a kept stack, not from the seed's one-sequence baseline: it calibrates that
            sed -i 's/at: first_keep/at: start/' "$CONFIG"
        elif [[ ! -f $WORK/serve/serve.yaml ]]; then
            cp "$HERE/serve.yaml" "$WORK/serve/serve.yaml"
        fi
        echo "part $part: ${PARTS[$part]}, from:"; cat "$WORK/serve/serve.yaml"
        (cd "$PROJ" && detach "$WORK/run.pid" "$WORK/run.log" \
            python3 -m orchestrator.cli run --config "$CONFIG" --only "${PARTS[$part]}" "$@")
        echo "orchestrator run started (pid $(cat "$WORK/run.pid")), log $WORK/run.log"
        ;;
    status)
        alive "$WORK/run.pid" && echo "running (pid $(cat "$WORK/run.pid"))" || echo "not running"
        orch status || true
        [[ -f $WORK/state/orchestrator.db ]] && python3 "$HERE/samples.py" "$WORK/state/orchestrator.db" 6 || true
        tail -n 15 "$WORK/run.log" 2>/dev/null || true
        ls -t "$WORK/state/server-logs" 2>/dev/null | head -3 | while read -r f; do
            echo "== $f"; tail -n 5 "$WORK/state/server-logs/$f"; done || true
        tail -n 12 "$WORK/compare.log" 2>/dev/null || true
        tail -n 20 "$WORK/cotenant.log" 2>/dev/null || true
        # with OUT= (the device's $OUT), every poll brings back what `results` does, less the report: a machine
        # taken back mid-run still leaves its history here (STATE= continues from it elsewhere) and the kernels
        # compiled so far (each poll's cache is the newest: `unpack` replaces the one here with it)
        if [[ -n ${OUT:-} && ( -f $WORK/state/orchestrator.db || -f $WORK/cotenant.log ) ]]; then
            pack "$OUT"
            jit_caches "$OUT" | sed 's/^/JIT cache: /'  # the sizes: whether each could travel
        fi
        ;;
    compare)
        mkdir -p "$WORK" && cp "$HERE/defaults.yaml" "$WORK/defaults.yaml"
        kept_job compare "the comparison"
        ;;
    profile)  # where the serving engine core's time goes (py-spy from .whl, installed by setup): into $OUT
        [[ -x $SITE/bin/py-spy ]] || die "no $SITE/bin/py-spy: start a job first (its setup installs .whl)"
        python3 "$HERE/profile.py" record "${OUT:-$WORK}" --seconds "${2:-15}" --py-spy "$SITE/bin/py-spy"
        ;;
    cotenant)
        # does a sleeping server slow the awake one? One server of the kept serve config alone, beside a second
        # asleep, alone again: about 8 minutes with a warm kernel cache
        kept_job cotenant "the co-tenant test"
        ;;
    results)
        # what comes back from the machine: results.tgz (status, report, logs, kept serve.yaml, the history),
        # jit-cache.tgz and triton-cache.tgz (the kernels the servers compiled); $OUT returns at most 8 files, 16 MiB each
        out=${OUT:-$WORK/results}
        pack "$out" report
        jit_caches "$out"
        ls -la "$out"
        cat "$WORK/pack/status.txt" "$WORK/pack/kept-serve.yaml" "$WORK/pack/serve-now.yaml" 2>/dev/null || true
        cat "$WORK/compare.md" 2>/dev/null || true
        ;;
    unpack)
        # here, after `results`: its files (the run tool's files_at) into results/NAME, the JIT cache into .cache/jit
        name=${2:-}; from=${3:-}
        [[ -n $name && -f $from/results.tgz ]] || die "unpack NAME FILES_AT: FILES_AT holds results.tgz from 'results'"
        dest=$RESULTS/$name
        [[ -e $dest ]] && die "$dest exists"
        mkdir -p "$dest" && tar -xzf "$from/results.tgz" -C "$dest" && chmod -R u+w "$dest"
        [[ -d $dest/report ]] && for f in "$dest"/report/run-*; do mv "$f" "$dest/report.${f##*.}"; done && rmdir "$dest/report"
        for cache in jit-cache.tgz triton-cache.tgz; do
            if [[ -f $from/$cache ]]; then mkdir -p "$JIT" && cp "$from/$cache" "$JIT/"; fi
        done
        ls -la "$dest" "$JIT" 2>/dev/null || true
        ;;
    *)
        sed -n '2,18p' "$0"
        exit 2
        ;;
esac
