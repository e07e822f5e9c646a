"""The robustness suite: every policy side by side on many workload families, clusters and
loads, in one run (simulated). ``turnstile bench --suite quick|full`` and
``benchmarks/robustness.py`` run it; the report is :mod:`turnstile.bench.suite_report`.

The gateway-facing cells — every family whose sessions reach the gateway keyed
(:attr:`~turnstile.bench.families.Family.keyed`: agent sessions, the closed worker pool) — run
with *unannounced ends* by default (``SuiteConfig.unannounced_ends``): the policies are not told
when a workflow ends, and sessions close by the gateway's idle rule after ``session_idle_s``, as
in production (:class:`~turnstile.sim.cluster.ClusterSim`). Request traces without session keys
(the gateway closes a one-turn session at its answer) keep announced ends.

A *cell* is (family, cluster, load); every policy runs on the cell's identical workload, and
each is compared with ``eager`` on it (ratios eager / policy: > 1 is better than eager).

Loads are placed two ways, and each cell says which (``basis``):

* ``measured``: a short search over eager runs finds the *saturation point*, the lowest
  intensity (arrival rate, or workers for a closed loop) at which eager's queueing delay (every
  turn's ready → started, summed) plus its recompute time (prefill tokens computed again after
  an eviction or a preemption, at the engine's prefill rate: an engine that admits every turn
  and thrashes its KV queues nothing but recomputes) passes :data:`SATURATION_QUEUE_SHARE` of
  the workflows' flow time (summed); cells sit at multiples of it;
* ``estimate``: a multiple of :func:`turnstile.bench.runner.capacity_rate`, the same estimate
  ``turnstile bench --load`` uses.

Runs are independent processes' work: a local :class:`~concurrent.futures.ProcessPoolExecutor`
by default, or Ray tasks (``ray=`` an address, ``"auto"``, or ``"local"``; Ray is the optional
``ray`` extra). Saturation searches run first, and each one's cells start as soon as it ends.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from turnstile.bench.families import FAMILIES, get_family
from turnstile.bench.suite_backends import make_backend
from turnstile.core.session_idle import SESSION_IDLE_S
from turnstile.policies import resolved_spec
from turnstile.sim.engine_group import EngineGroup

__all__ = [
    "CLUSTERS",
    "SATURATION_QUEUE_SHARE",
    "Cluster",
    "LoadPoint",
    "SuiteConfig",
    "default_policy_spec",
    "run_suite",
    "suite_config",
]

#: eager's queueing delay as a share of flow time that marks saturation
SATURATION_QUEUE_SHARE = 0.10


def default_policy_spec() -> str:
    """The policy ``bench``, ``serve`` and ``make demo`` use when none is named: the policies
    package's ``DEFAULT_SPEC`` when it declares one, else its default release policy
    (``DEFAULTS["release"]``; the other kinds take their defaults in a spec anyway)."""
    from turnstile import policies

    spec = getattr(policies, "DEFAULT_SPEC", None)
    if isinstance(spec, str) and spec:
        return spec
    return str(policies.DEFAULTS.get("release") or "eager")


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: str = "H100"
    model: str = "llama-3.1-8b"
    tp: int = 1
    count: int = 4
    #: llama.cpp-style slot engine: this many slots of ``slot_tokens`` each (0: paged KV)
    kv_slots: int = 0
    slot_tokens: int = 0

    def groups(self) -> list[EngineGroup]:
        slots: dict[str, int] = {}
        if self.kv_slots:
            slots = {"kv_slots": self.kv_slots, "slot_tokens": self.slot_tokens,
                     "max_num_seqs": self.kv_slots}
        return [EngineGroup(gpu=self.gpu, model=self.model, tp=self.tp, count=self.count,
                            **slots)]


CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    Cluster("4xH100-8B"),
    Cluster("1xH100-8B", count=1),
    Cluster("16xH100-8B", count=16),
    Cluster("4xH100-70B-TP4", model="llama-3.1-70b", tp=4),
    Cluster("4xH100-8B-slots", kv_slots=4, slot_tokens=131_072),
)}


@dataclass(frozen=True)
class LoadPoint:
    #: measured (× the measured saturation point) or estimate (× the capacity estimate)
    basis: str
    factor: float

    @property
    def label(self) -> str:
        return f"{'sat' if self.basis == 'measured' else 'est'}×{self.factor:g}"


@dataclass
class SuiteConfig:
    name: str
    #: (family, cluster) pairs; each becomes one saturation search and len(loads) cells
    pairs: list[tuple[str, str]]
    loads: list[LoadPoint]
    policies: list[str]
    #: sessions per cell: this many per engine, within [min_workflows, max_workflows]
    workflows_per_engine: int = 15
    min_workflows: int = 30
    max_workflows: int = 200
    #: eager runs the saturation search may spend per (family, cluster)
    search_runs: int = 5
    seed: int = 0
    #: the gateway-facing (keyed) families' workflow ends are not announced to the policies;
    #: their sessions close after ``session_idle_s`` idle (the gateway's rule)
    unannounced_ends: bool = True
    session_idle_s: float = SESSION_IDLE_S
    extra: dict[str, Any] = field(default_factory=dict)

    def workflows_for(self, cluster: Cluster) -> int:
        n = self.workflows_per_engine * cluster.count
        return max(self.min_workflows, min(self.max_workflows, n))

    def idle_for(self, family: str) -> float | None:
        """The family's cells' ``session_idle_s`` (None: workflow ends are announced)."""
        if self.unannounced_ends and get_family(family).keyed:
            return self.session_idle_s
        return None


def _policies(policies: Iterable[str] | None) -> list[str]:
    out = ["eager"]
    wanted = list(policies) if policies is not None else ["plas", "cvar", default_policy_spec()]
    for p in wanted:
        if p not in out:
            out.append(p)
    return out


def suite_config(name: str, policies: Iterable[str] | None = None,
                 families: Iterable[str] | None = None, seed: int = 0, *,
                 unannounced_ends: bool = True,
                 session_idle_s: float = SESSION_IDLE_S) -> SuiteConfig:
    """The ``quick`` (CI, ≤ 3 min on 2 cores) or ``full`` (≤ 20 min) suite; ``unannounced_ends``
    and ``session_idle_s`` as in :class:`SuiteConfig`."""
    cfg = _suite_config(name, policies, families, seed)
    cfg.unannounced_ends = unannounced_ends
    cfg.session_idle_s = session_idle_s
    return cfg


def _suite_config(name: str, policies: Iterable[str] | None,
                  families: Iterable[str] | None, seed: int) -> SuiteConfig:
    pols = _policies(policies)
    if name == "quick":
        fams = list(families) if families is not None else [f.name for f in FAMILIES if f.quick]
        return SuiteConfig("quick", [(f, "4xH100-8B") for f in fams],
                           [LoadPoint("measured", 0.5), LoadPoint("measured", 2.0),
                            LoadPoint("estimate", 1.2)],
                           pols, workflows_per_engine=30, min_workflows=40, max_workflows=120,
                           search_runs=4, seed=seed)
    if name != "full":
        raise ValueError(f"unknown suite {name!r}; use quick or full")
    fams = list(families) if families is not None else [f.name for f in FAMILIES]
    pairs = [(f, "4xH100-8B") for f in fams]
    # the other clusters on a spread of families (both halves), to bound the run time
    for f in ("agentcgroup-glm", "agentcgroup-haiku", "syn-agentcgroup-fit", "azure-conv",
              "aiperf-agentic-code"):
        if f in fams:
            pairs += [(f, "1xH100-8B"), (f, "4xH100-8B-slots"), (f, "4xH100-70B-TP4")]
    for f in ("agentcgroup-haiku", "syn-agentcgroup-fit"):
        if f in fams:
            pairs.append((f, "16xH100-8B"))
    return SuiteConfig("full", pairs,
                       [LoadPoint("measured", 0.5), LoadPoint("measured", 1.0),
                        LoadPoint("measured", 2.0), LoadPoint("estimate", 1.2)],
                       pols, workflows_per_engine=30, min_workflows=40, max_workflows=200,
                       search_runs=5, seed=seed)


# ------------------------------------------------------------------ one run (in a worker)
def _workload(family: str, cluster: Cluster, n: int, intensity: float, seed: int):
    """The cell's sessions at ``intensity`` (rate, or workers for a closed loop)."""
    from turnstile.workload import synth

    fam = get_family(family)
    sessions, info = fam.sessions(n, seed)
    if fam.arrivals == "closed":
        return sessions, info
    times = synth.poisson_arrivals(intensity, len(sessions), seed)
    return [w.shifted(float(t)) for w, t in zip(sessions, times, strict=True)], info


def _simulate(family: str, cluster: Cluster, n: int, intensity: float, policy: str,
              seed: int, session_idle_s: float | None = None) -> tuple[Any, dict[str, Any]]:
    from turnstile.sim.closed_loop import run_closed_loop
    from turnstile.sim.cluster import run_sim

    wfs, info = _workload(family, cluster, n, intensity, seed)
    kw: dict[str, Any] = {"hash_block_tokens": int(info.get("hash_block_tokens") or 0),
                          "session_idle_s": session_idle_s}
    if get_family(family).arrivals == "closed":
        res = run_closed_loop(wfs, max(1, round(intensity)), policy, cluster.groups(), **kw)
    else:
        res = run_sim(wfs, policy, cluster.groups(), **kw)
    return res, info


def _queue_share(records: list[Any]) -> float:
    wait_s = flow_s = 0.0
    for wf in records:
        last = -1.0
        for t in wf.turns:
            if t.started_s >= 0 and t.ready_s >= 0:
                wait_s += t.started_s - t.ready_s
            last = max(last, t.finished_s)
        if last >= 0:
            flow_s += last - wf.arrival_s
    return wait_s / flow_s if flow_s > 0 else 0.0


def _share_of_flow(records: list[Any], seconds: float) -> float:
    flow_s = sum(max(t.finished_s for t in wf.turns) - wf.arrival_s
                 for wf in records if wf.turns)
    return seconds / flow_s if flow_s > 0 else 0.0


def summarize_run(res: Any, groups: list[EngineGroup]) -> dict[str, Any]:
    """A simulated run's summary: the flow-time, TTFT and hold percentiles, throughput,
    prefix hits, recompute and the queue and recompute shares of flow time (what a cell keeps
    per policy; the suite and ``turnstile tune`` alike)."""
    from turnstile.bench.metrics import compute_metrics
    from turnstile.sim.roofline_perf import load_gpu

    gpu = load_gpu(groups[0].gpu)
    m = compute_metrics(res.workflows, engine_stats=res.engine_stats, makespan_s=res.makespan_s,
                        gpu_price_per_h=gpu.price_per_hour, gpu_power_w=gpu.power_w,
                        num_gpus=res.num_gpus)
    flow_sum = sum(m["_flow_times_s"]) or 1.0
    recomputed = m.get("recomputed_prefill_tokens") or 0
    return {
        "flow_p50_s": m["flow_time_s"]["p50"], "flow_p95_s": m["flow_time_s"]["p95"],
        "flow_mean_s": m["flow_time_s"]["mean"], "ttft_p95_s": m["ttft_s"]["p95"],
        "hold_p95_s": m["hold_s"]["p95"], "hold_max_s": m["hold_s"]["max"],
        "makespan_s": m["makespan_s"], "turns": m["turns"],
        "output_tokens_per_s": m["throughput"]["output_tokens_per_s"],
        "prefix_hit_rate": m["prefix_hit_rate"], "recomputed_prefill_tokens": recomputed,
        "queue_share": _queue_share(res.workflows),
        # recompute time (recomputed tokens at the engine's 8k-chunk prefill rate) / flow
        "recompute_share_est": recomputed * prefill_s_per_token(groups) / flow_sum,
    }


def prefill_s_per_token(groups: list[EngineGroup]) -> float:
    """Seconds one token of prefill takes at the first group's 8k-chunk rate."""
    return groups[0].build_perf().step_time(8192, 0, 0) / 8192


def eager_pressure(res: Any, groups: list[EngineGroup]) -> float:
    """Queueing + recompute time as a share of flow time (summed over workflows): the
    quantity whose crossing of :data:`SATURATION_QUEUE_SHARE` marks saturation."""
    recomputed = sum(int(s.get("recomputed_tokens", 0)) for s in res.engine_stats.values())
    return _queue_share(res.workflows) + _share_of_flow(res.workflows,
                                                        recomputed * prefill_s_per_token(groups))


def run_one(task: dict[str, Any]) -> dict[str, Any]:
    """One policy on one cell's workload: a summary of its metrics (runs in a worker)."""
    cluster = CLUSTERS[task["cluster"]]
    t0 = time.perf_counter()
    idle = task.get("session_idle_s")
    res, _info = _simulate(task["family"], cluster, task["workflows"], task["intensity"],
                           task["policy"], task["seed"], idle)
    return {
        **{k: task[k] for k in ("family", "cluster", "load", "basis", "factor", "intensity",
                                 "policy", "workflows")},
        **summarize_run(res, cluster.groups()),
        "session_ends": "announced" if idle is None else f"idle {idle:g} s",
        "sim_wall_s": time.perf_counter() - t0,
    }


def _capacity(family: str, cluster: Cluster, n: int, seed: int) -> float:
    """The capacity estimate as an intensity: workflows/s, or workers for a closed loop
    (Little's law: the rate × a session's service + tool time)."""
    from turnstile.bench.runner import capacity_rate, workflow_service_s

    sessions, _ = get_family(family).sessions(n, seed)
    groups = cluster.groups()
    rate = capacity_rate(sessions, groups)
    if get_family(family).arrivals != "closed":
        return rate
    perf = groups[0].build_perf()
    per = [workflow_service_s(w, perf) + sum(t.tool_duration_s for t in w.turns)  # type: ignore[arg-type]
           for w in sessions[:100]]
    return max(1.0, rate * sum(per) / len(per))


def search_saturation(share: Callable[[float], float], estimate: float, budget: int, *,
                      closed: bool = False) -> dict[str, Any]:
    """The lowest intensity whose ``share(intensity)`` passes :data:`SATURATION_QUEUE_SHARE`:
    from ``estimate``, quarter or quadruple until the threshold is bracketed, then bisect
    (geometrically) with the ``budget`` probes left. ``closed``: intensities are worker
    counts (rounded, each probed once)."""
    probes: list[tuple[float, float]] = []

    def probe(x: float) -> float:
        if closed:
            x = float(max(1, round(x)))
        q = share(x)
        probes.append((x, q))
        return q

    lo, hi = 0.0, math.inf
    x = estimate
    while len(probes) < budget:
        if probe(x) >= SATURATION_QUEUE_SHARE:
            hi = x
            x = x / 4 if lo == 0.0 else math.sqrt(lo * hi)
        else:
            lo = x
            x = x * 4 if math.isinf(hi) else math.sqrt(lo * hi)
        if closed and max(1, round(x)) in {max(1, round(p)) for p, _ in probes}:
            break
    found = not math.isinf(hi)
    return {"estimate": estimate, "saturation": hi if found else max(lo, estimate),
            "bracket": [lo, None if math.isinf(hi) else hi], "found": found,
            "probes": [{"intensity": p, "queue_recompute_share": q} for p, q in probes]}


def find_saturation(task: dict[str, Any]) -> dict[str, Any]:
    """:func:`search_saturation` over eager runs of one (family, cluster). Runs in a
    worker."""
    family, cluster = task["family"], CLUSTERS[task["cluster"]]
    n, seed, budget = task["workflows"], task["seed"], task["search_runs"]
    idle = task.get("session_idle_s")
    closed = get_family(family).arrivals == "closed"
    est = _capacity(family, cluster, n, seed)
    t0 = time.perf_counter()

    def share(x: float) -> float:
        res, _ = _simulate(family, cluster, n, x, "eager", seed, idle)
        return eager_pressure(res, cluster.groups())

    found = search_saturation(share, est, budget, closed=closed)
    return {"family": family, "cluster": cluster.name, **found,
            "unit": "workers" if closed else "workflows/s",
            "search_wall_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------------- driver
def run_suite(config: SuiteConfig, *, ray: str | None = None, workers: int | None = None,
              on_progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Run the suite; returns the ``results.json`` document (see
    :func:`turnstile.bench.suite_report.write_suite`). ``on_progress(done, total, what)``."""
    from turnstile import __version__

    available: list[tuple[str, str]] = []
    skipped: list[dict[str, str]] = []
    for fam, cl in config.pairs:
        try:
            get_family(fam).sessions(1, config.seed)
            available.append((fam, cl))
        except FileNotFoundError as e:
            skipped.append({"family": fam, "cluster": cl, "why": str(e)})
    total = len(available) * (1 + len(config.loads) * len(config.policies))
    backend = make_backend(ray, workers)
    t0 = time.perf_counter()
    searches: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    kinds: dict[Any, str] = {}
    done_n = 0
    try:
        pending: set[Any] = set()
        for fam, cl in available:
            task = {"family": fam, "cluster": cl, "seed": config.seed,
                    "workflows": config.workflows_for(CLUSTERS[cl]),
                    "search_runs": config.search_runs,
                    "session_idle_s": config.idle_for(fam)}
            h = backend.submit(find_saturation, task)
            kinds[h] = "search"
            pending.add(h)
        while pending:
            done, pending = backend.wait_any(pending)
            for h in done:
                out = backend.result(h)
                done_n += 1
                if kinds.pop(h) == "search":
                    searches.append(out)
                    for task in _cell_tasks(config, out):
                        nh = backend.submit(run_one, task)
                        kinds[nh] = "run"
                        pending.add(nh)
                    what = f"saturation {out['family']} on {out['cluster']}"
                else:
                    runs.append(out)
                    what = f"{out['policy']} · {out['family']} · {out['load']}"
                if on_progress is not None:
                    on_progress(done_n, total, what)
    finally:
        backend.close()
    from turnstile.bench.suite_report import cells_from_runs

    return {
        "schema": "turnstile-robustness", "version": 1, "turnstile_version": __version__,
        "kind": "robustness",
        "simulated": True, "suite": config.name,
        "config": {**asdict(config), "pairs": [list(p) for p in config.pairs],
                   "saturation_queue_share": SATURATION_QUEUE_SHARE,
                   "default_policy": default_policy_spec(),
                   "resolved_policies": {p: resolved_spec(p) for p in config.policies}},
        "backend": backend.name, "wall_s": time.perf_counter() - t0,
        "families": [{"name": f.name, "kind": f.kind, "split": f.split, "describe": f.describe,
                      "arrivals": f.arrivals,
                      "session_ends": "announced" if config.idle_for(f.name) is None
                      else "unannounced"} for f in FAMILIES
                     if f.name in {p[0] for p in config.pairs}],
        "skipped": skipped, "saturation": sorted(searches, key=lambda s: (s["family"],
                                                                          s["cluster"])),
        "cells": cells_from_runs(runs, config.policies),
    }


def _cell_tasks(config: SuiteConfig, search: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = CLUSTERS[search["cluster"]]
    tasks = []
    for lp in config.loads:
        base = search["saturation"] if lp.basis == "measured" else search["estimate"]
        intensity = base * lp.factor
        if search["unit"] == "workers":
            intensity = float(max(1, round(intensity)))
        for pol in config.policies:
            tasks.append({"family": search["family"], "cluster": cluster.name,
                          "load": lp.label, "basis": lp.basis, "factor": lp.factor,
                          "intensity": intensity, "policy": pol, "seed": config.seed,
                          "workflows": config.workflows_for(cluster),
                          "session_idle_s": config.idle_for(search["family"])})
    return tasks


def run_with_progress(name: str, out_dir: str | os.PathLike[str], *,
                      policies: Iterable[str] | None = None,
                      families: Iterable[str] | None = None, seed: int = 0,
                      ray: str | None = None, workers: int | None = None,
                      console: Any = None, quiet: bool = False,
                      unannounced_ends: bool = True,
                      session_idle_s: float = SESSION_IDLE_S) -> dict[str, Any]:
    """Run a suite with a progress bar (stderr, with ETA; none when ``quiet`` or stderr is not
    a terminal), write its report to ``out_dir`` and print the no-harm verdict per policy and
    half on ``console`` (what ``turnstile bench --suite`` and ``benchmarks/robustness.py``
    call)."""
    from rich.console import Console
    from rich.table import Table

    from turnstile.bench.progress import progress_bar
    from turnstile.bench.suite_report import no_harm, write_suite

    con = console or Console(stderr=True)
    config = suite_config(name, policies, families, seed, unannounced_ends=unannounced_ends,
                          session_idle_s=session_idle_s)
    with progress_bar(quiet=quiet) as bar:
        task = bar.add_task(f"suite {name}", total=None)

        def step(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what[:60])

        doc = run_suite(config, ray=ray, workers=workers, on_progress=step)
    paths = write_suite(doc, out_dir)
    splits = {f["name"]: f["split"] for f in doc["families"]}
    ends = (f"keyed sessions' ends unannounced, idle close {session_idle_s:g} s"
            if unannounced_ends else "workflow ends announced")
    table = Table(title=f"robustness suite '{name}' (simulated; {ends}): worst cell vs eager "
                  "(eager / policy; no harm: P95, mean ≥ 0.97, TTFT P95 ≥ 0.91)")
    for col in ("policy", "half", "worst P95", "worst mean", "worst TTFT P95", "misses"):
        table.add_column(col, justify="left" if col in ("policy", "half") else "right")
    for pol in config.policies[1:]:
        for split in ("tune", "report"):
            nh = no_harm(doc["cells"], pol, splits, split)
            if not nh["worst"]:
                continue
            cells = []
            for k in ("p95", "mean", "ttft_p95"):
                r = nh["worst"].get(k, {}).get("ratio")
                bound = 1 / (1.10 if k == "ttft_p95" else 1.03)
                txt = "–" if r is None else f"{r:.2f}×"
                cells.append(f"[bold red]{txt}[/]" if r is not None and r < bound else txt)
            table.add_row(pol, split, *cells, str(len(nh["misses"])))
    con.print(table)
    con.print(f"{len(doc['cells'])} cells in {doc['wall_s']:.0f} s on {doc['backend']}; "
              "wrote " + ", ".join(str(p) for p in paths.values()))
    if "heatmap" not in paths:
        con.print("[dim]heatmap.png needs matplotlib: pip install 'turnstile[plots]' "
                  "(report.html has the heat map); skipped[/]")
    if doc["skipped"]:
        con.print("[dim]skipped: " + ", ".join(s["family"] for s in doc["skipped"]) + "[/]")
    return doc
