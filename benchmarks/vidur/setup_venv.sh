#!/usr/bin/env bash
# Create the throwaway Vidur venv used by benchmarks/sim_speed.py --vidur (never a turnstile
# dependency; lives outside the repository). Usage: benchmarks/vidur/setup_venv.sh [VENV]
set -euo pipefail
VENV="${1:-/tmp/vidur-venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "vidur==0.0.26"
"$VENV/bin/python" -c "import vidur, sklearn, pandas; print('vidur ready in $VENV')"
