# Sourced by the GPU-machine scripts that run vLLM (vllm_h200/run.sh, ray_screening/run.sh), after they set
# PROJ (the project's copy detached jobs run from) and SITE (vLLM and the wheels: ../shared/vllm-h200/serve.sh):
# the environment vLLM runs offline in, and the helpers both use.
# One folder for vLLM and the wheels: those the payload also carries have the payload's versions
# (benchmarks/make_wheels.sh), so installing them there replaces nothing vLLM was tested with.
export PYTHONPATH="$PROJ:$SITE"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a
export PATH="$(dirname "$(command -v python3)"):$PATH"
if [[ -z ${CUDA_HOME:-} ]] && command -v nvcc >/dev/null; then
    CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
    export CUDA_HOME
fi

die() { echo "run.sh: $*" >&2; exit 2; }
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# detach PIDFILE LOG COMMAND...: COMMAND in a session of its own, outliving the call that started it. The process
# writes its own pid: `$!` is setsid's, which forks (and exits) where the caller runs with job control, as the
# device machine's shell does, so `alive` would have called a live run dead.
detach() {
    local pidfile=$1 log=$2
    shift 2
    rm -f "$pidfile"
    setsid nohup bash -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$@" > "$log" 2>&1 < /dev/null &
    for _ in $(seq 1 100); do [[ -s $pidfile ]] && return 0; sleep 0.1; done
    die "$* did not start (no $pidfile)"
}

# The payload's own server (serve.sh starts one on port 8000) holds 90 % of a card: stop its group.
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
