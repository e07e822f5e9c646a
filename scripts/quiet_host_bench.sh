#!/usr/bin/env bash
# The fidelity benchmark and the real-engine A/B on a many-core host with nothing else of
# ours running (the lent device machine: 16 CPUs; it proved noisier than hoped, docs/calibration.md
# §3 runs L-M), side by side, each on physical cores of its own:
#   fidelity: 3 cores (its two engines pinned one core each, the replay on the third);
#   A/B:      4 cores (its two engines one core each, gateway and clients on the other two).
# Each benchmark pins its engines inside the CPU set it is given (--pin-cores, taskset).
# The two share the host's caches and memory bandwidth, nothing else; the fidelity run's
# noise floor (real against its own rerun) shows what that costs.
#
#   OUT=/tmp/quiet TRACE=$TURNSTILE_TRACES/agentcgroup_swerebench_claude_code \
#       bash scripts/quiet_host_bench.sh
#
# Uses python3 with turnstile importable (a venv, or wheels in .whl/ installed to /tmp/site),
# TURNSTILE_LLAMA_SERVER or the cached build. Writes $OUT/{fid,ab}.tgz, their logs, lscpu.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT}"
TRACE="${TRACE:-${TURNSTILE_TRACES:-traces}/agentcgroup_swerebench_claude_code}"
LIMIT_S="${LIMIT_S:-540}"
PY="${PY:-python3}"
if [[ -d .whl ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD/src"
fi
export PYTHONUNBUFFERED=1
if [[ -z "${TURNSTILE_LLAMA_SERVER:-}" ]]; then
    TURNSTILE_LLAMA_SERVER="$(ls .cache/llama-server/*/llama-server | head -n 1)"
    export TURNSTILE_LLAMA_SERVER
fi
mkdir -p "$OUT"
{ lscpu; nproc; uptime; "$TURNSTILE_LLAMA_SERVER" --version 2>&1 | head -n 3; } > "$OUT/lscpu.txt"

# CPUs grouped by physical core (package, core id), in the order of their first CPU
read -r FID_CPUS AB_CPUS < <("$PY" - <<'EOF'
from turnstile.engines.llama_server import physical_cores
g = physical_cores()
if len(g) < 8:
    raise SystemExit(f"need 8 physical cores, found {len(g)}")
flat = lambda gs: ",".join(str(c) for x in gs for c in x)
# core 0 left to the system; fidelity on cores 1-3, the A/B on 5-8 (core 4 between them)
print(flat(g[1:4]), flat(g[5:9] if len(g) >= 9 else g[4:8]))
EOF
)
echo "fidelity on CPUs $FID_CPUS, A/B on CPUs $AB_CPUS" | tee -a "$OUT/lscpu.txt"

timeout "$LIMIT_S" taskset -c "$FID_CPUS" "$PY" benchmarks/fidelity.py --out "$OUT/fid" \
    --trace "$TRACE" --sessions 12 --rates 0.2,0.5,1.0 --noise-floor --pin-cores \
    ${FID_ARGS:-} > "$OUT/fid.log" 2>&1 &
FID=$!
timeout "$LIMIT_S" taskset -c "$AB_CPUS" "$PY" benchmarks/real_ab.py --out "$OUT/ab" \
    --trace "$TRACE" --pin-cores ${AB_ARGS:-} > "$OUT/ab.log" 2>&1 &
AB=$!
wait "$FID"; echo "fidelity exit $?" | tee -a "$OUT/lscpu.txt"
wait "$AB"; echo "A/B exit $?" | tee -a "$OUT/lscpu.txt"
for d in fid ab; do
    [[ -d "$OUT/$d" ]] && tar -C "$OUT" -czf "$OUT/$d.tgz" "$d" && rm -rf "${OUT:?}/$d"
done
tail -n 30 "$OUT/fid.log" "$OUT/ab.log"
