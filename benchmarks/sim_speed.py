"""Simulator speed: simulated iterations and requests per wall second; turnstile vs Vidur.

    .venv/bin/python benchmarks/sim_speed.py [--quick] [--vidur] [--profile] [--out DIR]

Scenarios (all single-threaded Python, so one core; ``--pin CPU`` pins the process and Vidur's):

* **engine alone, decode-heavy**: one :class:`~turnstile.sim.engine.EngineModel` driven in a
  tight loop; ``seqs`` requests (512-token prompts, 4,096 output tokens) decode together and
  every finished one is replaced at once, so the batch stays full (as
  ``benchmarks/engine_speed.py``).
* **full stack, request trace**: :class:`~turnstile.sim.cluster.ClusterSim` (event kernel +
  scheduler core + eager policy + one engine) on independent one-turn requests: the first N rows
  of the Azure LLM 2023 conversation trace (``$TURNSTILE_TRACES/azure_llm_2023_conv``; a seeded
  synthetic stream where absent), prompt + output clipped to 4,096 tokens (Vidur's Llama-3-8B
  context). This is the trace fed to Vidur, read back from the very CSV Vidur reads.
* **full stack, agent sessions**: the same stack on AgentCgroup SWE-rebench sessions
  (``$TURNSTILE_TRACES/agentcgroup_swerebench_claude_code``; the built-in synthetic generator
  where absent) superimposed on Poisson arrivals at offered load 0.7 on two H100 engines, exactly
  as ``turnstile bench --engines 2`` builds its workload.
* **Vidur** (``--vidur``): the request trace through Vidur 0.0.26 in its own throwaway venv
  (``benchmarks/vidur/``; created with ``benchmarks/vidur/setup_venv.sh``), with a synthetic
  roofline profile, the Sarathi scheduler at the same batch cap and token budget; its event loop
  is timed inside its process, apart from imports, predictor training and output writing.
  Without ``--vidur``, or when Vidur cannot run, the ratio is taken against the docs/design.md
  anchor (280-400 simulated requests/s) and labelled so.

* **scaling** (``--scaling``, done by ``benchmarks/sim_scaling.py``): the full stack on a seeded
  synthetic request stream shaped like the request trace at 10k, 100k and 1M requests.

Wall times exclude building the workload; turnstile figures are the median of ``--repeat`` runs
(the request-trace runs are repeated after Vidur's too, to bracket load drift on a shared machine);
CPU (process) times are recorded next to wall times and give a second ratio.
Writes ``DIR/sim_speed.json`` (and ``DIR/profile_agentcgroup.txt`` with ``--profile``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from turnstile.bench.runner import WorkloadSpec, build_workload
from turnstile.build_info import describe as describe_build
from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest
from turnstile.sim.roofline_perf import RooflinePerf
from turnstile.traces import load_trace
from turnstile.workload.model import Turn, Workflow

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRACES = REPO.parent / "shared" / "traces"
AZURE_CSV = TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv"
AGENTCGROUP = TRACES / "agentcgroup_swerebench_claude_code"
VIDUR_PYTHON = Path(os.environ.get("VIDUR_PYTHON", "/tmp/vidur-venv/bin/python"))
#: docs/design.md "Simulator anchors": Vidur 0.0.26, simulated requests per wall second
VIDUR_ANCHOR = (280.0, 400.0)
GOAL_RATIO = 100.0
GOAL_ITERS = 200_000.0

# the request-trace cluster, matched to the Vidur run (Sarathi: batch cap, chunk = token budget)
MAX_SEQS = 128
TOKEN_BUDGET = 2048
MAX_TOKENS = 4096  # Vidur's Llama-3-8B max_model_len
TRACE_DATE = "2023-11-16"


# ----------------------------------------------------------------------------- engine alone


def engine_decode(seqs: int, iters: int) -> dict[str, Any]:
    """Decode-heavy engine alone: ``seqs`` running decoders, replaced as they finish."""
    perf = RooflinePerf("H100", "llama-3.1-8b")
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=100_000, max_num_seqs=seqs), perf)
    n = 0
    for _ in range(seqs):
        eng.submit(SimRequest(n, f"s{n}", 512, 4096), 0.0)
        n += 1
    now = 0.0
    done = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    for _ in range(iters):
        out = eng.step(now)
        if out is None:
            break
        now += out.duration_s
        for _ in out.finished:
            done += 1
            eng.submit(SimRequest(n, f"s{n}", 512, 4096), now)
            n += 1
    wall = time.perf_counter() - t0
    return {"iterations": eng.iterations, "requests": done, "wall_s": wall,
            "cpu_s": time.process_time() - c0, "simulated_s": now}


# ----------------------------------------------------------------------------- workloads


def request_rows(n: int, seed: int = 0,
                 synthetic: bool = False) -> tuple[list[tuple[float, int, int]], str]:
    """``n`` independent requests ``(arrival_s, prompt, output)``, prompt + output <= 4,096:
    the Azure trace's first rows, or (``synthetic`` or no trace) a seeded stream like it."""
    if AZURE_CSV.exists() and not synthetic:
        wfs = load_trace(AZURE_CSV).workflows[:n]
        raw = [(w.arrival_s, w.turns[0].prompt_tokens, w.turns[0].output_tokens) for w in wfs]
        src = f"azure_llm_2023_conv (first {len(raw):,} rows)"
    else:
        rng = np.random.default_rng(seed)
        t = np.cumsum(rng.exponential(1 / 5.5, n))
        p = np.rint(rng.lognormal(np.log(1000), 0.9, n)).astype(int)
        o = np.rint(rng.lognormal(np.log(200), 0.8, n)).astype(int)
        raw = list(zip(t.tolist(), p.tolist(), o.tolist(), strict=True))
        src = f"synthetic Poisson 5.5 req/s, lognormal tokens (seed {seed}; Azure trace absent)"
    rows = []
    for t, p, o in raw:
        o = max(1, min(o, MAX_TOKENS // 2))
        p = max(1, min(p, MAX_TOKENS - o))
        rows.append((round(t, 6), p, o))
    return rows, src


def write_vidur_csv(rows: list[tuple[float, int, int]], path: Path) -> None:
    """The format of Vidur's ``trace_replay`` request generator."""
    with open(path, "w") as f:
        f.write("Date,Time,PromptTokenCount,CompletionTokenCount\n")
        for t, p, o in rows:
            f.write(f"{TRACE_DATE},{t:.6f},{p},{o}\n")


def read_vidur_csv(path: Path) -> list[Workflow]:
    """The CSV back as one-turn workflows (what turnstile runs is exactly what Vidur reads)."""
    wfs = []
    with open(path) as f:
        next(f)
        for i, line in enumerate(f):
            _, t, p, o = line.rstrip("\n").split(",")
            wfs.append(Workflow(f"r{i}", float(t), (Turn(int(p), int(o)),)))
    return wfs


def trace_groups() -> list[EngineGroup]:
    return [EngineGroup(gpu="H100-SXM", model="llama-3.1-8b", count=1, max_num_seqs=MAX_SEQS,
                        max_batched_tokens=TOKEN_BUDGET)]


def agent_workload(n: int) -> tuple[list[Workflow], list[EngineGroup], dict[str, Any]]:
    groups = [EngineGroup(gpu="H100-SXM", model="llama-3.1-8b", count=2)]
    trace = str(AGENTCGROUP) if AGENTCGROUP.exists() else None
    wfs, info = build_workload(WorkloadSpec(trace=trace, workflows=n, load=0.7, seed=0), groups)
    return wfs, groups, info


# ----------------------------------------------------------------------------- full stack


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time, with every run's wall and CPU time attached."""
    runs = sorted(runs, key=lambda r: r["wall_s"])
    med = dict(runs[(len(runs) - 1) // 2])
    med["walls_s"] = [r["wall_s"] for r in runs]
    med["cpus_s"] = [r["cpu_s"] for r in runs]
    return med


def full_stack_once(wfs: list[Workflow], groups: list[EngineGroup],
                    hash_block_tokens: int = 0) -> dict[str, Any]:
    """One run of ClusterSim + eager (``run()`` only; the workload is prebuilt)."""
    sim = ClusterSim(wfs, PolicySet.from_spec("eager"), groups,
                     hash_block_tokens=hash_block_tokens)
    c0 = time.process_time()
    res = sim.run()
    cpu = time.process_time() - c0
    return {"iterations": res.iterations, "events": res.events,
            "requests": sum(len(w.turns) for w in wfs), "workflows": len(wfs),
            "wall_s": res.wall_s, "cpu_s": cpu, "simulated_s": res.makespan_s,
            "engines": len(sim.engines)}


def full_stack(wfs: list[Workflow], groups: list[EngineGroup], repeat: int,
               hash_block_tokens: int = 0) -> dict[str, Any]:
    return _median_run([full_stack_once(wfs, groups, hash_block_tokens) for _ in range(repeat)])


def profile_full_stack(wfs: list[Workflow], groups: list[EngineGroup], out: Path,
                       hash_block_tokens: int = 0, top: int = 25) -> str:
    sim = ClusterSim(wfs, PolicySet.from_spec("eager"), groups,
                     hash_block_tokens=hash_block_tokens)
    prof = cProfile.Profile()
    prof.enable()
    sim.run()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime")
    st.print_stats(top)
    buf.write("\n--- by cumulative time ---\n")
    st.sort_stats("cumulative").print_stats(top)
    text = buf.getvalue()
    (out / "profile_agentcgroup.txt").write_text(text)
    prof.dump_stats(str(out / "profile_agentcgroup.pstats"))
    return text


# ----------------------------------------------------------------------------- Vidur


VIDUR_VARIANTS = (  # (label, native predictor, metrics store)
    ("default (Python predictor)", False, True),
    ("native predictor", True, True),
    ("native predictor, metrics off", True, False),
)


def run_vidur(csv: Path, out: Path, native: bool, metrics: bool,
              timeout: float) -> dict[str, Any]:
    cmd = [str(VIDUR_PYTHON), str(HERE / "vidur" / "run_vidur.py"), str(csv),
           "--cache", str(out / "vidur-cache"), "--out", str(out / "vidur-out"),
           "--batch-cap", str(MAX_SEQS), "--chunk", str(TOKEN_BUDGET),
           "--max-tokens", str(MAX_TOKENS), "--date", TRACE_DATE]
    if native:
        cmd.append("--native")
    if not metrics:
        cmd.append("--no-metrics")
    rec: dict[str, Any] = {"command": shlex.join(cmd), "native_predictor": native,
                           "write_metrics": metrics}
    if not VIDUR_PYTHON.exists():
        rec["error"] = (f"{VIDUR_PYTHON} not found: create the throwaway venv with "
                        "benchmarks/vidur/setup_venv.sh (or set VIDUR_PYTHON)")
        return rec
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           cwd=str(out), check=False)
    except subprocess.TimeoutExpired:
        rec["error"] = f"timed out after {timeout:.0f} s"
        return rec
    rec["process_wall_s"] = time.perf_counter() - t0
    tag = ("-native" if native else "") + ("" if metrics else "-nometrics")
    (out / f"vidur{tag}.log").write_text(p.stdout + p.stderr)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode != 0 or not last.startswith("{"):
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        rec["error"] = f"exit {p.returncode}: " + " | ".join(tail)
        return rec
    rec.update(json.loads(last))
    return rec


# ----------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=False).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "-uno", "--", "src"],
            capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        head, dirty = "", ""
    return {"cpu": cpu, "cores": os.cpu_count(), "git": head + ("+dirty src" if dirty else ""),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None,
            "python": platform.python_version(), "platform": platform.platform(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def results_header(script: str, argv: list[str] | None) -> dict[str, Any]:
    """The command, machine and start time every results JSON of these benchmarks begins with."""
    command = f"benchmarks/{script} " + shlex.join(sys.argv[1:] if argv is None else argv)
    return {"command": command, "machine": machine(),
            # plain Python or the mypyc build (`make compiled`), and whether that is stale
            "build": describe_build(REPO / "src"),
            "python_executable": sys.executable,
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_results(results: dict[str, Any], path: Path) -> None:
    """Add the load average at the end and write ``results`` as JSON."""
    results["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    path.write_text(json.dumps(results, indent=2, default=str))


def _met(m: bool | None) -> str:
    return "n/a" if m is None else "[green]met[/]" if m else "[red]not met[/]"


def _rate(n: float, s: float) -> float:
    return n / s if s > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs (about 10 s without Vidur)")
    ap.add_argument("--vidur", action="store_true",
                    help="also run the request trace through Vidur (needs its throwaway venv)")
    ap.add_argument("--vidur-timeout", type=float, default=1800.0)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the full stack on the agent sessions (also done when its "
                         "iterations/s fall below half the engine-alone figure)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in the trace (default 10,000; 2,000 with --quick)")
    ap.add_argument("--sessions", type=int, default=None,
                    help="agent sessions (default 200; 50 with --quick)")
    ap.add_argument("--repeat", type=int, default=None, help="turnstile runs per scenario")
    ap.add_argument("--pin", type=int, default=None, metavar="CPU",
                    help="pin this process (and Vidur's) to one CPU")
    ap.add_argument("--out", type=Path, default=Path("/tmp/turnstile-sim-speed"))
    ap.add_argument("--scaling", nargs="?", const="10000,100000,1000000", metavar="N,N,...",
                    help="only the scaling runs (benchmarks/sim_scaling.py; default 10k,100k,1M)")
    a = ap.parse_args(argv)
    if a.scaling:
        from sim_scaling import main as scaling_main

        return scaling_main(["--sizes", a.scaling, "--out", str(a.out)])
    q = a.quick
    n_req = a.requests or (2_000 if q else 10_000)
    n_sess = a.sessions or (50 if q else 200)
    repeat = a.repeat or (1 if q else 3)
    iters = 50_000 if q else 300_000
    if a.pin is not None:
        os.sched_setaffinity(0, {a.pin})
    out: Path = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    con = Console(width=None if sys.stdout.isatty() else 180)
    results = results_header("sim_speed.py", argv)
    con.print(f"turnstile build: {results['build']}")
    rows: list[dict[str, Any]] = []

    # 1. engine alone
    for seqs in (1, 32, 256):
        with con.status(f"engine alone, decode-heavy, {seqs} seqs"):
            best = _median_run([engine_decode(seqs, iters) for _ in range(repeat)])
        rows.append({"scenario": f"engine alone, decode, {seqs} seqs", "key": f"engine_{seqs}",
                     "workload": "512-token prompts, 4,096 outputs, refilled", **best})

    # 2. full stack, request trace (the Vidur trace)
    req_rows, req_src = request_rows(n_req)
    csv = out / "trace_vidur.csv"
    write_vidur_csv(req_rows, csv)
    trace_wfs = read_vidur_csv(csv)
    with con.status(f"full stack, request trace ({len(trace_wfs):,} requests)"):
        trace_runs = [full_stack_once(trace_wfs, trace_groups()) for _ in range(repeat)]

    # 3. full stack, agent sessions
    with con.status("loading agent sessions"):
        agent_wfs, agent_groups, info = agent_workload(n_sess)
    hbt = int(info.get("hash_block_tokens", 0) or 0)
    with con.status(f"full stack, agent sessions ({len(agent_wfs)} sessions)"):
        ag = full_stack(agent_wfs, agent_groups, repeat, hbt)

    # 4. Vidur on the same trace, then turnstile on it again (load on a shared machine drifts)
    vidur: list[dict[str, Any]] = []
    if a.vidur:
        for label, native, metrics in VIDUR_VARIANTS:
            with con.status(f"Vidur, {label}, {len(req_rows):,} requests (minutes)"):
                rec = run_vidur(csv, out, native, metrics, a.vidur_timeout)
            rec["label"] = label
            vidur.append(rec)
        with con.status("full stack, request trace, again"):
            trace_runs += [full_stack_once(trace_wfs, trace_groups()) for _ in range(repeat)]
    tr = _median_run(trace_runs)
    rows.append({"scenario": "full stack, request trace", "key": "full_trace",
                 "workload": f"{req_src}, 1 engine", **tr})
    rows.append({"scenario": "full stack, agent sessions", "key": "full_agent",
                 "workload": f"{info['name']}, {len(agent_wfs)} sessions, load 0.7, 2 engines",
                 **ag})
    for r in rows:
        r["iterations_per_s"] = _rate(r["iterations"], r["wall_s"])
        r["requests_per_s"] = _rate(r["requests"], r["wall_s"])
        r["iterations_per_cpu_s"] = _rate(r["iterations"], r["cpu_s"])
    results["turnstile"] = rows
    results["vidur"] = vidur

    tn_rps = _rate(tr["requests"], tr["wall_s"])
    tn_cpu_rps = _rate(tr["requests"], tr["cpu_s"])
    ok = [v for v in vidur if "requests_per_s" in v]
    comparison: dict[str, Any] = {"turnstile_requests_per_s": tn_rps,
                                  "turnstile_requests_per_cpu_s": tn_cpu_rps,
                                  "trace": req_src, "requests": len(req_rows)}
    if ok:
        fastest = max(ok, key=lambda v: v["requests_per_s"])
        comparison.update(
            basis="Vidur measured in this run",
            fastest_vidur=fastest["label"],
            ratio_vs_fastest_vidur=tn_rps / fastest["requests_per_s"],
            ratio_vs_fastest_vidur_cpu=tn_cpu_rps / _rate(fastest["requests"],
                                                          fastest["loop_cpu_s"]),
            ratios={v["label"]: tn_rps / v["requests_per_s"] for v in ok})
    else:
        why = "; ".join(v.get("error", "?") for v in vidur) if vidur else "--vidur not given"
        comparison.update(
            basis=f"docs/design.md anchor, Vidur NOT run here ({why})",
            ratio_vs_fastest_vidur=tn_rps / VIDUR_ANCHOR[1],
            ratios={f"anchor {lo:.0f} req/s": tn_rps / lo for lo in VIDUR_ANCHOR})
    results["comparison"] = comparison

    # 5. profile
    eng32 = next(r for r in rows if r["key"] == "engine_32")["iterations_per_s"]
    ag_rate = rows[-1]["iterations_per_s"]
    if a.profile or ag_rate < 0.5 * eng32:
        with con.status("profiling the full stack on the agent sessions"):
            text = profile_full_stack(agent_wfs, agent_groups, out, hbt)
        results["profile"] = str(out / "profile_agentcgroup.txt")
        con.print(text.split("--- by cumulative")[0].strip()[:6000])

    # tables
    t = Table(title=f"turnstile simulator speed (single-threaded; median of {repeat} runs)")
    for c in ("scenario", "workload", "requests", "iterations", "wall s", "iterations/s",
              "requests/s", "iterations/CPU s"):
        t.add_column(c, justify="left" if c in ("scenario", "workload") else "right")
    for r in rows:
        t.add_row(r["scenario"], r["workload"], f"{r['requests']:,}", f"{r['iterations']:,}",
                  f"{r['wall_s']:.3f}", f"{r['iterations_per_s']:,.0f}",
                  f"{r['requests_per_s']:,.0f}", f"{r['iterations_per_cpu_s']:,.0f}")
    con.print(t)
    v = Table(title=f"same request trace, turnstile vs Vidur ({comparison['basis']})")
    for c in ("simulator", "requests", "iterations", "events", "loop wall s", "requests/s",
              "iterations/s", "loop CPU s", "turnstile × (wall)", "× (CPU)"):
        v.add_column(c, justify="left" if c == "simulator" else "right")
    v.add_row("turnstile (ClusterSim + eager)", f"{tr['requests']:,}", f"{tr['iterations']:,}",
              f"{tr['events']:,}", f"{tr['wall_s']:.3f}", f"{tn_rps:,.0f}",
              f"{_rate(tr['iterations'], tr['wall_s']):,.0f}", f"{tr['cpu_s']:.3f}", "1", "1")
    for x in vidur:
        name = f"Vidur 0.0.26, {x['label']}"
        if "requests_per_s" in x:
            cpu_x = tn_cpu_rps * x["loop_cpu_s"] / x["requests"]
            v.add_row(name, f"{x['requests']:,}", f"{x['batches']:,}", f"{x['events']:,}",
                      f"{x['loop_s']:.2f}", f"{x['requests_per_s']:,.0f}",
                      f"{x['batches_per_s']:,.0f}", f"{x['loop_cpu_s']:.2f}",
                      f"{tn_rps / x['requests_per_s']:,.1f}", f"{cpu_x:,.1f}")
        else:
            v.add_row(name, "-", "-", "-", "-", "failed", "-", "-", "-", "-")
            con.print(f"[red]Vidur ({x['label']}) failed:[/] {x.get('error')}")
    if not ok:
        for lo in VIDUR_ANCHOR:
            v.add_row(f"Vidur, docs/design.md anchor ({lo:.0f} req/s)", "-", "-", "-", "-",
                      f"{lo:,.0f}", "-", "-", f"{tn_rps / lo:,.1f}", "-")
    con.print(v)
    ag_cpu = rows[-1]["iterations_per_cpu_s"]
    eng32_cpu = next(r for r in rows if r["key"] == "engine_32")["iterations_per_cpu_s"]
    ratio_cpu = comparison.get("ratio_vs_fastest_vidur_cpu")
    goals = {
        f"turnstile >= {GOAL_RATIO:.0f}x Vidur (wall)":
            comparison["ratio_vs_fastest_vidur"] >= GOAL_RATIO,
        f"turnstile >= {GOAL_RATIO:.0f}x Vidur (CPU)":
            None if ratio_cpu is None else ratio_cpu >= GOAL_RATIO,
        "engine alone, 32 seqs, >= 200k iterations/s (wall | CPU)":
            (eng32 >= GOAL_ITERS, eng32_cpu >= GOAL_ITERS),
        "full stack, agent sessions, >= 200k iterations/s (wall | CPU)":
            (ag_rate >= GOAL_ITERS, ag_cpu >= GOAL_ITERS),
    }
    results["goals"] = goals
    for g, met in goals.items():
        shown = " | ".join(_met(m) for m in met) if isinstance(met, tuple) else _met(met)
        con.print(f"  goal {g}: {shown}")
    path = out / "sim_speed.json"
    write_results(results, path)
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
