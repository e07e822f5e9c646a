"""Rollout router sweep (all simulated): every rollout workload the project ships × bucket
layouts (the planner's choice, homogeneous and mixed TP buckets) × GPU counts × seeds, each
router against ``least-open`` (Libra's load-balance control).

    .venv/bin/python benchmarks/rollout_sweep.py [--quick] [--jobs 2] [--out DIR]
        [--workloads r2e-gym,dapo-math] [--gpus 8,16] [--seeds 0,1,2] [--steps 3]

Per cell and router: mean rollout-step makespan (batch start → its last trajectory, what
``turnstile rollout sim`` reports), RL total time, and the P95 trajectory completion time
(from its batch start, over every step). The ratio is least-open's / the router's: above 1 the
router is faster. A cell is ``planner`` (``rollout sim``'s default: the planner picks the split
and the mix for each router, 16 GPUs = the README's command) or a fixed mix on all the GPUs
(``--mix``, no training GPUs: rollout only). Same seeded batches for every router in a cell.

Prints a markdown table per workload and the worst ratio per router; ``--out`` writes
``rollout_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnstile.policies import ROUTING, RoutingPolicy
from turnstile.rollout.experiment import RolloutSimRequest, SharedBatches, make_router
from turnstile.rollout.libra_workloads import workload_names
from turnstile.rollout.planner import RLLoop

BASE = "least-open"
ROUTERS = ("cmlfq", "cmlfq-adaptive")


@dataclass(frozen=True)
class Cell:
    workload: str
    gpus: int
    layout: str  # "planner" or a mix
    seed: int
    steps: int

    @property
    def key(self) -> str:
        return f"{self.workload}|{self.gpus}|{self.layout}|{self.seed}|{self.steps}"


def layouts(gpus: int) -> list[str]:
    """Fixed mixes on ``gpus`` GPUs: homogeneous, and mixed TP buckets (a small-engine tier plus
    one or two large engines, and the three-level mix)."""
    out = [f"tp1x{gpus}", f"tp2x{gpus // 2}"]
    out.append(f"tp1x{gpus - 2},tp2x1")
    if gpus >= 8:
        out.append(f"tp1x{gpus - 4},tp4x1")
        out.append(f"tp2x{(gpus - 4) // 2},tp4x1")
    if gpus >= 16:
        out.append(f"tp2x{(gpus - 8) // 2},tp8x1")
    if gpus >= 10:
        out.append(f"tp1x{gpus - 8},tp2x2,tp4x1")
    return out


def cells(workloads: list[str], gpus: list[int], seeds: list[int], steps: int,
          quick: bool) -> list[Cell]:
    out: list[Cell] = []
    for w in workloads:
        # tool-heavy trajectories are long agent sessions (256 a step, ~3 s of CPU per
        # policy-step): its grid is the 16-GPU one and fewer seeds
        heavy = w == "tool-heavy"
        for g in ([16] if heavy else gpus):
            for lay in ["planner", *layouts(g)]:
                if quick and lay not in ("planner", f"tp1x{g - 4},tp4x1", f"tp1x{g - 2},tp2x1"):
                    continue
                for s in (seeds[:1] if heavy or quick else seeds):
                    out.append(Cell(w, g, lay, s, steps))
    return out


def router(spec: str) -> RoutingPolicy:
    """``make_router``'s specs, plus ``name@key=value@key=value`` constructor arguments for
    ablations (``cmlfq@start=level0@move_back=true``)."""
    name, _, args = spec.partition("@")
    if not args:
        return make_router(spec)
    kw: dict[str, Any] = {}
    for part in args.split("@"):
        k, _, v = part.partition("=")
        try:
            kw[k] = json.loads(v)
        except json.JSONDecodeError:
            kw[k] = v
    return ROUTING.create(name, **kw)


def _p95(xs: list[float]) -> float:
    if not xs:
        return math.nan
    ys = sorted(xs)
    return ys[min(len(ys) - 1, math.ceil(0.95 * len(ys)) - 1)]


def run_cell(cell: Cell, routers: tuple[str, ...] = (BASE, *ROUTERS)) -> dict[str, Any]:
    """One cell: every router on the same batches (as ``turnstile rollout sim`` runs them)."""
    fixed = cell.layout != "planner"
    req = RolloutSimRequest(steps=cell.steps, gpus=cell.gpus, policies=(BASE,),
                            workload=cell.workload, seed=cell.seed,
                            mix=cell.layout if fixed else None, train_gpus=0 if fixed else None)
    req.validate()
    workload = SharedBatches(req.make_workload())
    out: dict[str, Any] = {"cell": cell.__dict__, "routers": {}}
    for r in routers:
        t0 = time.perf_counter()
        loop = RLLoop(workload, lambda r=r: router(r),  # type: ignore[arg-type]
                      sim_config=req.sim_config(), planner=req.planner_config())
        res = loop.run(cell.steps)
        assert loop.sim is not None
        finish = [t for b in loop.sim.batches for t in b.finish_s.values()]
        ms = [s.rollout_s for s in res.steps]
        stats = getattr(loop.router, "stats", None)
        out["routers"][r] = {
            "mean_makespan_s": sum(ms) / len(ms),
            "total_s": res.total_s,
            "p95_trajectory_s": _p95(finish),
            "mean_trajectory_s": sum(finish) / max(1, len(finish)),
            "mixes": sorted({s.plan.mix_text + f"/T{s.plan.train_gpus}" for s in res.steps}),
            "router": stats() if callable(stats) else {},
            "wall_s": time.perf_counter() - t0,
        }
    base = out["routers"][BASE]
    for r in routers:
        d = out["routers"][r]
        d["makespan_ratio"] = base["mean_makespan_s"] / d["mean_makespan_s"]
        d["total_ratio"] = base["total_s"] / d["total_s"]
        d["p95_ratio"] = base["p95_trajectory_s"] / d["p95_trajectory_s"]
    return out


def table(results: list[dict[str, Any]], routers: tuple[str, ...]) -> str:
    lines = ["| workload | GPUs | layout | seeds | least-open makespan s | "
             + " | ".join(f"{r} makespan× (min) · P95× · total×" for r in routers) + " |",
             "|---|---|---|---|---|" + "---|" * len(routers)]
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for res in results:
        c = res["cell"]
        groups.setdefault((c["workload"], c["gpus"], c["layout"]), []).append(res)
    for (w, g, lay), rs in groups.items():
        base = sum(x["routers"][BASE]["mean_makespan_s"] for x in rs) / len(rs)
        cols = []
        for r in routers:
            mk = [x["routers"][r]["makespan_ratio"] for x in rs]
            p95 = [x["routers"][r]["p95_ratio"] for x in rs]
            tot = [x["routers"][r]["total_ratio"] for x in rs]
            cols.append(f"{_gmean(mk):.2f} ({min(mk):.2f}) · {_gmean(p95):.2f} · "
                        f"{_gmean(tot):.2f}")
        lines.append(f"| {w} | {g} | {lay} | {len(rs)} | {base:,.0f} | " + " | ".join(cols)
                     + " |")
    return "\n".join(lines)


def kind(layout: str) -> str:
    """``planner``, or the TPs of a mix (``tp1x12,tp4x1`` → ``tp1+tp4``)."""
    if layout == "planner":
        return "planner"
    return "+".join(b.split("x")[0] for b in layout.split(","))


def summary(results: list[dict[str, Any]], routers: tuple[str, ...]) -> str:
    """One row per workload and layout kind (every GPU count and seed together): the geometric
    mean of the makespan ratio, its minimum, and the P95-trajectory ratio's geometric mean."""
    lines = ["| workload | layout | cells | " + " | ".join(
        f"{r}: makespan× (min) · P95×" for r in routers) + " |",
             "|---|---|---|" + "---|" * len(routers)]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for res in results:
        c = res["cell"]
        groups.setdefault((c["workload"], kind(c["layout"])), []).append(res)
    for (w, k), rs in groups.items():
        cols = []
        for r in routers:
            mk = [x["routers"][r]["makespan_ratio"] for x in rs]
            p95 = [x["routers"][r]["p95_ratio"] for x in rs]
            cols.append(f"{_gmean(mk):.2f} ({min(mk):.2f}) · {_gmean(p95):.2f}")
        lines.append(f"| {w} | {k} | {len(rs)} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(workload_names()))
    ap.add_argument("--gpus", default="8,16,32")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--quick", action="store_true", help="three layouts, one seed")
    ap.add_argument("--jobs", type=int, default=1, help="cells in parallel (processes)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    routers = tuple(r for r in a.routers.split(",") if r)
    grid = cells(a.workloads.split(","), [int(g) for g in a.gpus.split(",")],
                 [int(s) for s in a.seeds.split(",")], a.steps, a.quick)
    t0 = time.perf_counter()
    print(f"simulated: {len(grid)} cells × {1 + len(routers)} routers", file=sys.stderr)
    all_r = (BASE, *routers)
    if a.jobs > 1:
        with ProcessPoolExecutor(min(a.jobs, os.cpu_count() or 1)) as ex:
            results = list(ex.map(run_cell, grid, [all_r] * len(grid)))
    else:
        results = []
        for c in grid:
            results.append(run_cell(c, all_r))
            worst = min(results[-1]["routers"][r]["makespan_ratio"] for r in routers)
            print(f"  {c.key}: worst makespan× {worst:.3f}", file=sys.stderr)
    print("Rollout sweep (simulated; ratio = least-open / router, >1 = router faster; "
          "geometric mean over seeds, min in brackets)\n")
    full = table(results, routers)
    short = summary(results, routers)
    print(short)
    print()
    tail = []
    for r in routers:
        worst = min(results, key=lambda x: x["routers"][r]["makespan_ratio"])
        c = worst["cell"]
        allr = [x["routers"][r]["makespan_ratio"] for x in results]
        tail.append(f"{r}: makespan× geomean {_gmean(allr):.3f}, min {min(allr):.3f} at "
                    f"{c['workload']} {c['gpus']} GPUs {c['layout']} seed {c['seed']}; "
                    f"cells < 0.99: {sum(x < 0.99 for x in allr)}/{len(allr)}")
        print(tail[-1])
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        doc = {"kind": "rollout-sweep", "simulated": True, "base": BASE,
               "routers": list(routers), "cells": results}
        (a.out / "rollout_sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
        (a.out / "rollout_sweep.md").write_text(
            "Rollout sweep (simulated; ratio = least-open / router)\n\n" + short + "\n\n"
            + "\n".join(tail) + "\n\nPer cell (geometric mean over seeds):\n\n" + full + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
