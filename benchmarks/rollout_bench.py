"""Rollout benchmark (all simulated): Libra's control vs C-MLFQ, the planner and the elastic
pool, per workload, with an ablation of what each piece adds.

    .venv/bin/python benchmarks/rollout_bench.py [--steps 6] [--workloads r2e-gym,...] [--out DIR]

Every configuration runs the same seeded batches on the same simulated cluster: 16 H100s,
Qwen3-8B, ``EngineModel`` engines on ``ClusterSim`` with the per-TP performance model
(``sim.tp_perf``), the analytic training model. Per workload and configuration it reports the
mean rollout-step makespan (batch start → its last trajectory) and the step throughput (RL steps
per hour, training included). Configurations, in ablation order:

1. ``control``: Libra's load-balance control — uniform TP2, least connections (``least-open``),
   synchronous on-policy RL colocated on all GPUs (roll out, then train: verl's loop);
2. ``layout``: the same, on the tiered layout (``--layout``: TP2 engines plus a TP8 one) — what
   the TP layout alone does;
3. ``cmlfq``: Libra's C-MLFQ on the tiered layout, same loop — what the routing adds;
4. ``cmlfq-adaptive``: turnstile's variant, same;
5. ``cmlfq+planner``: the planner picks the split and the layout (Libra's objective
   ``max(T_train, T_rollout)``), one-step off-policy on disjoint pools;
6. ``cmlfq+planner+elastic``: asynchronous RL with bounded staleness (``--staleness``), the
   planner sizing the pool for the batches in flight, replicas lent to training when it lags;
7. ``async-control``: the control's routing and layout with the same asynchronous loop and a
   static split (no planner, no lending) — what asynchrony alone does.

Prints markdown tables; ``--out`` also writes ``rollout_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnstile.rollout.elastic import AsyncRLLoop, ElasticConfig
from turnstile.rollout.libra_workloads import make_workload
from turnstile.rollout.planner import Plan, PlannerConfig, RLLoop
from turnstile.rollout.sim import SimConfig, parse_mix
from turnstile.rollout.training import TrainModel

CONFIGS = ("control", "layout", "cmlfq", "cmlfq-adaptive", "cmlfq+planner",
           "cmlfq+planner+elastic", "async-control")
#: configurations run in the control's loop (synchronous): their makespans compare directly;
#: the others overlap batches, so a batch's makespan grows while steps per hour rise
SAME_LOOP = ("layout", "cmlfq", "cmlfq-adaptive")
#: batch shapes kept small enough for 2 shared cores (the Libra-like ones are as cited)
WORKLOAD_ARGS: dict[str, dict[str, Any]] = {
    "tool-heavy": {"n_prompts": 16, "group_size": 8},
    "r2e-gym": {},
    "search-r1": {},
    "dapo-math": {"n_prompts": 16, "group_size": 8},
}


def run_config(name: str, workload: str, steps: int, gpus: int, layout: str, staleness: int,
               sim_cfg: SimConfig) -> dict[str, Any]:
    def wl() -> Any:
        return make_workload(workload, **WORKLOAD_ARGS.get(workload, {}))

    uniform = parse_mix(f"tp2x{gpus // 2}")
    tiered = parse_mix(layout)
    train = TrainModel.for_names(sim_cfg.gpu, sim_cfg.model)
    min_train = train.min_gpus()
    t0 = time.perf_counter()
    out: dict[str, Any] = {"config": name}
    if name in ("control", "layout", "cmlfq", "cmlfq-adaptive"):
        policy = {"control": "least-open", "layout": "least-open"}.get(name, name)
        mix = uniform if name == "control" else tiered
        res = RLLoop(wl(), policy, sim_config=sim_cfg, planner=PlannerConfig(
            total_gpus=gpus, mode="sync", static=Plan(mix, gpus))).run(steps)
        out.update(makespans=[s.rollout_s for s in res.steps], total_s=res.total_s,
                   plan=f"{','.join(b.name for b in mix)}; sync", stats=res.sim_stats)
    elif name == "cmlfq+planner":
        res = RLLoop(wl(), "cmlfq", sim_config=sim_cfg, planner=PlannerConfig(
            total_gpus=gpus, tps=(2, 4, 8), replan_every=4)).run(steps)
        plans = list(dict.fromkeys(str(s.plan) for s in res.steps))
        out.update(makespans=[s.rollout_s for s in res.steps], total_s=res.total_s,
                   plan="; ".join(plans) + "; off-policy", stats=res.sim_stats,
                   planner_evals=res.planner_evals)
    else:
        elastic = name == "cmlfq+planner+elastic"
        static = None if elastic else Plan(parse_mix(f"tp2x{(gpus - min_train) // 2}"),
                                           gpus - 2 * ((gpus - min_train) // 2))
        loop = AsyncRLLoop(
            wl(), "cmlfq" if elastic else "least-open", sim_config=sim_cfg,
            planner=PlannerConfig(total_gpus=gpus, tps=(2, 4, 8), replan_every=4,
                                  static=static),
            elastic=ElasticConfig(staleness=staleness, lend=elastic))
        res = loop.run(steps)
        plans = list(dict.fromkeys(f"{s.mix} / train {s.train_gpus}" for s in res.steps))
        out.update(makespans=[s.rollout_s for s in res.steps], total_s=res.total_s,
                   plan=f"{' | '.join(plans)}; async, staleness ≤{staleness}",
                   stats=res.sim_stats, planner_evals=res.planner_evals,
                   lends=res.lends, returns=res.returns,
                   staleness=[s.staleness for s in res.steps])
    out["mean_makespan_s"] = sum(out["makespans"]) / len(out["makespans"])
    out["steps_per_h"] = steps / out["total_s"] * 3600
    out["wall_s"] = time.perf_counter() - t0
    return out


def _md(workload: str, rows: dict[str, dict[str, Any]]) -> str:
    base = rows["control"]
    lines = [f"### {workload}\n",
             "| configuration | layout / split / loop | mean makespan | makespan vs control | "
             "steps/h | throughput vs control |", "|---|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['plan']} | {r['mean_makespan_s']:,.0f} s | "
            f"{base['mean_makespan_s'] / r['mean_makespan_s']:.2f}× | {r['steps_per_h']:,.1f} | "
            f"{r['steps_per_h'] / base['steps_per_h']:.2f}× |")
    return "\n".join(lines)


def goals(doc: dict[str, Any]) -> list[str]:
    out = []
    r2e = doc["workloads"].get("r2e-gym")
    if r2e:
        c = r2e["control"]
        el = r2e.get("cmlfq+planner+elastic")
        cm = r2e.get("cmlfq")
        if el:
            x = el["steps_per_h"] / c["steps_per_h"]
            out.append(f"R2E-Gym-like cmlfq+planner+elastic step throughput {x:.2f}× the "
                       f"control (goal ≥3×: {'met' if x >= 3 else 'missed'})")
        if cm:
            x = c["mean_makespan_s"] / cm["mean_makespan_s"]
            out.append(f"R2E-Gym-like cmlfq rollout makespan {x:.2f}× better than the control "
                       f"(goal ≥1.5×: {'met' if x >= 1.5 else 'missed'})")
    th = doc["workloads"].get("tool-heavy")
    if th:
        c = th["control"]
        ours = [n for n in th if n.startswith("cmlfq")]
        worse = [f"{n} ({th[n]['steps_per_h'] / c['steps_per_h']:.2f}× throughput, "
                 f"{c['mean_makespan_s'] / th[n]['mean_makespan_s']:.2f}× makespan)"
                 for n in ours if th[n]["steps_per_h"] < c["steps_per_h"] * 0.999
                 or (n in SAME_LOOP and th[n]["mean_makespan_s"] > c["mean_makespan_s"] * 1.001)]
        out.append(f"tool-heavy: {', '.join(ours)} never worse than load-balance (step "
                   "throughput; makespan too for those in the control's loop): "
                   + ("met" if not worse else f"missed by {'; '.join(worse)}"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="RL steps per configuration")
    ap.add_argument("--workloads", default="r2e-gym,search-r1,dapo-math,tool-heavy")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--layout", default="tp2x4,tp8x1", help="the tiered layout (16 GPUs)")
    ap.add_argument("--staleness", type=int, default=4, help="versions (Libra: 2-4)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sim_cfg = SimConfig(gpu="H100", model="qwen3-8b")
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    print("# Rollout benchmark (all simulated: 16× H100, Qwen3-8B, per-TP roofline, "
          "EngineModel on ClusterSim)\n")
    print(f"Command: `.venv/bin/python benchmarks/rollout_bench.py --steps {args.steps} "
          f"--workloads {args.workloads} --staleness {args.staleness}"
          + ("" if args.configs == ",".join(CONFIGS) else f" --configs {args.configs}")
          + "` "
          f"(load average at start {load:.1f})\n")
    doc: dict[str, Any] = {"simulated": True, "args": vars(args) | {"out": str(args.out)},
                           "sim": sim_cfg.describe(), "workloads": {}}
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "control" not in configs:
        configs.insert(0, "control")
    progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for wname in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        rows: dict[str, dict[str, Any]] = {}
        for name in configs:
            rows[name] = run_config(name, wname, args.steps, args.gpus, args.layout,
                                    args.staleness, sim_cfg)
            progress(f"  {wname} {name}: makespan {rows[name]['mean_makespan_s']:,.0f} s, "
                     f"{rows[name]['steps_per_h']:,.1f} steps/h ({rows[name]['wall_s']:.0f} s "
                     "wall)")
        doc["workloads"][wname] = rows
        print(_md(wname, rows) + "\n", flush=True)
    doc["goals"] = goals(doc)
    print("## Goals (simulated)\n")
    for g in doc["goals"]:
        print(f"- {g}")
    wall = time.perf_counter() - t0
    doc["wall_s"] = wall
    print(f"\n_benchmark wall time {wall:.0f} s; load average at the end "
          f"{os.getloadavg()[0]:.1f}_")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rollout_bench.json").write_text(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
