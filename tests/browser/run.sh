#!/usr/bin/env bash
# The operator console in a real browser: Python Playwright (pinned in requirements.txt beside this
# script) drives the machine's Chromium through the console the way a person does (sign in, the
# queue, a conversation's accept, reply and release, a dead letter retried, a viewer refused, a
# message with markup shown as text, the pages with JavaScript off) and fails on anything
# unexpected: a browser console error, a failed request, an answer >= 400 the step did not expect,
# a dialog. What it asserts: tests/browser/console_check.py; the tour: docs/console.md.
#
#   bash tests/browser/run.sh [BINARY]     (default: target/debug/handoff-bridge)
#
# Environment:
#   BROWSER_CHROMIUM      the browser (default /usr/bin/chromium; CI: apt-get install chromium
#                         chromium-driver). Nothing here downloads a browser.
#   BROWSER_SCREENSHOTS   where the screenshots go (default target/browser-check/screenshots);
#                         BROWSER_SCREENSHOTS=docs/console refreshes the ones docs/console.md shows.
#   BROWSER_TIMEOUT       seconds the whole check may take before it is stopped (default 240).
#
# One daemon on loopback with a temporary data directory, the embedded emulator as upstream, known
# admin, viewer and webhook tokens, and business hours off (the queue must not depend on the day).
# The venv lives in target/venv-browser and is rebuilt when requirements.txt changes. The venv and
# the daemon's start, readiness wait and stop are tests/lib/daemon.sh's, shared with
# tests/contract/schemathesis.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/lib/daemon.sh

bin=${1:-target/debug/handoff-bridge}
chromium=${BROWSER_CHROMIUM:-/usr/bin/chromium}
screenshots=${BROWSER_SCREENSHOTS:-target/browser-check/screenshots}
check_timeout=${BROWSER_TIMEOUT:-240}
requirements=tests/browser/requirements.txt
venv=$(pwd)/target/venv-browser
fixtures=$(cd .. && pwd)/shared/fixtures/webhooks
admin_token=console-check-admin-token-0123456789
viewer_token=console-check-viewer-token-0123456789
webhook_token=console-check-webhook-token-0123456789

require_daemon_binary "$bin"
if [ ! -x "$chromium" ]; then
  echo "no Chromium at $chromium (apt-get install chromium chromium-driver; nothing here downloads one)" >&2
  exit 1
fi
if [ ! -f "$fixtures/agent-call-requested.json" ]; then
  echo "$fixtures is missing: the check posts the service's sample deliveries" >&2
  exit 1
fi
require_tools python3 curl
# The Python package only: its browsers are never downloaded (the check launches $chromium).
make_venv "$venv" "$requirements" Playwright PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1

# $work: the config, the data directory and the daemon's output, removed on exit with the daemon
# stopped (by its PID).
daemon_workdir

# Two free loopback ports, chosen here: bound to port 0, read, closed, handed to the daemon.
read -r public admin < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
for s in socks:
    s.close()
')

cat >"$work/bridge.toml" <<EOF
[admin]
token = "$admin_token"
viewer_tokens = ["$viewer_token"]

[webhook]
tokens = ["$webhook_token"]

[upstream]
url = "embedded"

[dispatch]
# The daemon's own priority, not idle: on a busy CI machine the pages must not wait for a CPU the
# browser keeps busy (as in tests/contract/schemathesis.sh).
fold_priority = "nice"
fold_niceness = 0

[rules.settings]
# A person is asked for at any hour: the check must not depend on the day it runs.
check_business_hours = false
EOF

# Ready when the admin listener's /readyz answers 200 (at most 60 s); sets $daemon_pid and $emulator.
start_daemon "readyz=http://127.0.0.1:$admin" 60 NO_COLOR=1 -- \
  "$bin" serve --config "$work/bridge.toml" --data-dir "$work/data" \
  --listen "127.0.0.1:$public" --admin-listen "127.0.0.1:$admin"
echo "-- daemon $daemon_pid: public 127.0.0.1:$public, admin 127.0.0.1:$admin, emulator $emulator"

status=0
mkdir -p "$screenshots"
timeout --kill-after=10 "$check_timeout" "$venv/bin/python" tests/browser/console_check.py \
  --public "http://127.0.0.1:$public" --admin "http://127.0.0.1:$admin" --emulator "$emulator" \
  --admin-token "$admin_token" --viewer-token "$viewer_token" --webhook-token "$webhook_token" \
  --fixtures "$fixtures" --chromium "$chromium" --screenshots "$screenshots" || status=$?

daemon_alive "the browser check" || status=1
if [ "$status" -ne 0 ]; then
  [ "$status" -eq 124 ] && echo "the browser check did not finish within ${check_timeout} s" >&2
  show_daemon_log
  echo "console browser check FAILED" >&2
fi
exit "$status"
