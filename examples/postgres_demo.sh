#!/usr/bin/env bash
# The page-view demo on a throwaway local PostgreSQL instead of SQLite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup >/dev/null
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
dir=$(mktemp -d /tmp/kstore-pg.XXXXXX)
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
run=()
if [ "$(id -u)" = 0 ]; then chown postgres: "$dir"; run=(runuser -u postgres --); fi
cleanup() { "${run[@]}" "$bin/pg_ctl" -D "$dir/data" stop -m fast >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
"${run[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust >/dev/null
"${run[@]}" "$bin/pg_ctl" -D "$dir/data" -o "-p $port -k $dir -c listen_addresses=127.0.0.1" -l "$dir/log" -w start >/dev/null
echo "postgres_demo: PostgreSQL on 127.0.0.1:$port"
.venv/bin/python examples/demo.py --dsn "postgresql+psycopg2://postgres@127.0.0.1:$port/postgres" "$@"
