#!/usr/bin/env bash
# Make sure a headless Chromium is installed (tests/bench/test_html_report.py renders
# report.html in it). Idempotent: exits 0 at once when one is on PATH (or TURNSTILE_CHROMIUM
# names one). Installs Debian's `chromium` package with apt-get when run as root (CI runs as
# root); otherwise says how to install it. The binary's path is printed on the last line.
set -euo pipefail

if [[ -n "${TURNSTILE_CHROMIUM:-}" && -x "${TURNSTILE_CHROMIUM}" ]]; then
    echo "${TURNSTILE_CHROMIUM}"
    exit 0
fi
for name in chromium chromium-browser google-chrome headless_shell; do
    if command -v "$name" >/dev/null 2>&1; then
        command -v "$name"
        exit 0
    fi
done
if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[install_chromium] chromium is missing: install Debian's chromium package" \
         "(apt-get install chromium) or set TURNSTILE_CHROMIUM" >&2
    exit 1
fi
echo "[install_chromium] installing Debian's chromium with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends chromium >&2
command -v chromium
