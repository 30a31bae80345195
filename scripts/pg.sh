#!/usr/bin/env bash
# A throwaway PostgreSQL server for the store tests, on 127.0.0.1 with a temporary data dir.
#
#   source scripts/pg.sh && pg_start    # exports CAGKV_TEST_PG_URL (and CAGKV_PG_DIR)
#   ...                                 # pytest: the postgres tests use it
#   pg_stop                             # stops the server, deletes its data dir
#
# Run directly, `bash scripts/pg.sh start` prints the export lines and leaves the server
# running; `bash scripts/pg.sh stop DIR` stops it. Installs the Debian package
# `postgresql` when no server binaries are found (apt-get update first; needs root).

_pg_bin() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$d" ] && command -v initdb >/dev/null 2>&1; then
        d=$(dirname "$(readlink -f "$(command -v initdb)")")
    fi
    echo "$d"
}

_pg_as_owner() {
    # PostgreSQL refuses to run as root: run as the `postgres` user then.
    if [ "$(id -u)" = "0" ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

pg_start() {
    local bin port
    bin=$(_pg_bin)
    if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
        echo "pg.sh: installing PostgreSQL (apt-get)" >&2
        if [ "$(id -u)" != "0" ]; then
            echo "pg.sh: PostgreSQL is not installed and this user cannot apt-get install it" >&2
            return 1
        fi
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2 || return 1
        bin=$(_pg_bin)
    fi
    CAGKV_PG_DIR=$(mktemp -d /tmp/cagkv-pg.XXXXXX) || return 1
    chmod 755 "$CAGKV_PG_DIR"
    [ "$(id -u)" = "0" ] && chown postgres: "$CAGKV_PG_DIR"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    _pg_as_owner "$bin/initdb" -D "$CAGKV_PG_DIR/data" -U postgres --auth=trust -E UTF8 --no-sync \
        >"$CAGKV_PG_DIR/initdb.log" 2>&1 || { cat "$CAGKV_PG_DIR/initdb.log" >&2; return 1; }
    # fsync off: a throwaway server; the tests kill clients, never the server's machine
    _pg_as_owner "$bin/pg_ctl" -D "$CAGKV_PG_DIR/data" -l "$CAGKV_PG_DIR/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $CAGKV_PG_DIR -c fsync=off -c max_connections=200" \
        start >/dev/null || { cat "$CAGKV_PG_DIR/server.log" >&2; return 1; }
    export CAGKV_PG_DIR
    export CAGKV_PG_BIN="$bin"
    export CAGKV_TEST_PG_URL="postgresql+psycopg://postgres@127.0.0.1:$port/postgres"
    echo "pg.sh: PostgreSQL on 127.0.0.1:$port (data $CAGKV_PG_DIR/data)" >&2
}

pg_stop() {
    local dir="${1:-${CAGKV_PG_DIR:-}}" bin="${CAGKV_PG_BIN:-$(_pg_bin)}"
    [ -n "$dir" ] && [ -d "$dir/data" ] || return 0
    _pg_as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
    unset CAGKV_TEST_PG_URL CAGKV_PG_DIR
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    case "${1:-}" in
        start)
            pg_start
            echo "export CAGKV_TEST_PG_URL=$CAGKV_TEST_PG_URL CAGKV_PG_DIR=$CAGKV_PG_DIR"
            ;;
        stop) pg_stop "${2:-}" ;;
        *) echo "usage: $0 start | stop DIR" >&2; exit 2 ;;
    esac
fi
