"""How long ``turnstile tune`` takes as the workload and the candidate space grow (simulated).

    .venv/bin/python benchmarks/tune_scaling.py [--sessions 100,300,600] [--spaces default,wide]
        [--workers 2] [--out DIR]

Each (sessions, space) point runs the whole search (the saturation search on the tune half,
then every candidate on both halves at three loads) on seeded synthetic sessions fitted to the
AgentCgroup trace, on 2× H100 Llama-3.1-8B, with ``--workers`` local processes, and records
its wall time, the number of simulations and the choice. Writes ``DIR/tune_scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from turnstile.bench.tune import TuneConfig, run_tune
from turnstile.bench.tune_space import get_space
from turnstile.sim.engine_group import EngineGroup
from turnstile.workload import synth


def one_point(sessions: int, space: str, workers: int, seed: int = 0) -> dict[str, Any]:
    wfs = synth.generate(synth.DEFAULT_SPEC, sessions, seed)
    cands = get_space(space)
    config = TuneConfig(groups=[EngineGroup(gpu="H100", model="llama-3.1-8b", count=2)],
                        cluster="2xH100-llama-3.1-8b-TP1", candidates=cands, seed=seed)
    t0 = time.perf_counter()
    doc = run_tune(wfs, config, workers=workers)
    return {"sessions": sessions, "space": space, "candidates": len(cands),
            "simulations": len(doc["saturation"]["probes"]) + sum(len(c["policies"])
                                                                  for c in doc["cells"]),
            "wall_s": time.perf_counter() - t0, "chosen": doc["chosen"], "agree": doc["agree"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", default="100,300,600")
    ap.add_argument("--spaces", default="default,wide")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("out/tune-scaling"))
    args = ap.parse_args()
    points = []
    for space in args.spaces.split(","):
        for n in (int(x) for x in args.sessions.split(",")):
            points.append(one_point(n, space, args.workers))
    table = Table(title=f"turnstile tune wall time (simulated), {args.workers} workers, "
                  f"{os.cpu_count()} cores")
    for col in ("sessions", "space", "candidates", "simulations", "wall s", "chosen", "agree"):
        table.add_column(col)
    for p in points:
        table.add_row(str(p["sessions"]), p["space"], str(p["candidates"]),
                      str(p["simulations"]), f"{p['wall_s']:.1f}", p["chosen"], str(p["agree"]))
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_scaling.json").write_text(json.dumps(
        {"simulated": True, "workers": args.workers, "cpu_count": os.cpu_count(),
         "points": points}, indent=1) + "\n")


if __name__ == "__main__":
    main()
