"""AIPerf (NVIDIA's load generator, nobody here wrote it) replays a turnstile export.

Agent sessions are exported as Mooncake-JSONL sessions (``traces convert --to mooncake``'s
writer) and replayed by ``aiperf profile --custom-dataset-type mooncake_trace`` — multi-turn,
with the recorded delays, no turnstile header — against two real llama.cpp engines through
``turnstile serve`` and through Envoy + ``turnstile epp``. Checked per path: the sessions arrive
as sessions (turnstile derives one per conversation: ``derived_sessions_total{how="new"}`` =
the sessions, ``continued`` = the later turns), and AIPerf's own report agrees with turnstile's
metrics on request counts and on the engines' output tokens.

AIPerf is large (transformers, pandas, ...): give it its own venv and pass ``--aiperf``::

    python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
    .venv/bin/python benchmarks/aiperf_replay.py --aiperf /tmp/aiperf-venv/bin/aiperf \\
        --out benchmarks/results/aiperf-replay

No model hub here: the script writes a small byte-level BPE tokenizer into a private HF cache
(``local/tiny``) for AIPerf's prompt synthesis (AIPerf 0.13 in offline mode resolves only cached
repo ids, not a local folder).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from turnstile.engines.llama_server import LlamaServerProcess, free_port, require_llama_server
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.epp.envoy import EnvoyProcess, envoy_config
from turnstile.gateway.embedded import start_gateway
from turnstile.testing.epp import PickerProcess
from turnstile.traces.mooncake_sessions import write_mooncake_sessions
from turnstile.workload.model import ToolCall, Turn, Workflow

REPO = Path(__file__).resolve().parents[1]
REV = "0" * 40

_TOKENIZER = r'''
import json, os, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out = sys.argv[1]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
text = ("the quick brown fox jumps over the lazy dog fix the failing test in the parser "
        "run the command and read the output then edit the file and try again ") * 200
tok.train_from_iterator([text], trainers.BpeTrainer(
    vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
os.makedirs(out, exist_ok=True)
tok.save(os.path.join(out, "tokenizer.json"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
           "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 100000},
          open(os.path.join(out, "tokenizer_config.json"), "w"))
'''


def sessions(n: int, turns: int, seed: int) -> list[Workflow]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ts, ctx = [], 0
        for k in range(turns):
            new = rng.randint(40, 120)
            tools = (ToolCall("bash", round(rng.uniform(0.1, 0.5), 3), "ok"),) \
                if k < turns - 1 else ()
            ts.append(Turn(new, 16, ctx, tools=tools))
            ctx += new + 16
        out.append(Workflow(f"agent-{i}", round(0.2 * i, 3), tuple(ts)))
    return out


def _series(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith(name):
            key, _, v = ln.rpartition(" ")
            out[key[len(name):] or "total"] = float(v)
    return out


def run_aiperf(aiperf: str, url: str, trace: Path, hf_home: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    cmd = [aiperf, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "chat",
           "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
           "--tokenizer", "local/tiny", "--artifact-dir", str(out), "--ui-type", "none",
           "--isl-block-size", "512"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"aiperf failed ({r.returncode}): {r.stdout[-3000:]}{r.stderr[-3000:]}")
    doc = json.loads((out / "profile_export_aiperf.json").read_text())

    def total(key: str) -> float | None:
        v = doc.get(key)
        return None if not isinstance(v, dict) else v.get("sum", v.get("avg"))

    return {"command": " ".join(cmd), "request_count": total("request_count"),
            "usage_completion_tokens": total("usage_completion_tokens"),
            "usage_prompt_tokens": total("usage_prompt_tokens"),
            "output_tokens_client_tokenizer": total("output_token_count"),
            "benchmark_duration_s": total("benchmark_duration"),
            "error_count": (doc.get("error_summary") or [])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aiperf", required=True, help="the aiperf executable (its own venv)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/aiperf-replay")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--paths", default="serve,epp")
    ap.add_argument("--policy", default="cvar+kv-affinity+ttl")
    args = ap.parse_args(argv)
    binary = require_llama_server()
    tmp = Path(tempfile.mkdtemp(prefix="turnstile-aiperf-"))
    hf = tmp / "hf"
    snap = hf / "hub" / "models--local--tiny" / "snapshots" / REV
    (hf / "hub" / "models--local--tiny" / "refs").mkdir(parents=True)
    (hf / "hub" / "models--local--tiny" / "refs" / "main").write_text(REV)
    py = str(Path(args.aiperf).parent / "python")
    subprocess.run([py, "-c", _TOKENIZER, str(snap)], check=True, timeout=300)
    wfs = sessions(args.sessions, args.turns, 0)
    trace = args.out / "agents.mooncake.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    n_calls = write_mooncake_sessions(trace, wfs)
    model = write_tiny_gguf(tmp / "tiny.gguf")
    engines = [LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1, binary=binary).start()
               for _ in range(2)]
    urls = [e.base_url for e in engines]
    results: dict[str, Any] = {}
    try:
        for path in [p for p in args.paths.split(",") if p]:
            if path == "serve":
                gw = start_gateway(urls, policy=args.policy, stats_interval_s=0.5)
                url, metrics_url, stop = gw.url, gw.url + "/metrics", gw.stop
            else:
                eps = [u.removeprefix("http://") for u in urls]
                pk = PickerProcess(eps, policy=args.policy)
                env = EnvoyProcess(envoy_config(listen_port=free_port(),
                                                picker_port=pk.grpc_port)).start()
                url, metrics_url = env.url, pk.metrics_url + "/metrics"

                def stop(env: EnvoyProcess = env, pk: PickerProcess = pk) -> None:
                    env.stop()
                    pk.stop()
            try:
                t0 = time.time()
                ai = run_aiperf(args.aiperf, url, trace, hf, args.out / f"aiperf-{path}")
                text = httpx.get(metrics_url, timeout=10).text
            finally:
                stop()
            derived = _series(text, "turnstile_gateway_derived_sessions_total")
            ours = {"requests": sum(_series(text, "turnstile_gateway_turns_finished_total")
                                    .values()),
                    "output_tokens": sum(_series(text, "turnstile_gateway_output_tokens_total")
                                         .values()),
                    "derived_sessions": derived}
            agree = {"sessions_as_sessions":
                     derived.get('{how="new"}') == args.sessions
                     and derived.get('{how="continued"}') == n_calls - args.sessions,
                     "request_count": ai["request_count"] == ours["requests"] == n_calls,
                     "output_tokens": ai["usage_completion_tokens"] == ours["output_tokens"]}
            results[path] = {"aiperf": ai, "turnstile": ours, "agree": agree,
                             "wall_s": round(time.time() - t0, 1)}
            print(f"{path}: aiperf {ai['request_count']:.0f} requests, "
                  f"{ai['usage_completion_tokens']:.0f} output tokens (engine usage); turnstile "
                  f"{ours['requests']:.0f} turns, {ours['output_tokens']:.0f} output tokens, "
                  f"derived sessions {derived}; agree: {agree}")
    finally:
        for e in engines:
            e.stop()
    doc = {"benchmark": "aiperf_replay", "sessions": args.sessions, "turns": args.turns,
           "calls": n_calls, "policy": args.policy, "results": results,
           "command": " ".join(sys.argv), "loadavg": os.getloadavg()}
    (args.out / "aiperf_replay.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out / 'aiperf_replay.json'}")
    return 0 if all(all(r["agree"].values()) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
