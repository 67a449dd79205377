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
# The venv lives in target/venv-schemathesis and is rebuilt when requirements.txt changes. The venv
# and the daemon's start, readiness wait and stop are tests/lib/daemon.sh's, shared with
# tests/browser/run.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/lib/daemon.sh

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

require_daemon_binary "$bin"
require_tools python3 curl
make_venv "$venv" "$requirements" schemathesis

# $work: the config, the data directory, the daemon's output and the tester's files, removed on
# exit with the daemon stopped (by its PID).
daemon_workdir

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
# Ready once it prints its `listening: URL` line (at most 30 s); sets $daemon_pid, $daemon_base
# and $emulator.
start_daemon listening 30 RUST_LOG=warn \
  HANDOFF_BRIDGE_HELPDESK_TOKENS="$token" HANDOFF_BRIDGE__RULES__ENABLED=false -- \
  "$bin" "${args[@]}"
base=$daemon_base
echo "-- daemon $daemon_pid at $base (emulator $emulator)"

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

daemon_alive "the contract check" || status=1
if [ "$status" -ne 0 ]; then
  show_daemon_log
  echo "contract check FAILED" >&2
fi
exit "$status"
