#!/usr/bin/env bash
# Simulator fidelity against vLLM on one NVIDIA GPU: start vLLM with a small model, profile it
# (turnstile profile), replay a scaled AgentCgroup slice for real and in the simulator
# (turnstile fidelity), and write the report. Not run in CI.
#
#   benchmarks/gpu/run_vllm_fidelity.sh [MODEL] [OUT_DIR]
#
# MODEL: a local model directory (no hub access needed) or a model name vLLM can load
#        (default Qwen/Qwen3-8B, which is also in turnstile's models.json for the roofline).
# OUT_DIR: default benchmarks/results/fidelity-vllm.
# Environment knobs: PYTHON, PORT, MAX_NUM_SEQS, MAX_BATCHED_TOKENS, MAX_MODEL_LEN, GPU_UTIL,
# TRACE, SESSIONS, RATES, TOKEN_DIV, OUTPUT_DIV, MAX_OUTPUT, TOOL_DIV, MAX_CONTEXT, MAX_TURNS,
# ROOFLINE_GPU (default: from nvidia-smi), VLLM_EXTRA (extra `vllm serve` arguments).
set -euo pipefail

MODEL="${1:-Qwen/Qwen3-8B}"
OUT="${2:-benchmarks/results/fidelity-vllm}"
PYTHON="${PYTHON:-python}"
PORT="${PORT:-8011}"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-64}"
MAX_BATCHED_TOKENS="${MAX_BATCHED_TOKENS:-4096}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-16384}"
GPU_UTIL="${GPU_UTIL:-0.85}"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
TRACE="${TRACE:-${TURNSTILE_TRACES:-$REPO/traces}/agentcgroup_swerebench_claude_code}"
SESSIONS="${SESSIONS:-24}"
RATES="${RATES:-1,2,4}"
TOKEN_DIV="${TOKEN_DIV:-4}"
OUTPUT_DIV="${OUTPUT_DIV:-4}"
MAX_OUTPUT="${MAX_OUTPUT:-256}"
TOOL_DIV="${TOOL_DIV:-4}"
MAX_CONTEXT="${MAX_CONTEXT:-12000}"
MAX_TURNS="${MAX_TURNS:-10}"
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"

# the turnstile CLI when wired in, else the calibration module standalone
if command -v turnstile >/dev/null && turnstile profile --help >/dev/null 2>&1; then
  TS=(turnstile)
else
  TS=("$PYTHON" -m turnstile.calibrate.cli)
fi

# roofline comparison: this GPU (by nvidia-smi name) and the model (models.json or config.json)
if [[ -z "${ROOFLINE_GPU:-}" ]]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" in
    *H200*) ROOFLINE_GPU=H200 ;;
    *H100*) ROOFLINE_GPU=H100-SXM ;;
    *A100*) ROOFLINE_GPU=A100-80G ;;
    *L40S*) ROOFLINE_GPU=L40S ;;
    *) ROOFLINE_GPU="" ;;
  esac
fi
ROOFLINE=()
if [[ -n "$ROOFLINE_GPU" ]]; then
  ROOFLINE=(--roofline-gpu "$ROOFLINE_GPU" --roofline-model "$MODEL")
fi

# vLLM: prefix caching on, cached-token counts in usage when this version can report them
EXTRA=()
if vllm serve --help=all 2>/dev/null | grep -q -- "--enable-prompt-tokens-details"; then
  EXTRA+=(--enable-prompt-tokens-details)
fi
# shellcheck disable=SC2206
EXTRA+=(${VLLM_EXTRA:-})
vllm serve "$MODEL" --port "$PORT" --max-num-seqs "$MAX_NUM_SEQS" \
  --max-num-batched-tokens "$MAX_BATCHED_TOKENS" --max-model-len "$MAX_MODEL_LEN" \
  --gpu-memory-utilization "$GPU_UTIL" --enable-prefix-caching "${EXTRA[@]}" \
  >"$OUT/vllm.log" 2>&1 &
VLLM_PID=$!
trap 'kill "$VLLM_PID" 2>/dev/null || true; wait "$VLLM_PID" 2>/dev/null || true' EXIT

echo "waiting for vLLM ($MODEL) on $URL ..." >&2
for _ in $(seq 1 600); do
  if curl -sf "$URL/health" >/dev/null && curl -sf "$URL/v1/models" >/dev/null; then break; fi
  if ! kill -0 "$VLLM_PID" 2>/dev/null; then
    echo "vLLM exited during start-up; see $OUT/vllm.log" >&2; tail -n 30 "$OUT/vllm.log" >&2; exit 1
  fi
  sleep 1
done
curl -sf "$URL/v1/models" >/dev/null || { echo "vLLM not ready after 600 s" >&2; exit 1; }

"${TS[@]}" profile --target "$URL" --out "$OUT/profile.json" --chunk "$MAX_BATCHED_TOKENS" \
  --max-seqs "$MAX_NUM_SEQS" --max-context "$((MAX_CONTEXT < MAX_MODEL_LEN ? MAX_CONTEXT : MAX_MODEL_LEN - 64))" \
  --repeats 2 --token-low 1000 --token-high 20000

"${TS[@]}" fidelity --target "$URL" --profile "$OUT/profile.json" --trace "$TRACE" --out "$OUT" \
  --max-num-seqs "$MAX_NUM_SEQS" --chunk "$MAX_BATCHED_TOKENS" --sessions "$SESSIONS" \
  --rates "$RATES" --token-div "$TOKEN_DIV" --output-div "$OUTPUT_DIV" --max-output "$MAX_OUTPUT" \
  --tool-div "$TOOL_DIV" --max-context "$MAX_CONTEXT" --max-turns "$MAX_TURNS" "${ROOFLINE[@]}" \
  --token-low 1000 --token-high 20000 --noise-floor

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" || true
"$PYTHON" -c "import vllm; print('vllm', vllm.__version__)" >>"$OUT/gpu.txt" 2>/dev/null || true
echo "report: $OUT/fidelity.md" >&2
cat "$OUT/fidelity.md"
