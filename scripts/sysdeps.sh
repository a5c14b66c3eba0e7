#!/usr/bin/env bash
# The system programs `make test` starts itself on loopback: redis-server (the Redis streams), PostgreSQL 15
# (the service's futures database) and bubblewrap (the code sandbox). Installed here when they are missing
# and this is a root shell with apt-get (a fresh container, CI); otherwise one line says what to install,
# and `make test` stops before a long run that would fail on them.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ -x /usr/lib/postgresql/15/bin/postgres ] || missing+=(postgresql-15)
[ ${#missing[@]} -eq 0 ] && exit 0
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing the system packages the tests need: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    exit 0
fi
echo "make test needs ${missing[*]} (the tests start them on loopback), not installed here:" \
    "run \`sudo apt-get install ${missing[*]}\` (or your system's packages of them), then make test again" >&2
exit 2
