"""``turnstile tune``: choose a policy configuration for a workload by simulation (simulated).

The workload's sessions are split in two halves by a seeded hash of their ids: the *tune*
half chooses, the *report* half (never looked at while choosing) reports. On the tune half
the suite's saturation search (:func:`turnstile.bench.suite.search_saturation`, eager runs)
finds the arrival rate at which eager's queueing + recompute passes
:data:`~turnstile.bench.suite.SATURATION_QUEUE_SHARE` of flow time; the load ladder sits at
:data:`LOADS` × that rate (below, at, and 2× past saturation), the same rates on both halves.
In each (half, load) cell every candidate of the space (:mod:`turnstile.bench.tune_space`)
runs on the half's sessions superimposed on the same seeded Poisson arrivals.

The choice: among the candidates with no harm against eager (the suite's bounds,
:data:`~turnstile.bench.suite_report.NO_HARM`) in *every* load cell of the tune half, the best
*score*, the geometric mean over the load cells of eager's P95 flow time / the candidate's
(> 1: better than eager). Eager itself scores 1 and is always allowed, so there is always a
choice. The halves *agree* when the choice is also without harm on the report half and its
report score is within :data:`AGREE_MARGIN` of the report half's own best; otherwise the
document says they disagree (too little data to trust the choice).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnstile.bench.suite import eager_pressure, search_saturation, summarize_run
from turnstile.bench.suite_backends import make_backend
from turnstile.bench.suite_report import cells_from_runs, no_harm
from turnstile.bench.tune_space import BASELINE, Candidate
from turnstile.sim.engine_group import EngineGroup
from turnstile.workload.model import Workflow

__all__ = ["AGREE_MARGIN", "LOADS", "MIN_HALF_SESSIONS", "REPORT", "TUNE", "TuneConfig",
           "choose", "deploy_line", "run_tune", "split_halves"]

#: the load ladder, as multiples of the measured saturation rate
LOADS = (0.5, 1.0, 2.0)
#: the halves agree when the choice's report score is at least the report best / (1 + this)
AGREE_MARGIN = 0.03
#: fewer sessions than this in a half is too little data, whatever the halves say
MIN_HALF_SESSIONS = 50
#: the two halves' names (the cells' ``family``)
TUNE, REPORT = "tune half", "report half"
SPLITS = {TUNE: "tune", REPORT: "report"}


@dataclass
class TuneConfig:
    groups: list[EngineGroup]
    #: the cluster's label in cells and tables
    cluster: str
    candidates: list[Candidate]
    loads: tuple[float, ...] = LOADS
    search_runs: int = 5
    seed: int = 0
    hash_block_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def specs(self) -> list[str]:
        return [c.spec for c in self.candidates]


def split_halves(workflows: Sequence[Workflow], seed: int = 0
                 ) -> tuple[list[Workflow], list[Workflow]]:
    """(tune, report): the sessions ordered by a seeded hash of their ids, alternately dealt;
    independent of the input order, and of equal sizes (the tune half has the odd one)."""
    def key(w: Workflow) -> str:
        return hashlib.sha256(f"{seed}:{w.id}".encode()).hexdigest()

    ordered = sorted(workflows, key=key)
    return ordered[0::2], ordered[1::2]


# ------------------------------------------------------------------- in a worker
_CACHE: dict[str, list[Workflow]] = {}


def _sessions(task: Mapping[str, Any]) -> list[Workflow]:
    if "sessions" in task:
        return list(task["sessions"])
    path = task["sessions_file"]
    if path not in _CACHE:
        with open(path, "rb") as f:
            _CACHE[path] = pickle.load(f)  # a file this run wrote
    return _CACHE[path]


def _timed(sessions: Sequence[Workflow], rate: float, seed: int) -> list[Workflow]:
    from turnstile.workload import synth

    times = synth.poisson_arrivals(rate, len(sessions), seed)
    return [w.shifted(float(t)) for w, t in zip(sessions, times, strict=True)]


def _run(task: Mapping[str, Any], policy: str, rate: float) -> Any:
    from turnstile.sim.cluster import run_sim

    return run_sim(_timed(_sessions(task), rate, task["seed"]), policy, task["groups"],
                   hash_block_tokens=task["hash_block_tokens"])


def tune_saturation(task: dict[str, Any]) -> dict[str, Any]:
    """The saturation search on the tune half (eager runs). Runs in a worker."""
    from turnstile.bench.runner import capacity_rate

    t0 = time.perf_counter()
    est = capacity_rate(_sessions(task), task["groups"])

    def share(rate: float) -> float:
        return eager_pressure(_run(task, BASELINE, rate), task["groups"])

    out = search_saturation(share, est, task["search_runs"])
    return {**out, "unit": "workflows/s", "search_wall_s": time.perf_counter() - t0}


def tune_cell(task: dict[str, Any]) -> dict[str, Any]:
    """One candidate on one (half, load) cell: the suite's run summary. Runs in a worker."""
    t0 = time.perf_counter()
    res = _run(task, task["policy"], task["intensity"])
    return {**{k: task[k] for k in ("family", "cluster", "load", "basis", "factor",
                                     "intensity", "policy", "workflows")},
            **summarize_run(res, task["groups"]), "sim_wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------- the choice
def _score(cells: Sequence[Mapping[str, Any]], spec: str, half: str) -> float | None:
    ratios = [c["policies"][spec]["ratio"]["p95"] for c in cells
              if c["family"] == half and spec in c["policies"]
              and "ratio" in c["policies"][spec]]
    ratios = [r for r in ratios if r is not None and r > 0 and math.isfinite(r)]
    if not ratios:
        return None
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def rank(cells: Sequence[Mapping[str, Any]], specs: Sequence[str], half: str
         ) -> list[dict[str, Any]]:
    """Per candidate on ``half``: its score, whether it is without harm in every load cell,
    its worst ratios and its misses."""
    out = []
    for spec in specs:
        nh = no_harm(cells, spec, SPLITS, SPLITS[half])
        out.append({"spec": spec, "score": _score(cells, spec, half), "ok": nh["ok"],
                    "worst": nh["worst"], "misses": nh["misses"]})
    return out


def _best(rows: Sequence[Mapping[str, Any]]) -> str:
    allowed = [r for r in rows if r["ok"] and r["score"] is not None] or \
        [r for r in rows if r["spec"] == BASELINE]
    best = allowed[0]
    for r in allowed[1:]:  # strictly better only: ties keep the earlier (simpler) candidate
        if (r["score"] or 0) > (best["score"] or 0) * (1 + 1e-9):
            best = r
    return str(best["spec"])


def choose(cells: Sequence[Mapping[str, Any]], specs: Sequence[str],
           half_sessions: int) -> dict[str, Any]:
    """The choice on the tune half and its check on the report half (see the module's
    docstring): ``chosen``, ``report_best``, ``agree``, the warnings and every candidate's
    rows on both halves."""
    tune_rows, report_rows = rank(cells, specs, TUNE), rank(cells, specs, REPORT)
    chosen, report_best = _best(tune_rows), _best(report_rows)
    by_report = {r["spec"]: r for r in report_rows}
    mine, theirs = by_report[chosen], by_report[report_best]
    agree = bool(mine["ok"] and mine["score"] is not None and theirs["score"] is not None
                 and mine["score"] >= theirs["score"] / (1 + AGREE_MARGIN))
    warnings = []
    if not agree:
        how = "no harm" if mine["ok"] else f"harms eager in {len(mine['misses'])} cell(s)"
        warnings.append(
            f"the halves disagree: the tune half chose {chosen} (on the report half: P95 "
            f"gain {_x(mine['score'])}, {how}); the report half would choose {report_best} "
            f"(P95 gain {_x(theirs['score'])}): too little data to trust the choice; record "
            "more sessions and tune again")
    if half_sessions < MIN_HALF_SESSIONS:
        warnings.append(f"only {half_sessions} sessions per half (fewer than "
                        f"{MIN_HALF_SESSIONS}): too little data to trust the choice")
    return {"chosen": chosen, "report_best": report_best, "agree": agree,
            "warnings": warnings, "tune": tune_rows, "report": report_rows}


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def deploy_line(spec: str, engines: int = 1) -> str:
    """The ``serve`` command that deploys ``spec`` (one ``--engine`` per engine)."""
    urls = " ".join(f"--engine URL{i + 1 if engines > 1 else ''}" for i in range(engines))
    return f"turnstile serve --policy '{spec}' {urls}"


# ------------------------------------------------------------------- the driver
def _cell_tasks(config: TuneConfig, saturation: float, halves: Mapping[str, Mapping[str, Any]]
                ) -> list[dict[str, Any]]:
    tasks = []
    for half, src in halves.items():
        for factor in config.loads:
            for spec in config.specs:
                tasks.append({**src, "family": half, "cluster": config.cluster,
                              "load": f"sat×{factor:g}", "basis": "measured",
                              "factor": factor, "intensity": saturation * factor,
                              "policy": spec})
    return tasks


def run_tune(workflows: Sequence[Workflow], config: TuneConfig, *, ray: str | None = None,
             workers: int | None = None,
             on_progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Tune on ``workflows`` (see the module's docstring); returns the ``results.json``
    document. ``on_progress(done, total, what)`` after every finished run."""
    from turnstile import __version__

    tune_half, report_half = split_halves(workflows, config.seed)
    if not tune_half or not report_half:
        raise ValueError(f"tune needs at least 2 sessions; the workload has {len(workflows)}")
    total = 1 + 2 * len(config.loads) * len(config.specs)
    backend = make_backend(ray, workers)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="turnstile-tune-") as tmp:
        halves = {}
        for half, sessions in ((TUNE, tune_half), (REPORT, report_half)):
            src: dict[str, Any] = {"groups": config.groups, "seed": config.seed,
                                   "hash_block_tokens": config.hash_block_tokens,
                                   "workflows": len(sessions)}
            if ray:  # Ray workers may be on other hosts: the sessions travel with the task
                src["sessions"] = sessions
            else:  # local processes read them once each from a file
                path = Path(tmp) / f"{SPLITS[half]}.pickle"
                path.write_bytes(pickle.dumps(sessions, protocol=pickle.HIGHEST_PROTOCOL))
                src["sessions_file"] = str(path)
            halves[half] = src
        try:
            sat, runs = _drive(backend, config, halves, total, on_progress)
        finally:
            backend.close()
    cells = cells_from_runs(runs, config.specs)
    verdict = choose(cells, config.specs, len(report_half))
    if not sat["found"]:
        verdict["warnings"].append(
            "eager never saturated this cluster in the search: every load cell is below "
            "saturation, where candidates differ little")
    return {
        "schema": "turnstile-tune", "version": 1, "turnstile_version": __version__,
        "kind": "tune", "simulated": True, **verdict,
        "deploy": deploy_line(verdict["chosen"], sum(g.count for g in config.groups)),
        "sessions": {"tune": len(tune_half), "report": len(report_half)},
        "candidates": [{"spec": c.spec, "note": c.note} for c in config.candidates],
        "config": {"cluster": config.cluster, "policies": config.specs,
                   "loads": [{"basis": "measured", "factor": f} for f in config.loads],
                   "search_runs": config.search_runs, "seed": config.seed,
                   "agree_margin": AGREE_MARGIN, **config.extra},
        "saturation": sat, "backend": backend.name, "wall_s": time.perf_counter() - t0,
        "cells": cells,
    }


def _drive(backend: Any, config: TuneConfig, halves: Mapping[str, Mapping[str, Any]],
           total: int, on_progress: Callable[[int, int, str], None] | None
           ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The saturation search, then every cell as soon as it ends."""
    search = backend.submit(tune_saturation, {**halves[TUNE],
                                              "search_runs": config.search_runs})
    sat: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    pending = {search}
    done_n = 0
    while pending:
        done, pending = backend.wait_any(pending)
        for h in done:
            out = backend.result(h)
            done_n += 1
            if h == search:
                sat = out
                for task in _cell_tasks(config, out["saturation"], halves):
                    pending.add(backend.submit(tune_cell, task))
                what = f"saturation {out['saturation']:.3g} workflows/s"
            else:
                runs.append(out)
                what = f"{out['policy']} · {out['family']} · {out['load']}"
            if on_progress is not None:
                on_progress(done_n, total, what)
    return sat, runs
