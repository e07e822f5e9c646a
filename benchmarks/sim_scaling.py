"""Simulator cost against the number of turns: wall time, CPU time and peak memory at 10k, 100k
and 1M requests (a simulated-throughput measurement).

    .venv/bin/python benchmarks/sim_scaling.py [--sizes 10000,100000,1000000] [--out DIR]
    .venv/bin/python benchmarks/sim_speed.py --scaling [--out DIR]      # the same

The workload is a seeded synthetic request stream shaped like the request trace of
``sim_speed.py`` (Poisson 5.5 requests/s, lognormal prompts and outputs, prompt + output <=
4,096) on one H100 engine with ``eager``, so simulated time grows with the number of requests
at a steady load. Each size runs in a fresh process: wall and CPU time of ``ClusterSim.run()``
and the process's peak RSS (``getrusage``) before and after it. Writes ``DIR/sim_scaling.json``
and ``DIR/sim_scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from sim_speed import full_stack_once, request_rows, results_header, trace_groups, write_results

from turnstile.workload.model import Turn, Workflow

SCALING_SIZES = (10_000, 100_000, 1_000_000)


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def scaling_one(n: int) -> dict[str, Any]:
    """One size, in this (fresh) process: build the stream, then time ``run()``."""
    rows, src = request_rows(n, synthetic=True)
    wfs = [Workflow(f"r{i}", t, (Turn(p, o),)) for i, (t, p, o) in enumerate(rows)]
    del rows
    rss_before = _max_rss_mb()
    rec = full_stack_once(wfs, trace_groups())
    rec.update(source=src, rss_before_run_mb=rss_before, peak_rss_mb=_max_rss_mb())
    return rec


def scaling(sizes: list[int], out: Path, con: Console) -> dict[str, Any]:
    """Every size in its own process (peak RSS is per process), smallest first."""
    runs = []
    for n in sizes:
        with con.status(f"scaling: {n:,} requests"):
            p = subprocess.run([sys.executable, __file__, "--one", str(n)],
                               capture_output=True, text=True, check=True)
        rec = json.loads(p.stdout.strip().splitlines()[-1])
        rec["loadavg"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        runs.append(rec)
    t = Table(title="simulated-throughput scaling: request stream, 1 engine, eager (one run each)")
    for c in ("requests", "iterations", "simulated s", "wall s", "CPU s", "requests/s",
              "wall µs/request", "peak RSS MB", "RSS growth in run MB", "load avg"):
        t.add_column(c, justify="right")
    for r in runs:
        t.add_row(f"{r['requests']:,}", f"{r['iterations']:,}", f"{r['simulated_s']:,.0f}",
                  f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
                  f"{r['requests'] / r['wall_s']:,.0f}", f"{1e6 * r['wall_s'] / r['requests']:.1f}",
                  f"{r['peak_rss_mb']:,.0f}", f"{r['peak_rss_mb'] - r['rss_before_run_mb']:,.0f}",
                  f"{r['loadavg'][0]:.1f}" if r["loadavg"] else "-")
    con.print(t)
    plot_scaling(runs, out / "sim_scaling.png")
    return {"runs": runs, "plot": str(out / "sim_scaling.png")}


def plot_scaling(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = np.array([r["requests"] for r in runs], dtype=float)
    wall = np.array([r["wall_s"] for r in runs])
    cpu = np.array([r["cpu_s"] for r in runs])
    rss = np.array([r["peak_rss_mb"] for r in runs])
    grew = rss - np.array([r["rss_before_run_mb"] for r in runs])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog(n, wall, "o-", label="wall s (shared host, see load)")
    a.loglog(n, cpu, "s-", label="CPU s")
    a.loglog(n, cpu[0] * n / n[0], "k:", label="linear (from the smallest CPU time)")
    for x, y, r in zip(n, wall, runs, strict=True):
        if r.get("loadavg"):
            a.annotate(f"load {r['loadavg'][0]:.1f}", (x, y), textcoords="offset points",
                       xytext=(-10, 6), fontsize=8, ha="right")
    a.set_xlabel("requests (turns)")
    a.set_ylabel("seconds in run()")
    a.set_title("time of the simulated run")
    a.legend(fontsize=8)
    b.loglog(n, rss, "o-", label="peak RSS of the process")
    b.loglog(n, grew, "s-", label="RSS growth during run()")
    b.loglog(n, grew[-1] * n / n[-1], "k:", label="linear (through the largest growth)")
    b.set_xlabel("requests (turns)")
    b.set_ylabel("MB")
    b.set_title("memory (workload + simulator)")
    b.legend(fontsize=8)
    fig.suptitle("turnstile simulator, request stream on 1 engine "
                 "(simulated-throughput measurement)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, SCALING_SIZES)), metavar="N,N,...")
    ap.add_argument("--out", type=Path, default=Path("/tmp/turnstile-sim-speed"))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(scaling_one(a.one)))
        return 0
    out: Path = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    con = Console(width=None if sys.stdout.isatty() else 180)
    results = results_header("sim_scaling.py", argv)
    results["scaling"] = scaling([int(x) for x in a.sizes.split(",")], out, con)
    path = out / "sim_scaling.json"
    write_results(results, path)
    con.print(f"wrote {path} and {out / 'sim_scaling.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
