"""Engine-model speed: simulated iterations per wall second (a measurement, not a test).

    .venv/bin/python benchmarks/engine_speed.py [--seqs 256] [--iters 200000]

Scenario "decode": ``seqs`` requests with 512-token prompts decode 4k tokens each; whenever one
finishes, a new one is submitted, so the engine stays decode-heavy with periodic admissions.
Scenario "agentic": sessions whose turns extend their context (prefix hits, KV pressure,
preemption) on a KV cache sized to overflow.
"""

from __future__ import annotations

import argparse
import random
import time

from sim_speed import engine_decode  # the decode scenario, shared with sim_speed.py

from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest
from turnstile.sim.roofline_perf import RooflinePerf


def bench_agentic(sessions: int, turns: int, seed: int = 0) -> tuple[float, int, dict]:
    rng = random.Random(seed)
    perf = RooflinePerf("H100", "llama-3.1-8b")
    cfg = EngineConfig(num_gpu_blocks=20_000, num_cpu_blocks=20_000, max_num_seqs=128)
    eng = EngineModel("e0", cfg, perf)
    ctx = {f"s{i}": 0 for i in range(sessions)}
    left = dict.fromkeys(ctx, turns)
    pending: list[tuple[float, str]] = [(rng.random(), s) for s in ctx]
    now = 0.0
    n = 0
    t0 = time.perf_counter()
    while pending or eng.has_work():
        pending.sort()
        while pending and pending[0][0] <= now:
            _, s = pending.pop(0)
            prompt = ctx[s] + rng.randint(200, 4000)
            out_tokens = rng.randint(20, 600)
            eng.submit(SimRequest(n, s, prompt, out_tokens), now)
            ctx[s] = prompt + out_tokens
            n += 1
        out = eng.step(now)
        if out is None:
            now = pending[0][0]
            continue
        now += out.duration_s
        for req in out.finished:
            left[req.session] -= 1
            if left[req.session]:
                pending.append((now + rng.expovariate(1 / 5.0), req.session))
    wall = time.perf_counter() - t0
    return eng.iterations / wall, eng.iterations, eng.stats()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200_000)
    a = ap.parse_args()
    for seqs in (1, 32, a.seqs):
        r = engine_decode(seqs, a.iters)
        rate, its = r["iterations"] / r["wall_s"], r["iterations"]
        print(f"decode  seqs={seqs:4d}: {rate:10,.0f} iterations/s over {its:,} iterations")
    rate, its, st = bench_agentic(200, 20)
    print(
        f"agentic 200 sessions x 20 turns: {rate:10,.0f} iterations/s over {its:,} iterations "
        f"(hit {st['hit_tokens']:,} / prompt {st['prompt_tokens']:,} tokens, "
        f"preemptions {st['preemptions']}, recomputed {st['recomputed_tokens']:,})"
    )


if __name__ == "__main__":
    main()
