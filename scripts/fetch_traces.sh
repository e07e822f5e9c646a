#!/usr/bin/env bash
# Fetch every public trace the docs use, each at its pinned commit, into the loaders' layout
# (docs/traces.md). Usage: scripts/fetch_traces.sh [DIR] [--only NAME] [--git-base URL] [--force]
# DIR defaults to $TURNSTILE_TRACES, else traces/ in this checkout. Needs git, and a python3
# (>= 3.11) with turnstile's dependencies: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m turnstile.traces.fetch "$@"
