#!/usr/bin/env bash
# Make sure Redis's `redis-server` is installed (the gateway's shared state for several
# replicas; the tests start and stop their own on 127.0.0.1). Idempotent: exits 0 at once when
# it is on PATH (or TURNSTILE_REDIS_SERVER names one). Installs Debian's `redis-server` package
# with apt-get when run as root (CI runs as root); otherwise says how to install it.
# The binary's path is printed on the last line of stdout.
set -euo pipefail

if [[ -n "${TURNSTILE_REDIS_SERVER:-}" && -x "${TURNSTILE_REDIS_SERVER}" ]]; then
    echo "${TURNSTILE_REDIS_SERVER}"
    exit 0
fi
if command -v redis-server >/dev/null 2>&1; then
    command -v redis-server
    exit 0
fi
if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[install_redis] redis-server is missing: install Debian's redis-server package" \
         "(apt-get install redis-server) or set TURNSTILE_REDIS_SERVER" >&2
    exit 1
fi
echo "[install_redis] installing Debian's redis-server with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends redis-server >&2
command -v redis-server
