#!/usr/bin/env bash
# pg_ctl for pytest-postgresql when the tests run as root (as CI does).
#
# PostgreSQL refuses to run as root. Instead of running all of pytest as the
# postgres user (which then needs a virtualenv and checkout it can read), this
# wrapper runs only pg_ctl as postgres: it hands the data directory's parent to
# postgres and lets it traverse the (root-owned, 0700) pytest temp folders.
set -euo pipefail

real=$(ls -d /usr/lib/postgresql/*/bin/pg_ctl 2>/dev/null | sort -V | tail -n 1)
if [ -z "$real" ]; then
    real=$(command -v pg_ctl) || { echo "pg_ctl not found: install PostgreSQL (apt-get install postgresql)" >&2; exit 127; }
fi
if [ "$(id -u)" != 0 ]; then
    exec "$real" "$@"
fi

datadir=""
prev=""
for arg in "$@"; do
    case "$prev" in -D|--pgdata) datadir=$arg ;; esac
    case "$arg" in --pgdata=*) datadir=${arg#--pgdata=} ;; esac
    prev=$arg
done

# initdb with a password (pytest-postgresql's password=...): its --pwfile is a root-owned
# temporary file; postgres must be able to read it.
for arg in "$@"; do
    if [[ "$arg" =~ --pwfile=([^[:space:]\"\']+) ]]; then
        chown postgres: "${BASH_REMATCH[1]}"
    fi
done

if [ -n "$datadir" ]; then
    parent=$(dirname "$datadir")
    mkdir -p "$parent"
    chown postgres: "$parent"
    # Traversal only (o+x), not listing, on the folders above it.
    dir=$parent
    while [ "$dir" != "/" ]; do
        dir=$(dirname "$dir")
        chmod o+x "$dir"
    done
fi

cd /
exec runuser -u postgres -- "$real" "$@"
