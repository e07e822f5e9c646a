"""A sweep of release policies over many workload families, loads and cluster sizes (simulated).

Used to choose and check the default release policy (``docs/policies.md``): every cell runs
each policy on the *same* workload and reports P95 / mean flow time and TTFT P95 as ratios to
eager (eager / policy: > 1 is better), plus eager's contention share (queueing + recompute as a
fraction of its flow time). Families are split into a *tune* half (parameters were chosen on it)
and a *report* half (never looked at while choosing). Not the robustness suite
(``benchmarks/robustness.py``); a lighter tool for the policy work.

    PYTHONPATH=src python benchmarks/policy_sweep.py --half tune --jobs 2 -o out/sweep_tune.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.bench import runner
from turnstile.bench.metrics import compute_metrics
from turnstile.sim.cluster import EngineGroup, run_sim
from turnstile.workload import synth
from turnstile.workload.model import Workflow
from turnstile.workload.synth_spec import Dist, SynthSpec, ToolSpec


def _spec(name: str, turns: float, first: float, growth: float, out: float, tool_s: float,
          tool_sigma: float = 1.2, out_sigma: float = 0.8, turns_sigma: float = 0.5,
          cap: int | None = 128_000) -> SynthSpec:
    """A lognormal synthetic family: medians of turns, first prompt, growth, output, tool time."""
    return SynthSpec(
        name=name,
        turns=Dist.lognormal(math.log(turns), turns_sigma, 1, 400),
        first_prompt_tokens=Dist.lognormal(math.log(first), 0.5, 50, 120_000),
        input_tokens=Dist.lognormal(math.log(growth), 0.7, 1, 60_000),
        output_tokens=Dist.lognormal(math.log(out), out_sigma, 1, 65_000),
        tools_per_turn=(0.0, 1.0),
        tools=(ToolSpec("t", 1.0, ((1.0, math.log(tool_s), tool_sigma),), max_s=900.0),),
        max_prompt_tokens=cap,
    )


#: synthetic families (medians): turns, first prompt, growth per turn, output, tool time (s)
SYNTH: dict[str, SynthSpec] = {
    # tune half
    "syn-short-chat": _spec("syn-short-chat", 3, 1_000, 300, 300, 2.0),
    "syn-long-ctx": _spec("syn-long-ctx", 30, 30_000, 2_000, 200, 5.0),
    "syn-fast-tools": _spec("syn-fast-tools", 40, 4_000, 500, 250, 0.02, tool_sigma=0.8),
    "syn-reasoning": _spec("syn-reasoning", 10, 3_000, 400, 3_000, 3.0, out_sigma=1.0),
    # report half
    "syn-swe-like": _spec("syn-swe-like", 36, 3_000, 450, 300, 4.0, tool_sigma=0.9,
                          out_sigma=1.3),
    "syn-many-turns": _spec("syn-many-turns", 120, 2_000, 150, 150, 1.0, turns_sigma=0.3),
    "syn-slow-tools": _spec("syn-slow-tools", 15, 8_000, 1_000, 400, 60.0, tool_sigma=1.6),
    "syn-huge-start": _spec("syn-huge-start", 8, 90_000, 5_000, 500, 8.0),
}

#: (family, source) -> half. Real traces: (path, subset, arrivals)
REAL: dict[str, tuple[str, str | None, str]] = {
    "glm47flash": ("agentcgroup_swerebench_claude_code/glm47flash_local", "glm47flash_local",
                   "poisson"),
    "mooncake-conv": ("mooncake_fast25/conversation_trace.jsonl", None, "poisson"),
    "haiku": ("agentcgroup_swerebench_claude_code/haiku", "haiku", "poisson"),
    "tracelab": ("tracelab_example/round_trace.jsonl", None, "poisson"),
    "azure-conv": ("azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv", None, "poisson"),
    "mooncake-trace-arr": ("mooncake_fast25/conversation_trace.jsonl", None, "trace"),
}

HALVES = {
    "tune": ["glm47flash", "mooncake-conv", "syn-short-chat", "syn-long-ctx", "syn-fast-tools",
             "syn-reasoning"],
    "report": ["haiku", "tracelab", "azure-conv", "mooncake-trace-arr", "syn-swe-like",
               "syn-many-turns", "syn-slow-tools", "syn-huge-start"],
}


@dataclass(frozen=True)
class Cell:
    family: str
    load: float
    engines: int
    workflows: int
    seed: int = 0
    slots: int = 0  # llama.cpp-style slot engines (0: paged KV)


@lru_cache(maxsize=8)
def _base(family: str) -> tuple[list[Workflow], int]:
    if family in SYNTH:
        return synth.generate(SYNTH[family], 400, 7), 0
    path, subset, _ = REAL[family]
    from turnstile.traces import default_traces_dir, load_trace

    traces = default_traces_dir()
    if traces is None:
        raise SystemExit(f"{family}: the real traces were not found (set TURNSTILE_TRACES, or "
                         "run scripts/fetch_traces.sh; docs/traces.md)")
    kw = {"subset": subset} if subset else {}
    loaded = load_trace(traces / path, **kw)
    return loaded.workflows, loaded.hash_block_tokens


def _groups(cell: Cell) -> list[EngineGroup]:
    if cell.slots:
        return [EngineGroup(gpu="H100", model="llama-3.1-8b", count=cell.engines,
                            kv_slots=cell.slots, max_num_seqs=cell.slots)]
    return [EngineGroup(gpu="H100", model="llama-3.1-8b", count=cell.engines)]


def workload(cell: Cell) -> tuple[list[Workflow], int]:
    base, hbt = _base(cell.family)
    groups = _groups(cell)
    if cell.family in REAL and REAL[cell.family][2] == "trace":
        wfs = sorted(base, key=lambda w: w.arrival_s)[: cell.workflows]
        # trace arrivals scaled by 1/load (load 1 = the trace's own times)
        t0 = wfs[0].arrival_s
        return [w.shifted((w.arrival_s - t0) / cell.load) for w in wfs], hbt
    rate = cell.load * runner.capacity_rate(base, groups)
    times = synth.poisson_arrivals(rate, cell.workflows, cell.seed)
    return synth.superimpose(base, times, seed=cell.seed), hbt


def contention_share(res: Any) -> float:
    """Eager's queueing + recompute over its flow time: per turn the wait from ready to start
    plus the recomputed context's prefill time (context tokens not served from cache)."""
    num = den = 0.0
    for wf in res.workflows:
        if wf.finished_s < 0:
            continue
        den += wf.finished_s - wf.arrival_s
        for t in wf.turns:
            if t.started_s >= 0:
                num += t.started_s - t.ready_s
                miss = max(0, t.turn.context_tokens - max(t.cached_tokens, 0))
                num += miss * 5e-5  # ~20k tokens/s prefill on H100 8B (order of magnitude)
    return num / den if den else 0.0


def run_cell(cell: Cell, specs: Sequence[str]) -> dict[str, Any]:
    wfs, hbt = workload(cell)
    groups = _groups(cell)
    out: dict[str, Any] = {"cell": cell.__dict__, "policies": {}}
    for spec in specs:
        t0 = time.perf_counter()
        res = run_sim(wfs, spec, groups, hash_block_tokens=hbt)
        m = compute_metrics(res.workflows, engine_stats=res.engine_stats,
                            makespan_s=res.makespan_s)
        row = {"p95": m["flow_time_s"]["p95"], "mean": m["flow_time_s"]["mean"],
               "p50": m["flow_time_s"]["p50"], "ttft_p95": m["ttft_s"]["p95"],
               "hold_max": m["hold_s"]["max"], "hit": m["prefix_hit_rate"],
               "unfinished": m["workflows_unfinished"], "wall_s": time.perf_counter() - t0}
        if spec.startswith("eager"):
            row["contention"] = contention_share(res)
        out["policies"][spec] = row
    return out


def _run(args: tuple[Cell, tuple[str, ...]]) -> dict[str, Any]:
    return run_cell(*args)


def ratios(result: dict[str, Any], base: str) -> dict[str, dict[str, float]]:
    b = result["policies"][base]
    out = {}
    for spec, r in result["policies"].items():
        out[spec] = {k: (b[k] / r[k] if r[k] else float("nan"))
                     for k in ("p95", "mean", "ttft_p95")}
    return out


def markdown(results: list[dict[str, Any]], base: str = "eager") -> str:
    """Per half, one row per cell: eager's contention share, then per policy P95 / mean /
    TTFT P95 ratios to eager (eager / policy), and the geometric mean of the P95 ratios."""
    specs = [s for s in results[0]["policies"] if s != base]
    lines = []
    for half, fams in HALVES.items():
        rows = [r for r in results if r["cell"]["family"] in fams]
        if not rows:
            continue
        lines.append(f"\n**{half} half** (ratios eager/policy, P95 / mean / TTFT P95; > 1 is "
                     "better)\n")
        lines.append("| family | load | engines | eager queue+recompute | "
                     + " | ".join(specs) + " |")
        lines.append("|---|---|---|---|" + "---|" * len(specs))
        for r in rows:
            c, rs = r["cell"], ratios(r, base)
            cont = r["policies"][base].get("contention", float("nan"))
            cells = [f"{rs[s]['p95']:.2f} / {rs[s]['mean']:.2f} / {rs[s]['ttft_p95']:.2f}"
                     for s in specs]
            lines.append(f"| {c['family']} | {c['load']} | {c['engines']}"
                         f"{' slots' if c.get('slots') else ''} | {cont:.0%} | "
                         + " | ".join(cells) + " |")
        gms = []
        for s in specs:
            gm = float(np.exp(np.mean([math.log(ratios(r, base)[s]["p95"]) for r in rows])))
            gms.append(f"{gm:.3f}")
        lines.append("| geometric mean P95 | | | | " + " | ".join(gms) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--half", default="tune", help="tune, report, all or family names (comma)")
    p.add_argument("--loads", default="0.3,0.7,1.2,2.0")
    p.add_argument("--engines", default="1,4")
    p.add_argument("--workflows", type=int, default=200)
    p.add_argument("--slots", type=int, default=0, help="slot engines (llama.cpp-style)")
    p.add_argument("--policies", default="eager,cvar,cvar-fixed,plas")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("-o", "--out", type=Path)
    p.add_argument("--table", type=Path, nargs="+", help="print results JSON as markdown")
    a = p.parse_args(argv)
    if a.table:
        res: list[dict[str, Any]] = []
        for path in a.table:
            res += json.loads(path.read_text())
        print(markdown(res))
        return
    if a.half == "all":
        fams = HALVES["tune"] + HALVES["report"]
    elif a.half in HALVES:
        fams = HALVES[a.half]
    else:
        fams = a.half.split(",")
    specs = tuple(a.policies.split(","))
    cells = [Cell(f, float(ld), int(e), a.workflows, slots=a.slots)
             for f in fams for ld in a.loads.split(",") for e in a.engines.split(",")]
    results = []
    with ProcessPoolExecutor(a.jobs) as pool:
        for res in pool.map(_run, [(c, specs) for c in cells]):
            results.append(res)
            c = res["cell"]
            rs = ratios(res, specs[0])
            cont = res["policies"][specs[0]].get("contention", float("nan"))
            cols = "  ".join(f"{s.split('+')[0]}={r['p95']:.2f}/{r['mean']:.2f}/{r['ttft_p95']:.2f}"
                             for s, r in rs.items() if s != specs[0])
            print(f"{c['family']:18s} L{c['load']:<4} E{c['engines']} cont={cont:.2f}  {cols}",
                  flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1))
    # summary: geometric mean of P95 ratios and worst cells per policy
    for s in specs[1:]:
        r = [ratios(x, specs[0])[s] for x in results]
        gm = float(np.exp(np.mean([math.log(x["p95"]) for x in r])))
        worst = {k: min(x[k] for x in r) for k in ("p95", "mean", "ttft_p95")}
        print(f"{s}: geomean P95 ratio {gm:.3f}; worst P95 {worst['p95']:.3f} mean "
              f"{worst['mean']:.3f} TTFT {worst['ttft_p95']:.3f}", file=sys.stderr)


if __name__ == "__main__":
    main()
