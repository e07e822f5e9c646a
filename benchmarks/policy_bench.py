"""Policy benchmarks on the shared agentic traces (simulated), side by side in one run.

Real AgentCgroup Claude Code sessions (glm47flash_local: real output-token counts) superimposed
on Poisson arrivals at increasing rates, on simulated H100 clusters. Three studies:

* release: P95 / mean workflow flow time against arrival rate for every release policy
  (eager, fcfs-workflow, plas, cvar-fixed, cvar), each with the same routing;
* retention: recomputed prefill tokens with ttl / infercept / budget-keep against lru, at equal
  KV memory (same GPUs, same CPU offload tier);
* routing: round-robin, least-loaded, kv-affinity, composite without / with shadow load.

    .venv/bin/python benchmarks/policy_bench.py --out benchmarks/results [--quick]

Writes ``policy_bench.json`` (every metric of every run, the configuration and the trace hash),
markdown tables on stdout and ``release_sweep_<cluster>.png`` plots. Every figure is simulated.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from turnstile.bench.metrics import compute_metrics, public_metrics
from turnstile.bench.plots import plot_load_sweep
from turnstile.bench.report import tree_sha256
from turnstile.sim.cluster import EngineGroup, run_sim
from turnstile.traces import load_trace
from turnstile.workload import synth

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / (
    "agentcgroup_swerebench_claude_code/glm47flash_local")

CLUSTERS = {
    "4xH100-llama8b": [EngineGroup(gpu="H100", model="llama-3.1-8b", tp=1, count=4)],
    "2xH100x4-llama70b": [EngineGroup(gpu="H100", model="llama-3.1-70b", tp=4, count=2)],
}
RELEASE = ["eager", "fcfs-workflow", "plas", "cvar-fixed", "cvar"]
RETENTION = ["lru", "ttl", "infercept", "budget-keep"]
ROUTING = ["round-robin", "least-loaded", "kv-affinity", "composite-noshadow", "composite",
           "least-loaded-shadow"]

_BASE: list = []


def _init(trace: str | None) -> None:
    global _BASE
    if trace and Path(trace).exists():
        _BASE = load_trace(trace).workflows
    else:
        _BASE = synth.generate(synth.DEFAULT_SPEC, 200, seed=0)


def _run(job: dict[str, Any]) -> dict[str, Any]:
    from turnstile.bench.runner import capacity_rate

    groups = CLUSTERS[job["cluster"]]
    if job.get("cpu_offload_tokens"):
        groups = [EngineGroup(**{**g.__dict__, "cpu_offload_tokens": job["cpu_offload_tokens"]})
                  for g in groups]
    rate = job["load"] * capacity_rate(_BASE, groups)
    times = synth.poisson_arrivals(rate, job["workflows"], job["seed"])
    wfs = synth.superimpose(_BASE, times, seed=job["seed"])
    t0 = time.perf_counter()
    res = run_sim(wfs, job["spec"], groups)
    m = compute_metrics(res.workflows, engine_stats=res.engine_stats, makespan_s=res.makespan_s,
                        num_gpus=res.num_gpus)
    return {**job, "rate": rate, "wall_s": time.perf_counter() - t0, "metrics": public_metrics(m)}


def _table(rows: list[dict[str, Any]], key: str, baseline: str) -> str:
    loads = sorted({r["load"] for r in rows})
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    by = {(r["spec"], r["load"]): r for r in rows}
    head = "| policy | " + " | ".join(f"load {x:g} ({by[(specs[0], x)]['rate'] * 3600:.0f}/h)"
                                       for x in loads) + " |"
    out = [head, "|---" * (len(loads) + 1) + "|"]
    for s in specs:
        cells = []
        for x in loads:
            v = by[(s, x)]["metrics"]["flow_time_s"][key]
            b = by[(baseline, x)]["metrics"]["flow_time_s"][key]
            cells.append(f"{v:,.0f} s ({b / v:.2f}×)")
        out.append(f"| `{s}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="fewer loads and workflows")
    ap.add_argument("--workflows", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loads = [0.2, 0.7] if args.quick else [0.2, 0.4, 0.55, 0.7, 0.85, 1.0]
    n = 120 if args.quick else args.workflows
    routing = "least-loaded-shadow"
    jobs: list[dict[str, Any]] = []
    for cluster in CLUSTERS:
        for load in loads:
            for rel in RELEASE:
                jobs.append({"study": "release", "cluster": cluster, "load": load,
                             "spec": f"{rel}+{routing}", "workflows": n, "seed": args.seed})
    for ret in RETENTION:
        for rel in ("eager", "cvar"):
            jobs.append({"study": "retention", "cluster": "4xH100-llama8b", "load": 0.7,
                         "spec": f"{rel}+kv-affinity+{ret}", "workflows": n, "seed": args.seed,
                         "cpu_offload_tokens": 1_000_000})
    for rt in ROUTING:
        for rel in ("eager", "cvar"):
            jobs.append({"study": "routing", "cluster": "4xH100-llama8b", "load": 0.55,
                         "spec": f"{rel}+{rt}", "workflows": n, "seed": args.seed})
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(args.trace,)) as pool:
        results = list(pool.map(_run, jobs))
    wall = time.perf_counter() - t0
    trace_ok = Path(args.trace).exists()
    record = {
        "schema": "turnstile-policy-bench", "simulated": True, "wall_s": wall,
        "trace": {"path": args.trace if trace_ok else None,
                  "sha256": tree_sha256(args.trace) if trace_ok else None,
                  "arrivals": "real sessions superimposed on Poisson arrivals"},
        "command": "python benchmarks/policy_bench.py" + (" --quick" if args.quick else ""),
        "runs": results,
    }
    (out / "policy_bench.json").write_text(json.dumps(record, indent=1))

    print(f"# Policy benchmarks (simulated; {n} workflows per run; {wall:.0f} s wall)\n")
    for cluster in CLUSTERS:
        rows = [r for r in results if r["study"] == "release" and r["cluster"] == cluster]
        for key in ("p95", "mean"):
            print(f"\n## {cluster}: workflow flow time {key.upper()} "
                  f"(ratio = eager / policy)\n")
            print(_table(rows, key, f"eager+{routing}"))
        sweep: dict[str, list[tuple[float, float, float]]] = {}
        for r in rows:
            f = r["metrics"]["flow_time_s"]
            sweep.setdefault(r["spec"], []).append((r["rate"] * 3600, f["p95"], f["mean"]))
        plot_load_sweep(sweep, out / f"release_sweep_{cluster}.png",
                        metric_label="workflow flow time (s)",
                        title=f"Flow time vs arrival rate, {cluster} (simulated)",
                        x_label="arrival rate (workflows/h)", log_y=True)
    for study, what in (("retention", "retention at equal KV memory (load 0.7, CPU tier 1M "
                                      "tokens/engine)"),
                        ("routing", "routing (load 0.55)")):
        print(f"\n## {what}\n")
        print("| policy | flow P95 | flow mean | prefix hit rate | recomputed prefill tokens |")
        print("|---|---|---|---|---|")
        for r in (r for r in results if r["study"] == study):
            m = r["metrics"]
            print(f"| `{r['spec']}` | {m['flow_time_s']['p95']:,.0f} s | "
                  f"{m['flow_time_s']['mean']:,.0f} s | {m['prefix_hit_rate']:.1%} | "
                  f"{m['recomputed_prefill_tokens'] / 1e6:,.1f} M |")
    print(f"\nwrote {out / 'policy_bench.json'} and the plots")


if __name__ == "__main__":
    main()
