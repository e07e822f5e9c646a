#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` from the llama.cpp vendored in the llama-cpp-python
# source package, and cache it under .cache/llama-server/<version>/llama-server.
#
# Idempotent: when the cached binary exists and answers `--version`, exits 0 at once.
# TURNSTILE_LLAMA_SERVER, when set to an executable, overrides everything.
# The binary's path is printed on the last line of stdout; progress goes to stderr.
#
# Environment:
#   TURNSTILE_LLAMA_SERVER   use this binary instead of building
#   LLAMA_CPP_PYTHON_VERSION source package version (default 0.3.36)
#   BUILD_JOBS               parallel compile jobs (default 2)
#   PYTHON                   python used for pip (default python3)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${BUILD_JOBS:-2}"
PYTHON="${PYTHON:-python3}"

log() { echo "[build_llama_server] $*" >&2; }

pick_python() {
    # A venv made without pip (e.g. by uv) cannot `pip download`: fall back to python3.
    if ! "${PYTHON}" -m pip --version >/dev/null 2>&1; then
        log "${PYTHON} has no pip; using python3"
        PYTHON=python3
    fi
}

if [[ -n "${TURNSTILE_LLAMA_SERVER:-}" ]]; then
    if [[ -x "${TURNSTILE_LLAMA_SERVER}" ]]; then
        echo "${TURNSTILE_LLAMA_SERVER}"
        exit 0
    fi
    log "TURNSTILE_LLAMA_SERVER=${TURNSTILE_LLAMA_SERVER} is not an executable file"
    exit 1
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${REPO_ROOT}/.cache/llama-server/${VERSION}"
BIN="${OUT_DIR}/llama-server"

if [[ -x "${BIN}" ]] && "${BIN}" --version >/dev/null 2>&1; then
    log "cached binary is usable"
    echo "${BIN}"
    exit 0
fi

pick_python

# Tools: cmake >= 3.14 and ninja; fall back to pip-installed ones when missing.
if ! command -v cmake >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; then
    log "cmake or ninja missing; installing them with ${PYTHON} -m pip"
    "${PYTHON}" -m pip install --quiet cmake ninja >&2
    PY_BIN="$("${PYTHON}" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
    export PATH="${PY_BIN}:${HOME}/.local/bin:${PATH}"
fi
command -v cmake >/dev/null 2>&1 || { log "cmake not found"; exit 1; }
command -v ninja >/dev/null 2>&1 || { log "ninja not found"; exit 1; }
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
    || { log "no C++ compiler found (install g++)"; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
cleanup() { rm -rf "${WORK}"; }
trap cleanup EXIT

start=$(date +%s)
log "downloading llama-cpp-python==${VERSION} source into ${WORK}"
"${PYTHON}" -m pip download --quiet --no-deps --no-binary :all: \
    --dest "${WORK}/dl" "llama-cpp-python==${VERSION}" >&2
SDIST="$(ls "${WORK}"/dl/llama_cpp_python-*.tar.gz "${WORK}"/dl/llama-cpp-python-*.tar.gz \
    2>/dev/null | head -n1 || true)"
[[ -n "${SDIST}" ]] || { log "source package not found after download"; exit 1; }
mkdir -p "${WORK}/src"
tar -xzf "${SDIST}" -C "${WORK}/src"
LLAMA_SRC="$(ls -d "${WORK}"/src/*/vendor/llama.cpp | head -n1)"
[[ -f "${LLAMA_SRC}/CMakeLists.txt" ]] || { log "vendored llama.cpp not found"; exit 1; }

log "configuring ${LLAMA_SRC}"
cmake -S "${LLAMA_SRC}" -B "${WORK}/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_CURL=OFF >&2

log "building llama-server with -j${JOBS}"
cmake --build "${WORK}/build" --target llama-server -j "${JOBS}" >&2

BUILT="$(find "${WORK}/build" -type f -name llama-server -perm -u+x | head -n1)"
[[ -n "${BUILT}" ]] || { log "llama-server binary not produced"; exit 1; }

mkdir -p "${OUT_DIR}"
# Copy then rename so a concurrent reader never sees a half-written binary.
cp "${BUILT}" "${BIN}.tmp.$$"
chmod +x "${BIN}.tmp.$$"
mv -f "${BIN}.tmp.$$" "${BIN}"
"${BIN}" --version >&2 2>&1 || { log "built binary does not run"; exit 1; }
log "built in $(( $(date +%s) - start )) s"
echo "${BIN}"
