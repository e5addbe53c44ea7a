#!/usr/bin/env bash
# The compose test (issue 8): compose.yaml brought up for real, from images built without a
# registry, and driven from the host with `zerolayer chat`. `.ci/run` calls it when this file
# exists; it skips (exit 0, with a line starting `SKIP compose test:`) when there is no Docker
# engine to talk to, and fails instead of skipping with ZEROLAYER_COMPOSE_REQUIRED=1.
#
# Steps (each prints its duration; a summary comes last):
#  1. images   scripts/build-images.sh (base image reused when present, layers cached)
#  2. up       `up -d` (keygen, engine, front); wait until engine and front are healthy
#  3. chat     3 turns through the front: turn 1 new, turns 2 and 3 report cached tokens
#  4. kill     a long stream through the front, `kill engine` mid-stream: the client fails
#              with ENGINE_UNAVAILABLE within KILL_DEADLINE_S, the front turns NOT_SERVING
#              and answers a new request with ENGINE_UNAVAILABLE
#  5. restart  `start engine`: the front reattaches by itself (SERVING again) and a new
#              conversation reuses its KV cache again
#  6. baseline profile `baseline` (redis, baseline-engine, orchestrator): 3 turns through the
#              orchestrator, every turn with cached 0 (full prompt each time)
#  7. down     `down -v` with every profile (also on failure, from an EXIT trap, after
#              printing the services' logs)
#
# Environment:
#   ZEROLAYER_BIN             zerolayer binary for the images and the client (default: built
#                             with `cargo build --locked -p zerolayer-cli`)
#   ZEROLAYER_IMAGE           service image tag (default zerolayer:local)
#   ZEROLAYER_COMPOSE_BUILD=0 test $ZEROLAYER_IMAGE as it is (e.g. built from docker/Dockerfile)
#                             instead of building it with scripts/build-images.sh
#   ZEROLAYER_BASE_METHOD     base image method for scripts/build-images.sh
#   ZEROLAYER_COMPOSE_REQUIRED=1  fail instead of skipping when Docker is unavailable
#   ZEROLAYER_COMPOSE_KEEP=1  leave the project running on failure (prints how to remove it)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

# Seconds a service gets to become healthy (model load + first health check on a loaded
# 2-core machine; dummy:tiny needs about one).
HEALTH_DEADLINE_S=180
# Seconds the client may take to fail after the engine is killed: the front notices a dead
# engine within its liveness timeout (400 ms, shm crate), so 15 s only absorbs machine load.
KILL_DEADLINE_S=15
# Seconds any single `zerolayer chat` may run before the test calls it hung.
CHAT_TIMEOUT_S=120

T_START=$SECONDS
STEP_NAME=""
STEP_T0=$SECONDS
SUMMARY=()

log() { printf '[compose-test %s] %s\n' "$(date +%T)" "$*"; }
end_step() {
    if [ -n "$STEP_NAME" ]; then
        local took=$((SECONDS - STEP_T0))
        SUMMARY+=("$(printf '%-9s %4d s' "$STEP_NAME" "$took")")
        log "step $STEP_NAME done in ${took} s"
    fi
    STEP_NAME=""
}
step() {
    end_step
    STEP_NAME="$1"
    STEP_T0=$SECONDS
    printf '\n'
    log "=== step $1: $2"
}
skip() {
    echo "SKIP compose test: $*"
    if [ "${ZEROLAYER_COMPOSE_REQUIRED:-0}" = 1 ]; then
        echo "FAIL compose test: ZEROLAYER_COMPOSE_REQUIRED=1 but the test cannot run" >&2
        exit 1
    fi
    exit 0
}
fail() {
    echo "FAIL compose test (step ${STEP_NAME:-setup}): $*" >&2
    exit 1
}

# --- can it run here? --------------------------------------------------------------------------
command -v docker >/dev/null || skip "no docker command on this machine"
if ! docker_info_err="$(docker info 2>&1 >/dev/null)"; then
    skip "'docker info' failed, no Docker engine reachable: $(printf '%s' "$docker_info_err" | tail -n 1)"
fi
if docker compose version >/dev/null 2>&1; then
    COMPOSE_TOOL=(docker compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE_TOOL=(docker-compose)
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing docker-compose (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
    COMPOSE_TOOL=(docker-compose)
else
    skip "Docker runs but neither 'docker compose' nor 'docker-compose' is installed"
fi
command -v python3 >/dev/null || fail "python3 is needed to read the client's JSON output"

# --- the binary (images and client) ------------------------------------------------------------
if [ -z "${ZEROLAYER_BIN:-}" ]; then
    log "cargo build --locked -p zerolayer-cli"
    cargo build --locked -p zerolayer-cli || fail "cargo build -p zerolayer-cli failed"
    ZEROLAYER_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/zerolayer"
fi
[ -x "$ZEROLAYER_BIN" ] || fail "no zerolayer binary at $ZEROLAYER_BIN"
ZL="$(readlink -f "$ZEROLAYER_BIN")"
export ZEROLAYER_BIN="$ZL"

# --- the project: unique name, own secrets, ephemeral ports ------------------------------------
PROJECT="zlct-$(date +%s)-$$"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/zerolayer-compose-test.XXXXXX")"
random_key() { printf 'zl-ct-%s' "$(od -An -tx1 -N18 /dev/urandom | tr -d ' \n')"; }
API_KEY="$(random_key)"
cat >"$WORK/tenants.toml" <<EOF
[[tenants]]
name = "compose-test"
api_keys = ["$API_KEY"]
EOF
chmod 0644 "$WORK/tenants.toml" # read by uid 10001 inside the containers

export COMPOSE_PROJECT_NAME="$PROJECT"
export ZEROLAYER_IMAGE="${ZEROLAYER_IMAGE:-zerolayer:local}"
export ZEROLAYER_TENANTS_SECRET="$WORK/tenants.toml"
export ZEROLAYER_MODEL=dummy:tiny
# dummy:tiny needs no file; the repository's (empty) models directory keeps Docker from
# creating a caller's ZEROLAYER_MODELS_DIR (.ci/run sets it for the tests) that does not exist.
export ZEROLAYER_MODELS_DIR="$ROOT/docker/models"
export ZEROLAYER_BIND=127.0.0.1
# Docker-level health checks every 2 s (the default 10 s would only slow the waits below).
export ZEROLAYER_HEALTH_INTERVAL=2s
export ZEROLAYER_HEALTH_START_PERIOD=60s
export RUST_LOG="${RUST_LOG:-info}"
# Whatever the caller's shell has, the test must not depend on fixed free ports.
for v in ENGINE_GRPC ENGINE_METRICS FRONT_GRPC FRONT_METRICS ORCHESTRATOR_GRPC ORCHESTRATOR_METRICS \
    GPU_ENGINE_METRICS GPU_FRONT_GRPC GPU_FRONT_METRICS; do
    export "ZEROLAYER_${v}_PORT=0"
done
# The client's own settings come from its flags and ZEROLAYER_API_KEY only.
unset ZEROLAYER_ENDPOINT ZEROLAYER_MAX_TOKENS

compose() { "${COMPOSE_TOOL[@]}" -f "$ROOT/compose.yaml" "$@"; }
ALL_PROFILES=(--profile baseline --profile gpu --profile bench)

teardown() {
    local rc=$?
    end_step
    if [ "$rc" != 0 ]; then
        printf '\n'
        log "failure: last log lines of every service"
        compose "${ALL_PROFILES[@]}" logs --no-color --tail=40 2>&1 || true
        if [ "${ZEROLAYER_COMPOSE_KEEP:-0}" = 1 ]; then
            log "ZEROLAYER_COMPOSE_KEEP=1: project $PROJECT left running; remove it with:"
            log "  COMPOSE_PROJECT_NAME=$PROJECT ${COMPOSE_TOOL[*]} ${ALL_PROFILES[*]} down -v --remove-orphans"
            exit "$rc"
        fi
    fi
    local t0=$SECONDS
    printf '\n'
    log "=== teardown: down -v --remove-orphans (project $PROJECT)"
    compose "${ALL_PROFILES[@]}" down --volumes --remove-orphans --timeout 10 >"$WORK/down.log" 2>&1 ||
        { cat "$WORK/down.log"; rc=1; }
    # Nothing of the project may survive: containers, volumes, networks.
    local left
    left="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")"
    if [ -n "$(echo "$left" | tr -d '[:space:]')" ]; then
        echo "FAIL compose test: project $PROJECT left resources behind: $left" >&2
        rc=1
    fi
    SUMMARY+=("$(printf '%-9s %4d s' teardown $((SECONDS - t0)))")
    rm -rf "$WORK"
    printf '\n'
    log "timings:"
    printf '    %s\n' "${SUMMARY[@]}"
    log "total $((SECONDS - T_START)) s"
    if [ "$rc" = 0 ]; then echo "PASS compose test"; else echo "FAIL compose test (see above)" >&2; fi
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# --- helpers -------------------------------------------------------------------------------------
container_of() { compose "${ALL_PROFILES[@]}" ps -a -q "$1"; }

# Waits until service $1's container is running and its Docker health check passes.
wait_healthy() {
    local svc="$1" id state deadline=$((SECONDS + HEALTH_DEADLINE_S))
    id="$(container_of "$svc")"
    [ -n "$id" ] || fail "service $svc has no container"
    while :; do
        state="$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} restarts={{.RestartCount}}' "$id")"
        case "$state" in
            "running healthy restarts=0") return 0 ;;
            exited* | dead*) fail "service $svc stopped ($state)" ;;
            *restarts=0) ;;
            # Nothing in this test crashes a service: a restart is a crash loop.
            *) fail "service $svc was restarted by its restart policy ($state)" ;;
        esac
        [ "$SECONDS" -lt "$deadline" ] || fail "service $svc not healthy after ${HEALTH_DEADLINE_S} s ($state)"
        sleep 0.5
    done
}

# host:port published for container port $2 of service $1.
published() {
    local addr
    addr="$(compose "${ALL_PROFILES[@]}" port "$1" "$2" | tail -n 1)"
    [ -n "$addr" ] || fail "service $1 publishes no port for $2"
    echo "$addr"
}

# Whether `zerolayer health` reports SERVING at http://$1.
serving() { RUST_BACKTRACE=0 "$ZL" health --addr "http://$1" --timeout-s 3 >/dev/null 2>&1; }

# Waits until http://$1 reports SERVING ($2 = true) or not ($2 = false) from the host.
wait_serving() {
    local addr="$1" want="$2" deadline=$((SECONDS + HEALTH_DEADLINE_S))
    while :; do
        if serving "$addr"; then [ "$want" = true ] && return 0; else [ "$want" = false ] && return 0; fi
        [ "$SECONDS" -lt "$deadline" ] || fail "$addr: health never became serving=$want within ${HEALTH_DEADLINE_S} s"
        sleep 0.2
    done
}

# `zerolayer chat --json` against http://$1; the remaining arguments are chat flags.
chat() {
    local addr="$1"
    shift
    ZEROLAYER_API_KEY="$API_KEY" RUST_BACKTRACE=0 RUST_LIB_BACKTRACE=0 \
        timeout "$CHAT_TIMEOUT_S" "$ZL" chat --endpoint "http://$addr" --json "$@"
}

# Checks the chat output file $1 against the expectation $2 (see the cases) and prints the
# turns; python3 because the turns' text is arbitrary JSON.
check_turns() {
    python3 - "$1" "$2" "$3" <<'PY'
import json, sys
path, expect, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
turns = [json.loads(line) for line in open(path) if line.strip()]
for t in turns:
    print(f"    turn {t['turn']}: prompt {t['prompt_tokens']} cached {t['cached_tokens']} "
          f"prefilled {t['prefilled_tokens']} generated {t['generated_tokens']} "
          f"reuse {t['reuse']} ttft {t['ttft_ms']:.1f} ms")
problems = []
if len(turns) != count:
    problems.append(f"expected {count} turns, got {len(turns)}")
for a, b in zip(turns, turns[1:]):
    if b["prompt_tokens"] <= a["prompt_tokens"]:
        problems.append(f"turn {b['turn']}: the prompt did not grow (full transcript expected)")
if expect == "reuse":
    if turns and turns[0]["cached_tokens"] != 0:
        problems.append("turn 1 of a new conversation reports cached tokens")
    for t in turns[1:]:
        if t["cached_tokens"] <= 0:
            problems.append(f"turn {t['turn']}: no cached tokens (KV reuse expected)")
elif expect == "no-reuse":
    for t in turns:
        if t["cached_tokens"] != 0:
            problems.append(f"turn {t['turn']}: {t['cached_tokens']} cached tokens in the baseline")
for p in problems:
    print(f"    problem: {p}")
sys.exit(1 if problems else 0)
PY
}

# Value of the Prometheus sample $2 (exact series text) at metrics address $1, or empty.
metric() {
    local addr="$1" series="$2" body
    exec 3<>"/dev/tcp/${addr%:*}/${addr##*:}" || return 0
    printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n' "$addr" >&3
    body="$(timeout 5 cat <&3 || true)"
    exec 3<&-
    printf '%s\n' "$body" | awk -v s="$series" '$1 == s { print $2 }'
}

log "project $PROJECT, compose: ${COMPOSE_TOOL[*]} ($("${COMPOSE_TOOL[@]}" version --short 2>/dev/null || echo '?')), binary $ZL"

# --- 1. images -----------------------------------------------------------------------------------
if [ "${ZEROLAYER_COMPOSE_BUILD:-1}" = 1 ]; then
    step images "scripts/build-images.sh"
    bash scripts/build-images.sh "$ZL"
else
    step images "ZEROLAYER_COMPOSE_BUILD=0: using the existing image $ZEROLAYER_IMAGE"
    docker image inspect "$ZEROLAYER_IMAGE" >/dev/null 2>&1 || fail "no image $ZEROLAYER_IMAGE"
fi

# --- 2. up ---------------------------------------------------------------------------------------
step up "up -d (keygen, engine, front); wait for health"
compose up -d 2>&1 | sed 's/^/    /'
[ "$(docker inspect -f '{{.State.ExitCode}}' "$(container_of keygen)")" = 0 ] || fail "keygen failed"
wait_healthy engine
wait_healthy front
FRONT="$(published front 50051)"
FRONT_METRICS="$(published front 9090)"
wait_serving "$FRONT" true
log "front serving at $FRONT (metrics $FRONT_METRICS)"

# --- 3. chat -------------------------------------------------------------------------------------
step chat "3-turn conversation through the front (turns 2 and 3 must reuse the KV cache)"
chat "$FRONT" --turn "Once upon a time there was a cat." --turn "What did the cat do next?" \
    --turn "How did the story end?" >"$WORK/chat.jsonl" || fail "chat through the front failed"
check_turns "$WORK/chat.jsonl" reuse 3 || fail "the front conversation did not reuse the KV cache"

# --- 4. kill -------------------------------------------------------------------------------------
step kill "kill engine mid-stream: the client must fail with ENGINE_UNAVAILABLE"
ttft_series='zerolayer_time_to_first_token_seconds_count{service="front"}'
inflight_series='zerolayer_requests_in_flight{service="front"}'
ttft_before="$(metric "$FRONT_METRICS" "$ttft_series")"
[ -n "$ttft_before" ] || fail "the front's /metrics has no $ttft_series"
# One byte per chunk, 10 ms apart, 400 tokens: the stream lasts seconds, all shaped inside
# the engine, so the kill lands mid-stream.
chat "$FRONT" --turn "Tell me a very long story about a dragon." --max-tokens 400 \
    --max-buffer-size 1 --min-delay-ms 10 --attempts 1 >"$WORK/long.out" 2>"$WORK/long.err" &
long_pid=$!
# Mid-stream = its first token was delivered and it is still in flight.
deadline=$((SECONDS + 60))
while :; do
    kill -0 "$long_pid" 2>/dev/null || fail "the long stream ended before the engine was killed: $(cat "$WORK/long.out" "$WORK/long.err")"
    ttft_now="$(metric "$FRONT_METRICS" "$ttft_series")"
    if [ -n "$ttft_now" ] && [ "$ttft_now" != "$ttft_before" ] &&
        [ "$(metric "$FRONT_METRICS" "$inflight_series")" = 1 ]; then
        break
    fi
    [ "$SECONDS" -lt "$deadline" ] || fail "the long stream never started"
    sleep 0.1
done
kill_t0=$(date +%s%N)
compose kill engine 2>&1 | sed 's/^/    /'
kill_done=$(date +%s%N)
long_rc=0
wait "$long_pid" || long_rc=$?
client_done=$(date +%s%N)
ms() { echo $((($2 - $1) / 1000000)); }
log "'kill engine' took $(ms "$kill_t0" "$kill_done") ms; the client failed $(ms "$kill_t0" "$client_done") ms after it was issued (exit $long_rc)"
log "client stderr: $(head -n 1 "$WORK/long.err")"
[ "$long_rc" != 0 ] || fail "the stream completed although the engine was killed mid-stream"
[ "$long_rc" != 124 ] || fail "the client hung for ${CHAT_TIMEOUT_S} s after the engine was killed"
head -n 1 "$WORK/long.err" | grep -q 'ENGINE_UNAVAILABLE' ||
    fail "the client failed, but not with ENGINE_UNAVAILABLE: $(head -n 3 "$WORK/long.err")"
[ "$(ms "$kill_t0" "$client_done")" -le $((KILL_DEADLINE_S * 1000)) ] ||
    fail "the client took longer than ${KILL_DEADLINE_S} s to fail after the kill"
# The front stays up, reports NOT_SERVING and refuses new work with ENGINE_UNAVAILABLE.
wait_serving "$FRONT" false
[ "$(docker inspect -f '{{.State.Status}}' "$(container_of front)")" = running ] || fail "the front died with the engine"
if chat "$FRONT" --turn "Anyone there?" --attempts 1 >"$WORK/down.out" 2>"$WORK/down.err"; then
    fail "a request succeeded while the engine was down"
fi
head -n 1 "$WORK/down.err" | grep -q 'ENGINE_UNAVAILABLE' ||
    fail "a request while the engine is down failed, but not with ENGINE_UNAVAILABLE: $(head -n 3 "$WORK/down.err")"
log "while the engine is down the front is NOT_SERVING and answers: $(head -n 1 "$WORK/down.err")"

# --- 5. restart ----------------------------------------------------------------------------------
step restart "start engine: the front reattaches by itself"
restart_t0=$SECONDS
compose start engine 2>&1 | sed 's/^/    /'
wait_serving "$FRONT" true
log "front SERVING again $((SECONDS - restart_t0)) s after 'start engine'"
wait_healthy engine
chat "$FRONT" --turn "Once upon a time there was a dog." --turn "What did the dog do next?" \
    >"$WORK/again.jsonl" || fail "chat after the engine restart failed"
check_turns "$WORK/again.jsonl" reuse 2 || fail "no KV reuse after the engine restart"

# --- 6. baseline ---------------------------------------------------------------------------------
step baseline "profile baseline: redis + baseline-engine (no reuse) + orchestrator"
compose --profile baseline up -d orchestrator 2>&1 | sed 's/^/    /'
wait_healthy redis
wait_healthy baseline-engine
wait_healthy orchestrator
ORCH="$(published orchestrator 50054)"
wait_serving "$ORCH" true
chat "$ORCH" --turn "Once upon a time there was a cat." --turn "What did the cat do next?" \
    --turn "How did the story end?" >"$WORK/baseline.jsonl" || fail "chat through the orchestrator failed"
check_turns "$WORK/baseline.jsonl" no-reuse 3 || fail "the baseline reported KV reuse"

end_step
log "all steps passed"
