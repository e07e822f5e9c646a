"""Gateway replicas sharing a Redis state: requests/s and added latency with 1, 2 and 3
replicas against the zero-cost engine.

Processes: the zero-cost fake engine (no delays, pre-serialized answers), a redis-server on a
loopback port, and N gateway replicas (``turnstile gateway serve --state redis://...``); the load
generator (this process) spreads its keep-alive connections over the replicas round-robin, as a
plain L4 balancer would. Measured per N:

* throughput with ``--concurrency`` clients for ``--seconds``: requests/s through the replicas,
  and their CPU time per request (summed over replicas);
* latency, closed loop with one client: P50/P99 direct and through one replica, and the
  difference — the added latency per hop, with the Redis round trips a request costs (session
  lookup, accepted turn written before forwarding).

For reference, one replica with no shared state (``--state`` unset) is measured the same way.
Goals (issue 13): throughput ≥ 1.7× from 1 to 2 replicas; added P50 ≤ 2 ms per hop with Redis.

    .venv/bin/python benchmarks/gateway_replicas.py --out benchmarks/results/gateway_replicas
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_overhead as go

from turnstile.testing.redis_server import RedisServer
from turnstile.testing.replicas import GatewayProcess, write_config

REPO = Path(__file__).resolve().parents[1]


def spread_load(ports: list[int], *, concurrency: int, seconds: float,
                warmup: int = 50) -> dict[str, Any]:
    """``concurrency`` closed-loop clients, client i on replica i mod N."""
    reqs = {p: go.request_bytes(p, False, 16) for p in ports}

    async def main() -> tuple[list[float], float, int]:
        for p in ports:
            await go._client(p, reqs[p], [], time.perf_counter() + 10, warmup)
        lat: list[float] = []
        t0 = time.perf_counter()
        errs = await asyncio.gather(*(
            go._client(ports[i % len(ports)], reqs[ports[i % len(ports)]], lat,
                       t0 + seconds, None) for i in range(concurrency)))
        return lat, time.perf_counter() - t0, sum(errs)

    lat, wall, errors = asyncio.run(main())
    a = np.array(lat) * 1e3
    return {"requests": len(lat), "errors": errors, "wall_s": wall, "rps": len(lat) / wall,
            "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


def measure(name: str, fake: go.Proc, gws: list[GatewayProcess], args: argparse.Namespace
            ) -> dict[str, Any]:
    ports = [g.port for g in gws]
    cpu0 = [g.cpu_s() for g in gws]
    t = spread_load(ports, concurrency=args.concurrency, seconds=args.seconds)
    cpu = sum(g.cpu_s() - c for g, c in zip(gws, cpu0, strict=True))
    direct = go.run_load(fake.port, concurrency=1, seconds=120, n=args.requests, warmup=20)
    hop = go.run_load(gws[0].port, concurrency=1, seconds=120, n=args.requests, warmup=20)
    return {"setup": name, "replicas": len(gws), "throughput": t,
            "cpu_ms_per_request": 1e3 * cpu / max(t["requests"], 1),
            "latency_direct": direct, "latency_via_replica": hop,
            "added_p50_ms": hop["p50_ms"] - direct["p50_ms"],
            "added_p99_ms": hop["p99_ms"] - direct["p99_ms"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gateway_replicas")
    ap.add_argument("--replicas", default="1,2,3")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--requests", type=int, default=1000, help="latency samples per setup")
    ap.add_argument("--policy", default="eager")
    args = ap.parse_args(argv)
    console = Console()
    rows: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="gw-replicas-"))
    fake = go.Proc(["--serve-fake", str(p := go.free_port())], p)
    try:
        with RedisServer() as redis:
            setups: list[tuple[str, int, dict[str, Any]]] = [("no shared state", 1, {})]
            setups += [(f"{n} × Redis", n, {"state": redis.url})
                       for n in (int(x) for x in args.replicas.split(","))]
            for k, (name, n, extra) in enumerate(setups):
                cfg = write_config(tmp / f"gw{k}.toml", [(fake.url, "openai")], args.policy,
                                   None, stats_interval_s=0.0, max_held=100_000, **extra)
                gws = [GatewayProcess(cfg, replica_id=f"bench{k}-{i}").start()
                       for i in range(n)]
                try:
                    console.print(f"{name}: {n} replica(s) {[g.url for g in gws]}")
                    rows.append(measure(name, fake, gws, args))
                finally:
                    for g in gws:
                        g.close()
    finally:
        fake.stop()
    out = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "load_average_before": load0, "load_average_after": os.getloadavg(),
           "policy": args.policy, "concurrency": args.concurrency, "rows": rows}
    base = next((r for r in rows if r["setup"] == "1 × Redis"), None)
    table = Table(title="gateway replicas on loopback, zero-cost engine", header_style="bold")
    for col in ("setup", "req/s", "× 1 replica", "CPU ms/req", "P50 direct", "P50 via replica",
                "added P50", "added P99"):
        table.add_column(col, justify="right")
    for r in rows:
        scale = r["throughput"]["rps"] / base["throughput"]["rps"] if base else float("nan")
        r["scaling_vs_1_replica"] = scale
        table.add_row(r["setup"], f"{r['throughput']['rps']:,.0f}", f"{scale:.2f}",
                      f"{r['cpu_ms_per_request']:.3f}",
                      f"{r['latency_direct']['p50_ms']:.3f}",
                      f"{r['latency_via_replica']['p50_ms']:.3f}",
                      f"{r['added_p50_ms']:+.3f}", f"{r['added_p99_ms']:+.3f}")
    console.print(table)
    console.print(f"load average before {load0}, after {out['load_average_after']} "
                  f"({os.cpu_count()} CPUs shared by every process above)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gateway_replicas.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
