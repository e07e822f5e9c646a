"""Rollout benchmarks (all simulated): makespan by router, RL throughput with the planner, speed.

    .venv/bin/python benchmarks/rollout_bench.py [--steps 8] [--rl-steps 10] [--out DIR]

1. **Rollout-step makespan** of ``cmlfq`` vs ``load-balance`` (with and without per-trajectory
   stickiness) vs ``length-predict`` on long-tailed batches, on fixed bucketed mixes (Libra's
   setting: the GPUs all roll out), with the critical-path lower bound of each step (the longest
   trajectory alone on the mix's fastest engine: no router can beat it). Tool latencies as
   fitted to the traces (``tool x1``) and 10× faster (``tool x0.1``, sandboxed tools).
2. **End-to-end RL throughput**: the planner (per-step split and mix, elastic moves) vs every
   static split in a grid (the best one in hindsight and a typical half/half one), one-step
   off-policy (rollout of step k overlaps training of step k−1).
3. **Simulator speed**: the rollout simulator's leaping engine vs ``sim.engine.EngineModel``
   stepped iteration by iteration, on the same decode-heavy engine.

Prints markdown tables and the commands; ``--out`` also writes ``rollout_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from turnstile.rollout.experiment import make_router
from turnstile.rollout.planner import Plan, PlannerConfig, RLLoop, best_static
from turnstile.rollout.sim import SimConfig, parse_mix, simulate_batch
from turnstile.rollout.workload import RolloutSpec, RolloutTrajectory, RolloutWorkload
from turnstile.sim.perf import RooflinePerf

POLICIES = ("least-open", "least-open:nosticky", "length-predict", "cmlfq", "cmlfq-adaptive")


def critical_path_s(batch: list[RolloutTrajectory], cfg: SimConfig, tp: int) -> float:
    """The longest trajectory alone on a ``tp`` engine: prefill of each turn's new input,
    decode at batch 1, and its tool time (a lower bound on the step's makespan)."""
    perf = RooflinePerf(cfg.gpu, cfg.model, tp)
    best = 0.0
    for tr in batch:
        t = 0.0
        for turn in tr.workflow.turns:
            t += perf.step_time(turn.input_tokens, 0, turn.context_tokens,
                                turn.input_tokens * (turn.input_tokens + 1) / 2)
            t += turn.output_tokens * perf.step_time(
                0, 1, turn.prompt_tokens + turn.output_tokens // 2)
            t += turn.tool_duration_s
        best = max(best, t)
    return best


def makespan_bench(steps: int, mixes: list[str], scales: list[float]) -> list[dict[str, Any]]:
    rows = []
    cfg = SimConfig()
    for scale in scales:
        wl = RolloutWorkload(RolloutSpec(tool_time_scale=scale))
        batches = [wl.batch(k) for k in range(steps)]
        for mix_s in mixes:
            mix = parse_mix(mix_s)
            tp_max = max(b.tp for b in mix)
            lb = [critical_path_s(b, cfg, tp_max) for b in batches]
            row: dict[str, Any] = {"tool_scale": scale, "mix": mix_s,
                                   "lower_bound_s": sum(lb) / len(lb), "policies": {}}
            for pol in POLICIES:
                router = make_router(pol)  # one router across steps: it learns
                ms, wall = [], 0.0
                for b in batches:
                    res, _, w = simulate_batch(b, mix, router, cfg)
                    ms.append(res.makespan_s)
                    wall += w
                row["policies"][pol] = {"mean_makespan_s": sum(ms) / len(ms),
                                        "makespan_s": ms, "wall_s": wall}
                print(f"  tool x{scale} {mix_s} {pol}: {sum(ms) / len(ms):,.0f} s "
                      f"({wall:.1f} s wall)", file=sys.stderr)
            rows.append(row)
    return rows


def rl_bench(steps: int, policy: str, gpus: int = 16) -> dict[str, Any]:
    wl_spec = RolloutSpec()
    planner_cfg = PlannerConfig(total_gpus=gpus)
    t0 = time.perf_counter()
    planned = RLLoop(RolloutWorkload(wl_spec), policy, planner=planner_cfg).run(steps)
    planned_wall = time.perf_counter() - t0
    grid = []
    for g in (4, 8, 10, 12):
        for mix in (f"tp1x{g}", f"tp4x{g // 4}" if g % 4 == 0 else "",
                    f"tp1x{g - 4},tp4x1" if g > 4 else "",
                    "tp1x4,tp2x2,tp4x1" if g == 12 else ""):
            if mix:
                grid.append(Plan(parse_mix(mix), gpus - g))
    t0 = time.perf_counter()
    best, best_res, all_static = best_static(RolloutWorkload(wl_spec), steps, policy, grid,
                                             planner=planner_cfg)
    static_wall = time.perf_counter() - t0
    half = Plan(parse_mix(f"tp1x{gpus // 2}"), gpus // 2)
    half_total = next(t for p, t in all_static if p == half)
    lb_half = RLLoop(RolloutWorkload(wl_spec), "least-open",
                     planner=PlannerConfig(total_gpus=gpus, static=half)).run(steps)
    return {
        "policy": policy,
        "steps": steps,
        "trajectories": steps * wl_spec.batch_size,
        "planner": {
            "total_s": planned.total_s,
            "plans": [f"{s.step}: {s.plan}" + (" (replanned after)" if s.replanned else "")
                      for s in planned.steps],
            "evaluations": planned.planner_evals,
            "wall_s": planned_wall,
        },
        "best_static": {"plan": str(best), "total_s": best_res.total_s},
        "half_half_static": {"plan": str(half), "total_s": half_total},
        "half_half_load_balance": {"plan": str(half), "total_s": lb_half.total_s},
        "static_grid": [{"plan": str(p), "total_s": t} for p, t in all_static],
        "static_wall_s": static_wall,
    }


def _five_steps() -> dict[str, Any]:
    """Wall time of the rollout simulator alone: 5 steps × 256 trajectories on 16 GPUs."""
    wl = RolloutWorkload(RolloutSpec())
    batches = [wl.batch(k) for k in range(5)]
    out = {}
    for pol in ("least-open", "cmlfq"):
        router = make_router(pol)
        t0 = time.perf_counter()
        iters = events = 0
        for b in batches:
            _, sim, _ = simulate_batch(b, parse_mix("tp1x8,tp2x2,tp4x1"), router, SimConfig())
            st = sim.stats()
            iters += st["iterations"]
            events += st["events"]
        out[pol] = {"wall_s": time.perf_counter() - t0, "iterations": iters, "events": events}
    return out


def _md_makespan(rows: list[dict[str, Any]]) -> str:
    head = ("| tool latency | mix (16 GPUs) | lower bound | load-balance | load-balance, "
            "no stickiness | length-predict | cmlfq | cmlfq vs load-balance |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        p = r["policies"]
        lb = p["least-open"]["mean_makespan_s"]
        cm = p["cmlfq"]["mean_makespan_s"]
        lines.append(
            f"| x{r['tool_scale']} | {r['mix']} | {r['lower_bound_s']:,.0f} s | {lb:,.0f} s | "
            f"{p['least-open:nosticky']['mean_makespan_s']:,.0f} s | "
            f"{p['length-predict']['mean_makespan_s']:,.0f} s | {cm:,.0f} s | "
            f"**{lb / cm:.2f}×** |"
        )
    return head + "\n".join(lines)


def _md_rl(rl: dict[str, Any]) -> str:
    n = rl["trajectories"]

    def thr(total: float) -> str:
        return f"{n / total * 3600:,.0f}"

    p, b, h, lbh = rl["planner"], rl["best_static"], rl["half_half_static"], rl[
        "half_half_load_balance"]
    return (
        "| configuration | plan | RL time | trajectories/h | planner gain |\n"
        "|---|---|---:|---:|---:|\n"
        f"| planner + {rl['policy']} | per step (below) | {p['total_s']:,.0f} s | "
        f"{thr(p['total_s'])} | 1.00× |\n"
        f"| best static split + {rl['policy']} (hindsight) | {b['plan']} | {b['total_s']:,.0f} s"
        f" | {thr(b['total_s'])} | **{b['total_s'] / p['total_s']:.2f}×** |\n"
        f"| half/half static + {rl['policy']} | {h['plan']} | {h['total_s']:,.0f} s | "
        f"{thr(h['total_s'])} | {h['total_s'] / p['total_s']:.2f}× |\n"
        f"| half/half static + load-balance | {lbh['plan']} | {lbh['total_s']:,.0f} s | "
        f"{thr(lbh['total_s'])} | {lbh['total_s'] / p['total_s']:.2f}× |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="rollout steps per makespan cell")
    ap.add_argument("--rl-steps", type=int, default=10, help="RL steps for the planner table")
    ap.add_argument("--mixes", default="tp1x8,tp2x2,tp4x1;tp1x12,tp4x1;tp2x4,tp4x2")
    ap.add_argument("--scales", default="1.0,0.1")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-rl", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print("# Rollout benchmarks (all simulated: roofline H100, qwen3-8b, fitted workload)\n")
    print(f"Command: `.venv/bin/python benchmarks/rollout_bench.py --steps {args.steps} "
          f"--rl-steps {args.rl_steps}`\n")
    five = _five_steps()
    for pol, d in five.items():
        print(f"5 steps × 256 trajectories on 16 GPUs (tp1x8,tp2x2,tp4x1), {pol}: "
              f"{d['wall_s']:.2f} s wall, {d['iterations'] / 1e6:.2f} M simulated engine "
              f"iterations in {d['events']:,} events "
              f"({d['iterations'] / d['wall_s'] / 1e6:.1f} M iterations/s)")
    print()
    rows = makespan_bench(args.steps, args.mixes.split(";"),
                          [float(x) for x in args.scales.split(",")])
    print(f"## Rollout-step makespan, mean of {args.steps} steps (32 prompts × 8 samples, "
          "drifting; simulated)\n")
    print(_md_makespan(rows))
    print("\nLower bound: the longest trajectory alone on the mix's largest engine (tool time "
          "included). Reproduce one cell: `.venv/bin/turnstile rollout sim --steps "
          f"{args.steps} --gpus 16 --mix tp1x8,tp2x2,tp4x1 --train-gpus 0 --policy "
          "load-balance,load-balance:nosticky,length-predict,cmlfq`\n")
    doc: dict[str, Any] = {"simulated": True, "five_steps": five,
                           "makespan": rows}
    if not args.skip_rl:
        rl = rl_bench(args.rl_steps, "cmlfq")
        doc["rl"] = rl
        print(f"## End-to-end RL, {args.rl_steps} steps on 16 GPUs (one-step off-policy; "
              "simulated)\n")
        print(_md_rl(rl))
        print("\nPlanner's plan per step: " + "; ".join(rl["planner"]["plans"]))
        print(f"\nReproduce: `.venv/bin/turnstile rollout sim --steps {args.rl_steps} --gpus 16 "
              "--policy cmlfq --any-mix` (planner) and `... --mix tp1x8 --train-gpus 8` "
              "(a static split)\n")
    print(f"_benchmark wall time {time.perf_counter() - t0:.0f} s_")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rollout_bench.json").write_text(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
