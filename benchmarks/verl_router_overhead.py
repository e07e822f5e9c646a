"""The turnstile verl router's own cost per turn (acquire + release + the hook's reports), in
plain Python without Ray or verl: what the router actor spends per call, before the Ray RPC.

    PYTHONPATH=src python benchmarks/verl_router_overhead.py [--trajectories 2000] [--turns 5]
"""

from __future__ import annotations

import argparse
import time

from turnstile.integrations.verl_router import TurnstileRouter, tool_return


def per_turn_us(policy: str, servers: int, trajectories: int, turns: int, prompt: int) -> float:
    r = TurnstileRouter({f"10.0.0.{i}:8000": None for i in range(servers)}, {"policy": policy})
    prompts = [list(range(prompt + 60 * j)) for j in range(turns)]
    t0 = time.perf_counter()
    for i in range(trajectories):
        rid = f"t{i}"
        for j in range(turns):
            sid, _ = r.acquire_server(rid, prompt_ids=prompts[j])
            r.release_server(sid, request_id=rid)
            r.report_turn(rid, 50)
            if j < turns - 1:
                r.report_tool_returns(rid, [tool_return("bash", 30, "ok")])
        r.end_trajectory(rid)
    return (time.perf_counter() - t0) / (trajectories * turns) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    a = ap.parse_args()
    for policy in ("least-open", "cmlfq"):
        us = per_turn_us(policy, a.servers, a.trajectories, a.turns, a.prompt_tokens)
        print(f"{policy:>10}: {us:7.1f} us per turn ({a.servers} servers, {a.trajectories} "
              f"trajectories x {a.turns} turns, {a.prompt_tokens}-token prompts; real, no Ray)")


if __name__ == "__main__":
    main()
