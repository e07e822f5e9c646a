"""Turn throughput and P95 flow of the default policy against ``eager`` with more sessions
than slots, on two real llama.cpp engines (``-np 4`` each, the tiny random-weight model).

Each repetition runs ``--sessions`` keyed streaming sessions of ``--turns`` turns (closed loop,
``max_tokens`` 8) through a fresh gateway, alternating the policies, and prints one line per run
and the medians. Usage::

    TURNSTILE_LLAMA_SERVER=path/to/llama-server python benchmarks/slot_throughput.py --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from turnstile.engines.llama_server import LlamaServerProcess, find_llama_server
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.gateway.embedded import GatewayServer, start_gateway


def _session(url: str, sid: str, turns: int) -> float:
    """One closed-loop streaming session; returns its flow time (s)."""
    t0 = time.monotonic()
    messages = [{"role": "user", "content": f"{sid}: plan the work " + "step " * 20}]
    with httpx.Client(timeout=120) as client:
        for t in range(turns):
            body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": messages}
            with client.stream("POST", url, json=body, headers={"x-session-id": sid}) as r:
                r.raise_for_status()
                for _ in r.iter_lines():
                    pass
            messages = [*messages, {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": f"tool result {t}: " + "ok " * 10}]
    return time.monotonic() - t0


def run(gw: GatewayServer, sessions: int, turns: int, tag: str) -> tuple[float, float]:
    """(turns/s, P95 flow s) of one run."""
    url = gw.url + "/v1/chat/completions"
    t0 = time.monotonic()
    with ThreadPoolExecutor(sessions) as pool:
        flows = list(pool.map(lambda i: _session(url, f"{tag}-{i}", turns), range(sessions)))
    wall = time.monotonic() - t0
    return sessions * turns / wall, float(np.quantile(flows, 0.95))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--policies", default="eager,auto")
    args = ap.parse_args()
    binary = find_llama_server()
    if binary is None:
        raise SystemExit("no llama-server: set TURNSTILE_LLAMA_SERVER or run make engine")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_gguf(Path(tmp) / "tiny.gguf")
        engines = [LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1,
                                      binary=binary).start() for _ in range(2)]
        try:
            results: dict[str, list[tuple[float, float]]] = {}
            for rep in range(args.reps):
                for policy in args.policies.split(","):
                    gw = start_gateway([e.base_url for e in engines], policy=policy)
                    try:
                        tps, p95 = run(gw, args.sessions, args.turns, f"r{rep}-{policy}")
                    finally:
                        gw.stop()
                    results.setdefault(policy, []).append((tps, p95))
                    print(f"rep {rep} {policy:>8}: {tps:6.1f} turns/s  P95 flow {p95:6.2f} s",
                          flush=True)
            for policy, rs in results.items():
                print(f"median {policy:>8}: {statistics.median(r[0] for r in rs):6.1f} turns/s"
                      f"  P95 flow {statistics.median(r[1] for r in rs):6.2f} s")
        finally:
            for e in engines:
                e.stop()


if __name__ == "__main__":
    main()
