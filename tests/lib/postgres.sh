#!/usr/bin/env bash
# A throwaway PostgreSQL 15 for the tests: a new cluster in a temporary directory, on a free
# loopback port, owned by an unprivileged user (initdb refuses root), stopped and removed when the
# calling shell exits. Source it, then call `pg_start`:
#
#   . tests/lib/postgres.sh && pg_start
#   echo "$HANDOFF_BRIDGE_TEST_PG_URL"    # postgres://bridge:...@127.0.0.1:PORT/bridge
#
# The server comes from the machine image (/usr/lib/postgresql/15/bin) or Debian's postgresql-15
# package, which pg_start installs when missing. Nothing listens beyond 127.0.0.1; fsync stays on
# (the tests measure what durability costs, not what skipping it saves).

PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}

pg_install() {
  [ -x "$PG_BIN/postgres" ] && return 0
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql-15 >/dev/null 2>&1 \
    || { echo "PostgreSQL 15 is required and could not be installed" >&2; return 1; }
}

# Runs a command as the cluster's owner: `postgres` when we are root, else ourselves.
pg_as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

pg_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

pg_stop() {
  if [ -n "${PG_DIR:-}" ] && [ -d "$PG_DIR" ]; then
    pg_as_owner "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
  fi
}

pg_start() {
  pg_install || return 1
  PG_DIR=$(mktemp -d /tmp/handoff-bridge-pg.XXXXXX)
  chmod 755 "$PG_DIR"
  if [ "$(id -u)" = 0 ]; then chown postgres "$PG_DIR"; fi
  PG_PORT=$(pg_free_port)
  local password
  password=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  printf '%s\n' "$password" > "$PG_DIR/pwfile"
  if [ "$(id -u)" = 0 ]; then chown postgres "$PG_DIR/pwfile"; fi
  pg_as_owner "$PG_BIN/initdb" -D "$PG_DIR/data" -U bridge --pwfile="$PG_DIR/pwfile" \
    --auth=scram-sha-256 -E UTF8 --locale=C.UTF-8 >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; return 1; }
  pg_as_owner "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w \
    -o "-c listen_addresses=127.0.0.1 -c port=$PG_PORT -c unix_socket_directories=$PG_DIR -c max_connections=200" \
    start >/dev/null || { cat "$PG_DIR/server.log" >&2; return 1; }
  PGPASSWORD=$password "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U bridge -d postgres -qAt \
    -c 'CREATE DATABASE bridge' >/dev/null || return 1
  trap pg_stop EXIT
  export PG_DIR PG_PORT
  export HANDOFF_BRIDGE_TEST_PG_URL="postgres://bridge:$password@127.0.0.1:$PG_PORT/bridge"
  echo "-- PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PG_PORT ($PG_DIR)"
}
