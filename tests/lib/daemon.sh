# Shared by the checks that run the built daemon against a Python tool (tests/contract/schemathesis.sh,
# tests/browser/run.sh): the tool's venv under target/, and one daemon on loopback with a temporary
# data directory, started, waited for and stopped by its PID. Sourced (not run) by a bash script
# that has done `set -euo pipefail` and a cd to the repository root; a failure here exits that
# script with 1 (its EXIT trap still stops the daemon).
#
#   require_daemon_binary BINARY     exit 1 unless BINARY is executable ("cargo build first")
#   require_tools TOOL...            exit 1 unless each TOOL is on PATH
#   make_venv DIR REQUIREMENTS WHAT [NAME=VALUE...]
#                                    python3 -m venv DIR and pip install -r REQUIREMENTS (with
#                                    NAME=VALUE in pip's environment), only when REQUIREMENTS
#                                    differs from the copy kept in DIR; installs Debian's
#                                    python3-venv first if python3 has no ensurepip
#   daemon_workdir                   sets $work (mktemp -d) and the traps: on EXIT, stop_daemon;
#                                    on INT or TERM, exit 130
#   start_daemon READY SECONDS [NAME=VALUE...] -- BINARY ARGS...
#                                    runs BINARY ARGS in the background under `env -i` with only
#                                    PATH, HOME and the NAME=VALUEs, its stdout in $work/stdout and
#                                    its stderr in $work/daemon.log; sets $daemon_pid. Then waits
#                                    (polling every 0.1 s, at most SECONDS) until it is ready:
#                                      READY=readyz=URL   GET URL/readyz answers 200
#                                      READY=listening    it printed `listening: URL` ($daemon_base)
#                                    and sets $emulator from its `upstream: embedded emulator at`
#                                    line. Exits 1 if it exits first, is not ready in time, or
#                                    printed no emulator line.
#   daemon_alive WHAT                0 if the daemon still runs; else says it died during WHAT,
#                                    shows its log's last 50 lines and returns 1
#   show_daemon_log                  the daemon log's last 50 lines, on stdout
#   stop_daemon                      SIGTERM to $daemon_pid (only the daemon started here) and wait
#                                    for it, then remove $work

daemon_pid=
daemon_base=
emulator=

require_daemon_binary() {
  if [ ! -x "$1" ]; then
    echo "no daemon binary at $1 (cargo build first)" >&2
    exit 1
  fi
}

require_tools() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "$tool is required" >&2; exit 1; }
  done
}

make_venv() {
  local venv=$1 requirements=$2 what=$3
  shift 3
  # Debian's python3 lacks venv's ensurepip until python3-venv is installed (CI runs as root).
  if ! python3 -c 'import ensurepip' 2>/dev/null && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null 2>&1
  fi
  if ! cmp -s "$requirements" "$venv/requirements.txt"; then
    echo "-- installing $what into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    env "$@" "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
    cp "$requirements" "$venv/requirements.txt"
  fi
}

daemon_workdir() {
  work=$(mktemp -d)
  trap stop_daemon EXIT
  trap 'exit 130' INT TERM
}

stop_daemon() {
  # The daemon this script started, by its PID; it stops on SIGTERM.
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}

start_daemon() {
  local ready=$1 seconds=$2
  shift 2
  local env=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    env+=("$1")
    shift
  done
  [ $# -gt 0 ] || { echo "start_daemon: no -- BINARY ARGS" >&2; exit 1; }
  shift
  env -i PATH="$PATH" HOME="${HOME:-/tmp}" "${env[@]}" "$@" >"$work/stdout" 2>"$work/daemon.log" &
  daemon_pid=$!

  case "$ready" in
    readyz=*) wait_readyz "${ready#readyz=}" "$seconds" ;;
    listening) wait_listening "$seconds" ;;
    *) echo "start_daemon: unknown readiness '$ready'" >&2; exit 1 ;;
  esac

  emulator=$(sed -n 's/^upstream: embedded emulator at //p' "$work/stdout")
  if [ -z "$emulator" ]; then
    echo "the daemon did not print its 'upstream: embedded emulator at' line:" >&2
    cat "$work/stdout" >&2
    exit 1
  fi
}

# Until GET URL/readyz answers 200 (each try at most 2 s).
wait_readyz() {
  local url=$1 seconds=$2 ready=
  for _ in $(seq $((seconds * 10))); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url/readyz")" = 200 ]; then
      ready=1
      break
    fi
    if ! kill -0 "$daemon_pid" 2>/dev/null; then
      echo "the daemon exited before it was ready:" >&2
      cat "$work/stdout" "$work/daemon.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  if [ -z "$ready" ]; then
    echo "the daemon's /readyz did not answer 200 within $seconds s:" >&2
    cat "$work/stdout" >&2
    tail -50 "$work/daemon.log" >&2
    exit 1
  fi
}

# Until the daemon prints `listening: URL` (its public listener, bound) into $daemon_base.
wait_listening() {
  local seconds=$1
  daemon_base=
  for _ in $(seq $((seconds * 10))); do
    daemon_base=$(sed -n 's/^listening: //p' "$work/stdout")
    [ -n "$daemon_base" ] && break
    if ! kill -0 "$daemon_pid" 2>/dev/null; then
      echo "the daemon exited before listening:" >&2
      cat "$work/stdout" "$work/daemon.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  if [ -z "$daemon_base" ]; then
    echo "the daemon did not print its listening: line within $seconds s" >&2
    exit 1
  fi
}

daemon_alive() {
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    echo "the daemon died during $1:" >&2
    tail -50 "$work/daemon.log" >&2
    return 1
  fi
}

show_daemon_log() {
  echo "-- daemon log (last 50 lines):"
  tail -50 "$work/daemon.log"
}
