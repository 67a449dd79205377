#!/usr/bin/env bash
# The agent API's contract check: schemathesis (a property-based API tester, pinned in
# requirements.txt beside this script) reads the OpenAPI document the daemon serves
# (/helpdesk/v1/openapi.json), generates requests from it, valid and invalid, and runs all of its
# checks on the answers: valid requests are accepted, invalid ones refused with a 4xx, no 5xx,
# every status, content type and body as documented, 405 with Allow for undeclared methods,
# 401 without the token... Any failure fails the script. See docs/agent-api-contract.md.
#
#   bash tests/contract/schemathesis.sh [BINARY]     (default: target/debug/handoff-bridge)
#
# Environment: CONTRACT_EXAMPLES (examples per operation and pass, default 100), CONTRACT_SEED
# (default 19: runs are reproducible; try others locally to search further), CONTRACT_ARGS (more
# `schemathesis run` options, e.g. "--report har --report-dir /tmp/st" to see every exchange).
#
# Two passes against one daemon on loopback, with a temporary data directory, the embedded
# emulator as upstream and two seeded conversations (a web visitor and a partner-messenger user
# waiting for an agent):
#   1. every parameter generated: paths, queries, headers and bodies, mostly unknown ids;
#   2. the path parameters fixed to the seeded conversations and user, so commands reach the
#      fold and answer from real verdicts (200 and 409s), checked against the document too.
# The venv lives in target/venv-schemathesis and is rebuilt when requirements.txt changes.
set -euo pipefail
cd "$(dirname "$0")/../.."

bin=${1:-target/debug/handoff-bridge}
examples=${CONTRACT_EXAMPLES:-100}
seed=${CONTRACT_SEED:-19}
requirements=tests/contract/requirements.txt
venv=$(pwd)/target/venv-schemathesis
# The emulator's default seed: bot B7f3a2c's web visitor and partner-messenger (kakaobiz) user.
web=5c0e9b1f-2222-4d3e-9f10-000000000001
kakao=5c0e9b1f-2222-4d3e-9f10-000000000002
kakao_user=kb-user-77a9f2
token=contract-check-token-0123456789

if [ ! -x "$bin" ]; then
  echo "no daemon binary at $bin (cargo build first)" >&2
  exit 1
fi
for tool in python3 curl; do
  command -v "$tool" >/dev/null || { echo "$tool is required" >&2; exit 1; }
done
# Debian's python3 lacks venv's ensurepip until python3-venv is installed (CI runs as root).
if ! python3 -c 'import ensurepip' 2>/dev/null && command -v apt-get >/dev/null; then
  apt-get update -qq >/dev/null 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null 2>&1
fi
if ! cmp -s "$requirements" "$venv/requirements.txt"; then
  echo "-- installing schemathesis into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$venv/requirements.txt"
fi

work=$(mktemp -d)
pid=
stop() {
  # The daemon this script started, by its PID; it stops on SIGTERM.
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap stop EXIT
trap 'exit 130' INT TERM

cat >"$work/bridge.toml" <<EOF
[dispatch]
# The daemon's own priority, not idle: a command's verdict must not wait for a CPU that the
# tester keeps busy (an answer after helpdesk.command_timeout would be a 504).
fold_priority = "nice"
fold_niceness = 0

[helpdesk.partner.bots]
B7f3a2c = "sk-support-0001"
EOF

args=(serve --config "$work/bridge.toml" --listen 127.0.0.1:0 --data-dir "$work/data" --upstream embedded)
# With a separate admin listener (its default port is fixed), take any free one.
if "$bin" serve --help | grep -q -- '--admin-listen'; then
  args+=(--admin-listen 127.0.0.1:0)
fi
env -i PATH="$PATH" HOME="${HOME:-/tmp}" RUST_LOG=warn \
  HANDOFF_BRIDGE_HELPDESK_TOKENS="$token" HANDOFF_BRIDGE__RULES__ENABLED=false \
  "$bin" "${args[@]}" >"$work/stdout" 2>"$work/daemon.log" &
pid=$!

base=
emulator=
for _ in $(seq 300); do
  base=$(sed -n 's/^listening: //p' "$work/stdout")
  [ -n "$base" ] && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "the daemon exited before listening:" >&2
    cat "$work/stdout" "$work/daemon.log" >&2
    exit 1
  fi
  sleep 0.1
done
if [ -z "$base" ]; then
  echo "the daemon did not print its listening: line within 30 s" >&2
  exit 1
fi
emulator=$(sed -n 's/^upstream: embedded emulator at //p' "$work/stdout")
if [ -z "$emulator" ]; then
  echo "the daemon did not print its 'upstream: embedded emulator at' line:" >&2
  cat "$work/stdout" >&2
  exit 1
fi
echo "-- daemon $pid at $base (emulator $emulator)"

# Seed: both users ask for an agent; wait until the emulator's webhooks are delivered.
for conversation in "$web" "$kakao"; do
  curl -sSf -X POST -H 'content-type: application/json' -d '{}' \
    "$emulator/_emulator/conversations/$conversation/request-agent" >/dev/null
done
curl -sSf "$emulator/_emulator/webhook/flushed?timeout_ms=30000" >/dev/null
# The bridge knows them once they are folded: wait (bounded) until the queue lists both.
for _ in $(seq 300); do
  queue=$(curl -sSf -H "authorization: Bearer $token" "$base/helpdesk/v1/conversations")
  case "$queue" in *"$web"*"$kakao"* | *"$kakao"*"$web"*) break ;; esac
  sleep 0.1
done
case "$queue" in
  *"$web"*"$kakao"* | *"$kakao"*"$web"*) ;;
  *) echo "the seeded conversations did not reach the queue: $queue" >&2; exit 1 ;;
esac

cp tests/contract/schemathesis.toml "$work/generated.toml"
{ cat tests/contract/schemathesis.toml; cat <<EOF; } >"$work/seeded.toml"

[parameters]
"path.id" = "$web"
"path.platform" = "kakaobiz"
"path.user_key" = "$kakao_user"
EOF

run() {
  local pass=$1
  shift
  echo "== contract pass: $pass (seed $seed, $examples examples per operation)"
  # One worker: the tester's threads trip a CPython 3.11 ast.parse race (SystemError "AST
  # constructor recursion depth mismatch") in hypothesis; the daemon answers fast anyway.
  (cd "$work" && "$venv/bin/schemathesis" --no-color "$@" run "$base/helpdesk/v1/openapi.json" \
    --checks all --seed "$seed" --max-examples "$examples" --workers 1 \
    --header "Authorization: Bearer $token" --request-timeout 30 ${CONTRACT_ARGS:-})
}

status=0
run generated --config-file "$work/generated.toml" || status=1
run seeded --config-file "$work/seeded.toml" || status=1

if ! kill -0 "$pid" 2>/dev/null; then
  echo "the daemon died during the contract check:" >&2
  tail -50 "$work/daemon.log" >&2
  status=1
fi
if [ "$status" -ne 0 ]; then
  echo "-- daemon log (last 50 lines):"
  tail -50 "$work/daemon.log"
  echo "contract check FAILED" >&2
fi
exit "$status"
