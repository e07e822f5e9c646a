"""AIPerf (a load generator nobody here wrote) replays a turnstile export through
``turnstile serve`` in front of two real llama.cpp engines, and its own report is checked
against turnstile's.

1. sessions: the packaged AgentCgroup fit (``turnstile synth``'s), scaled to the tiny engines,
   with their tool time kept as the delay between turns;
2. exported with turnstile's Mooncake-JSONL writer (what ``turnstile traces convert --to
   mooncake`` writes) to ``export.jsonl``, then rewritten to the semantics AIPerf's
   multi-turn Mooncake loader expects (``aiperf.jsonl``): AIPerf keeps the conversation's
   history itself and reads each row's ``input_length`` as the *new* tokens of that turn, where
   turnstile's writer has the whole prompt (:func:`to_aiperf_rows`); ``hash_ids`` are left out
   (AIPerf reads them per row as the new text's blocks);
3. ``aiperf profile --custom-dataset-type mooncake_trace --fixed-schedule`` against the gateway
   (streamed chat, a local tokenizer, ``--use-server-token-count``), no header added:
   the gateway derives the sessions from the conversation itself;
4. the gateway records every finished session (``[gateway] record``); the check compares
   AIPerf's conversations, requests, input and output tokens with the recording and the
   gateway's Prometheus counters, and writes ``aiperf_drive.json``/``.md`` to ``--out``.

    TURNSTILE_LLAMA_SERVER=... PYTHONPATH=src .venv/bin/python benchmarks/aiperf_drive.py \
        --aiperf /tmp/aiperf-venv/bin/aiperf --out benchmarks/results/aiperf
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def to_aiperf_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """turnstile's Mooncake records as AIPerf's multi-turn loader reads them. The writer already
    uses AIPerf's semantics (a session's first row: the whole prompt; every later row: the
    tokens the turn adds after the previous prompt and reply); this keeps at least 1 new token
    per row and drops ``hash_ids`` and the sub-agent fields (``parent_session_id``,
    ``parent_turn``, ``wait_for``): AIPerf replays chains."""
    out = []
    for r in records:
        row: dict[str, Any] = {"session_id": str(r["session_id"])}
        for key in ("timestamp", "delay"):
            if key in r:
                row[key] = r[key]
        row["input_length"] = max(1, int(r["input_length"]))
        row["output_length"] = int(r["output_length"])
        out.append(row)
    return out


def _metrics(url: str) -> dict[str, float]:
    from turnstile.gateway.adapters import parse_prometheus

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_prometheus(r.read().decode())


def _sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


def aiperf_summary(artifacts: Path) -> dict[str, Any]:
    """Requests, conversations and token totals from AIPerf's own per-request export."""
    recs = [json.loads(x) for p in sorted(artifacts.rglob("profile_export.jsonl"))
            for x in p.read_text().splitlines() if x.strip()]
    isl = osl = 0
    convs: dict[str, int] = {}
    errors = 0
    for r in recs:
        meta = r.get("metadata") or {}
        m = r.get("metrics") or {}
        if r.get("error"):
            errors += 1
        isl += int((m.get("input_sequence_length") or {}).get("value") or 0)
        osl += int((m.get("output_sequence_length") or {}).get("value") or 0)
        cid = str(meta.get("conversation_id") or meta.get("x_correlation_id") or "")
        convs[cid] = convs.get(cid, 0) + 1
    return {"requests": len(recs), "errors": errors, "input_tokens": isl,
            "output_tokens": osl, "conversations": len(convs),
            "turns_per_conversation": sorted(convs.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "aiperf")
    ap.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--max-turns", type=int, default=5)
    ap.add_argument("--policy", default="cvar")
    ap.add_argument("--via", choices=("serve", "epp"), default="serve",
                    help="turnstile serve, or turnstile epp behind Envoy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)

    from turnstile.calibrate.ab import AbEngines, _no_think, policy_spec
    from turnstile.calibrate.ab_engines import reset_kv
    from turnstile.calibrate.ab_real import gateway_toml
    from turnstile.calibrate.fidelity import TraceScale, scale_workflow
    from turnstile.engines.llama_server import LlamaServerProcess, free_port, require_llama_server
    from turnstile.engines.tiny_hf_model import write_tiny_hf_model
    from turnstile.engines.tiny_model import write_tiny_gguf
    from turnstile.traces import load_trace
    from turnstile.traces.mooncake_sessions import mooncake_records, write_mooncake_sessions
    from turnstile.transport.blocking import wait_ready
    from turnstile.workload import synth

    require_llama_server()
    args.out.mkdir(parents=True, exist_ok=True)
    scale = TraceScale(token_div=32.0, output_div=8.0, max_output=16, tool_div=20.0,
                       max_tool_s=0.5, max_context=700, max_turns=args.max_turns)
    sessions = []
    for wf in synth.generate(synth.DEFAULT_SPEC, 40 * args.sessions, args.seed):
        s = scale_workflow(wf, scale)
        if s is not None and len(s.turns) >= 3:
            sessions.append(_no_think(s.shifted(0.4 * len(sessions))))
        if len(sessions) == args.sessions:
            break
    export = args.out / "export.jsonl"
    write_mooncake_sessions(export, sessions)  # what `traces convert --to mooncake` writes
    rows = to_aiperf_rows(mooncake_records(sessions))
    feed = args.out / "aiperf.jsonl"
    feed.write_text("".join(json.dumps(r) + "\n" for r in rows))

    tmp = Path(tempfile.mkdtemp(prefix="turnstile-aiperf-"))
    model = write_tiny_gguf(tmp / "model.gguf", hidden=256, layers=4, ffn=512, heads=4,
                            kv_heads=2)
    servers = [LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1,
                                  slot_save_dir=tmp / f"slots{i}") for i in range(2)]
    gw = None
    envoy = None
    try:
        for s in servers:
            s.start()
        urls = [s.base_url for s in servers]
        reset_kv("llamacpp", urls, 4)
        engines = AbEngines(count=2, n_parallel=4, ctx=8192)
        port = free_port()
        record = tmp / "recorded.jsonl"
        toml = gateway_toml(policy_spec(args.policy), urls, engines, port=port,
                            session_idle_s=3.0, params={})
        toml = toml.replace("[gateway]\n", f'[gateway]\nrecord = "{record}"\n', 1)
        cfg = tmp / "gw.toml"
        cfg.write_text(toml)
        log = open(args.out / "gateway.log", "wb")  # noqa: SIM115
        if args.via == "serve":
            gw = subprocess.Popen([sys.executable, "-m", "turnstile.gateway", "serve",
                                   "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
            gw_url = metrics_url = f"http://127.0.0.1:{port}"
        else:  # turnstile epp behind Envoy (ORIGINAL_DST cluster), the same TOML
            from turnstile.epp.envoy import EnvoyProcess, envoy_config

            grpc, mport = free_port(), free_port()
            cmd = [sys.executable, "-m", "turnstile", "epp", "--config", str(cfg), "--policy",
                   policy_spec(args.policy), "--grpc-port", str(grpc), "--metrics-port",
                   str(mport)]
            for u in urls:
                cmd += ["--endpoint", u.removeprefix("http://")]
            gw = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            metrics_url = f"http://127.0.0.1:{mport}"
        if wait_ready(metrics_url + "/health", timeout_s=60, process=gw, poll_s=0.2) != "ready":
            raise SystemExit(f"the gateway did not start (log: {args.out / 'gateway.log'})")
        if args.via == "epp":
            envoy = EnvoyProcess(envoy_config(listen_port=free_port(), picker_port=grpc))
            envoy.start()
            gw_url = envoy.url
        before = _metrics(metrics_url)
        art = tmp / "artifacts"
        # AIPerf's `builtin` tokenizer downloads its BPE; a local HF tokenizer needs no network
        # (it only sizes AIPerf's synthesized prompts: the counts compared are the server's)
        tok = write_tiny_hf_model(tmp / "hf", hidden=64, layers=1, ffn=128)
        cmd = [args.aiperf, "profile", "--model", "tiny", "--url", gw_url,
               "--endpoint-type", "chat", "--streaming", "--input-file", str(feed),
               "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
               "--tokenizer", str(tok), "--use-server-token-count",
               "--random-seed", str(args.seed), "--artifact-dir", str(art),
               "--ui-type", "none", "--no-auto-plot"]
        t0 = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        wall = time.time() - t0
        (args.out / "aiperf.log").write_text(res.stdout[-20000:] + res.stderr[-20000:])
        if res.returncode != 0:
            print(res.stdout[-3000:], res.stderr[-3000:])
            raise SystemExit(f"aiperf exited {res.returncode}")
        time.sleep(3.0 + 2.0)  # sessions close after session_idle_s; then they are recorded
        after = _metrics(metrics_url)
        if envoy is not None:
            envoy.stop()
        gw.terminate()
        gw.wait(15)
        log.close()
        ap_sum = aiperf_summary(art)
        for p in art.rglob("profile_export_aiperf.json"):  # AIPerf's own aggregated report
            rep = json.loads(p.read_text())
            ap_sum["report"] = {k: (rep.get(k) or {}).get("avg")
                                for k in ("request_count", "total_isl", "total_osl")}
        for name in ("profile_export_aiperf.json", "profile_export_aiperf.csv"):
            for p in art.rglob(name):
                shutil.copy(p, args.out / name)
        recorded = load_trace(record).workflows if record.exists() else []
        shutil.copy(record, args.out / "recorded.jsonl") if record.exists() else None
        by_sid: dict[str, int] = {}
        for w in recorded:  # a session the gateway reopened is written again as "<id>~2"
            sid = str((w.meta or {}).get("session_id") or w.id)
            by_sid[sid] = by_sid.get(sid, 0) + len(w.turns)
        ts = {
            "sessions_recorded": len(by_sid),
            "turns_per_session": sorted(by_sid.values()),
            "recording_workflows": len(recorded),
            "recording_turns_per_workflow": sorted(len(w.turns) for w in recorded),
            "turns_recorded": sum(len(w.turns) for w in recorded),
            "prompt_tokens_recorded": sum(t.prompt_tokens for w in recorded for t in w.turns),
            "output_tokens_recorded": sum(t.output_tokens for w in recorded for t in w.turns),
            "requests_metric": _sum(after, "turnstile_gateway_requests_total")
            - _sum(before, "turnstile_gateway_requests_total"),
            "turns_finished_metric": _sum(after, "turnstile_gateway_turns_finished_total")
            - _sum(before, "turnstile_gateway_turns_finished_total"),
            "output_tokens_metric": _sum(after, "turnstile_gateway_output_tokens_total")
            - _sum(before, "turnstile_gateway_output_tokens_total"),
        }
        trace = {"sessions": len(sessions),
                 "turns_per_session": sorted(len(w.turns) for w in sessions),
                 "requests": len(rows)}
        doc = {"trace": trace, "aiperf": ap_sum, "turnstile": ts, "aiperf_wall_s": round(wall, 1),
               "command": " ".join(cmd), "policy": args.policy, "via": args.via}
        doc["agree"] = {
            "sessions": ts["sessions_recorded"] == ap_sum["conversations"] == trace["sessions"],
            "turns_per_session": ts["turns_per_session"] == ap_sum["turns_per_conversation"]
            == trace["turns_per_session"],
            "report": ap_sum.get("report") == {"request_count": ap_sum["requests"],
                                               "total_isl": ap_sum["input_tokens"],
                                               "total_osl": ap_sum["output_tokens"]},
            "requests": ap_sum["requests"] == ts["turns_finished_metric"]
            == ts["turns_recorded"],
            "input_tokens": ap_sum["input_tokens"] == ts["prompt_tokens_recorded"],
            "output_tokens": ap_sum["output_tokens"] == ts["output_tokens_metric"],
        }
        (args.out / "aiperf_drive.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc, indent=1))
    finally:
        if envoy is not None:
            envoy.stop()
        if gw is not None and gw.poll() is None:
            gw.kill()
        for s in servers:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(doc["agree"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
