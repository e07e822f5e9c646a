"""Run metrics, computed once at the end of a run from the scheduler's records.

The definitions are docs/design.md's "Metrics" section, used by every driver (the simulator's
``turnstile bench`` and the real-engine replay):

* workflow flow time = the last turn's ``finished_s`` − the workflow's ``arrival_s`` (tool time
  between turns included; a tool call *after* the last turn is not);
* TTFT = ``ready_s`` → ``first_token_s``: it includes turnstile's own holding queue on purpose;
  ``engine_ttft_s`` = ``released_s`` → ``first_token_s`` is the engine's part (its queue +
  prefill), ``hold_s`` = ``ready_s`` → ``released_s`` is turnstile's part;
* TPOT = (``finished_s`` − ``first_token_s``) / (output tokens − 1), over turns with ≥ 2 output
  tokens;
* e2e (per turn) = ``ready_s`` → ``finished_s``.

:func:`compute_metrics` returns one JSON-serializable dict. Per-sample arrays a plot needs (the
flow time of every finished workflow) ride along under keys that start with ``_``
(:data:`PRIVATE_PREFIX`): :func:`public_metrics` (and :func:`turnstile.bench.report.write_results`)
strip them, so ``results.json`` holds summaries only.

Percentiles use numpy's default (linear interpolation between order statistics). Every summary
of an empty sample is ``{"count": 0, "mean": None, ...}``; no input makes this module raise.

Speed: the records are read once, attribute by attribute, into numpy arrays
(``np.fromiter(map(attrgetter(...)))``); everything after that is vectorized. 10^6 turns take
about half a second, almost all of it reading the Python objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from turnstile.core.state import TurnRecord, WorkflowRecord

__all__ = [
    "ENGINE_STAT_KEYS",
    "PRIVATE_PREFIX",
    "compute_metrics",
    "public_metrics",
    "quantile",
    "summarize",
]

#: keys that start with this are samples for plots, never written to results.json
PRIVATE_PREFIX = "_"

#: canonical ``engine_stats`` keys (per engine, cumulative over the run) → accepted aliases.
#: Every other numeric key is summed into ``engine_totals`` as is.
ENGINE_STAT_KEYS: dict[str, tuple[str, ...]] = {
    # prompt tokens the engine was asked to prefill (denominator of the hit rate)
    "prompt_tokens": ("prompt_tokens",),
    # prompt tokens served from the prefix cache (GPU or offload tier)
    "prefix_hit_tokens": ("prefix_hit_tokens", "cached_tokens", "hit_tokens"),
    # prefill tokens computed again that had been computed before (evicted context, preemption)
    "recomputed_prefill_tokens": ("recomputed_prefill_tokens", "recomputed_tokens"),
    "preemptions": ("preemptions", "num_preemptions"),
    # KV held by sessions paused in a tool call, integrated over time (GB·s)
    "paused_kv_gb_s": ("paused_kv_gb_s",),
}

_PERCENTILES = (50.0, 95.0, 99.0)
FloatArray = npt.NDArray[np.float64]


def _float(x: float | np.floating[Any]) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def quantile(values: npt.ArrayLike, q: float) -> float | None:
    """The ``q``-th percentile (0-100) of a sample, ``None`` when it is empty: the one quantile
    rule of every table, report, plot legend and ``results.json`` (linear interpolation
    between order statistics, numpy's default)."""
    a = np.asarray(values, dtype=np.float64)
    return None if a.size == 0 else _float(np.percentile(a, q))


def summarize(values: npt.ArrayLike) -> dict[str, float | int | None]:
    """``{count, mean, p50, p95, p99, max}`` of a sample; ``None`` statistics when empty.
    The percentiles follow :func:`quantile`."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    p50, p95, p99 = np.percentile(a, _PERCENTILES)
    return {
        "count": int(a.size),
        "mean": _float(a.mean()),
        "p50": _float(p50),
        "p95": _float(p95),
        "p99": _float(p99),
        "max": _float(a.max()),
    }


def _ratio(num: float, den: float) -> float | None:
    return _float(num / den) if den > 0 else None


def _column(turns: list[TurnRecord], attr: str, dtype: type = np.float64) -> npt.NDArray[Any]:
    return np.fromiter(map(attrgetter(attr), turns), dtype, count=len(turns))


_ALIASES = {alias: key for key, aliases in ENGINE_STAT_KEYS.items() for alias in aliases}


def _engine_totals(engine_stats: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    """Sum every numeric counter over engines, aliases renamed to their canonical key."""
    totals: dict[str, Any] = {}
    for stats in (engine_stats or {}).values():
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                continue
            name = _ALIASES.get(key, key)
            totals[name] = totals.get(name, 0) + value
    return {k: (int(v) if float(v).is_integer() else _float(v)) for k, v in totals.items()}


def compute_metrics(
    workflows: Iterable[WorkflowRecord],
    *,
    engine_stats: Mapping[str, Mapping[str, Any]] | None = None,
    makespan_s: float,
    gpu_price_per_h: float | None = None,
    gpu_power_w: float | None = None,
    num_gpus: int = 1,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    slo_scale_k: float | None = None,
    standalone_s: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Summarize one run. See the module docstring for the definitions.

    ``workflows``: every workflow record of the run (finished or not). A workflow counts as
    finished when ``finished_s >= 0`` and it has a finished turn; a turn when ``finished_s >= 0``.
    Turn metrics cover all finished turns, including those of unfinished workflows.

    ``engine_stats``: per engine id, cumulative counters (see :data:`ENGINE_STAT_KEYS` for the
    names read, aliases included; every numeric counter is summed over engines into
    ``engine_totals``, under its canonical name). ``makespan_s``: the run's
    duration, the denominator of every rate and of the GPU-hours (``num_gpus × makespan_s``);
    it must end at the run's last completion (the simulator's ``SimResult.makespan_s`` does),
    not at a policy timer still pending after it. ``last_completion_s`` (the latest turn
    finish in the records) is reported beside it so a reader can check.

    SLOs: a turn meets TTFT when ``ttft <= slo_ttft_s`` and TPOT when ``tpot <= slo_tpot_s``
    (vacuously for single-token turns); ``goodput_tokens_per_s`` counts the output tokens of
    turns meeting both. With ``slo_scale_k``, a workflow meets its deadline when
    ``flow <= k × standalone``; the standalone time comes from ``standalone_s`` (workflow id →
    seconds, e.g. a solo run in the simulator) or, without it, is estimated from the records as
    the flow time minus every turn's wait (``ready_s`` → ``started_s``): exact for chains whose
    service times would not change when run alone, pessimistic for DAGs. ``slowdown`` (flow /
    standalone) is reported whenever standalone times are known or ``slo_scale_k`` is given.

    The result also carries ``_flow_times_s`` (list of floats, one per finished workflow, in
    input order) for plots; :func:`public_metrics` strips it.
    """
    wfs = workflows if isinstance(workflows, list) else list(workflows)
    turn_lists = list(map(attrgetter("turns"), wfs))
    turns: list[TurnRecord] = list(chain.from_iterable(turn_lists))
    n_turns_total = len(turns)
    counts = np.fromiter(map(len, turn_lists), np.int64, count=len(wfs))

    ready = _column(turns, "ready_s")
    released = _column(turns, "released_s")
    started = _column(turns, "started_s")
    first = _column(turns, "first_token_s")
    finished = _column(turns, "finished_s")
    out_tokens = _column(turns, "output_tokens", np.int64)

    # ------------------------------------------------------------------ workflows
    arrival = np.fromiter(map(attrgetter("arrival_s"), wfs), np.float64, count=len(wfs))
    wf_done = np.fromiter(map(attrgetter("finished_s"), wfs), np.float64, count=len(wfs)) >= 0
    nonempty = counts > 0
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(wfs) else counts
    last_finished = np.full(len(wfs), -1.0)
    if n_turns_total:
        last_finished[nonempty] = np.maximum.reduceat(finished, starts[nonempty])
    done = wf_done & (last_finished >= 0)
    flow = last_finished[done] - arrival[done]

    # ---------------------------------------------------------------------- turns
    t_done = finished >= 0
    has_first = t_done & (first >= 0) & (ready >= 0)
    has_release = t_done & (released >= 0) & (ready >= 0)
    ttft = first[has_first] - ready[has_first]
    engine_ttft = first[has_first & (released >= 0)] - released[has_first & (released >= 0)]
    hold = released[has_release] - ready[has_release]
    e2e = finished[t_done & (ready >= 0)] - ready[t_done & (ready >= 0)]
    multi = t_done & (first >= 0) & (out_tokens > 1)
    tpot = (finished[multi] - first[multi]) / (out_tokens[multi] - 1)

    n_done_turns = int(t_done.sum())
    output_tokens = int(out_tokens[t_done].sum())

    # ------------------------------------------------------------------------ SLOs
    ttft_all = np.where(has_first, first - ready, np.inf)
    tpot_all = np.zeros(n_turns_total)
    tpot_all[multi] = tpot
    meets_ttft = t_done & (ttft_all <= slo_ttft_s)
    meets_tpot = t_done & (tpot_all <= slo_tpot_s)
    meets_both = meets_ttft & meets_tpot
    slo: dict[str, Any] = {
        "ttft_s": slo_ttft_s,
        "tpot_s": slo_tpot_s,
        "ttft_attainment": _ratio(int(meets_ttft.sum()), n_done_turns),
        "tpot_attainment": _ratio(int((meets_tpot & multi).sum()), int(multi.sum())),
        "turn_attainment": _ratio(int(meets_both.sum()), n_done_turns),
        "goodput_tokens_per_s": _ratio(int(out_tokens[meets_both].sum()), makespan_s),
    }

    alone: FloatArray | None = None
    if standalone_s is not None:
        ids = [wf.id for wf, d in zip(wfs, done.tolist(), strict=True) if d]
        alone = np.array([standalone_s.get(i, np.nan) for i in ids], dtype=np.float64)
        slo["standalone_source"] = "given"
    elif slo_scale_k is not None:
        wait = np.where((started >= 0) & (ready >= 0), started - ready, 0.0)
        wf_index = np.repeat(np.arange(len(wfs)), counts)
        wait_sum = np.bincount(wf_index, weights=wait, minlength=len(wfs))
        alone = flow - wait_sum[done]
        slo["standalone_source"] = "estimated: flow minus turn waits"
    if alone is not None:
        known = np.isfinite(alone) & (alone > 0)
        slowdown = flow[known] / alone[known]
        slo["slowdown"] = summarize(slowdown)
        if slo_scale_k is not None:
            slo["scale_k"] = slo_scale_k
            met = int((slowdown <= slo_scale_k).sum())
            slo["workflow_attainment"] = _ratio(met, int(slowdown.size))

    # ---------------------------------------------------------------- engine side
    totals = _engine_totals(engine_stats)
    hit = totals.get("prefix_hit_tokens")
    prompt = totals.get("prompt_tokens")
    if hit is not None and prompt is None:
        prompt = float(
            _column(turns, "turn.context_tokens", np.int64)[t_done].sum()
            + _column(turns, "turn.input_tokens", np.int64)[t_done].sum()
        )
    hit_rate = _ratio(hit, prompt) if hit is not None and prompt is not None else None

    # ---------------------------------------------------------------------- cost
    cost: dict[str, Any] | None = None
    if gpu_price_per_h is not None or gpu_power_w is not None:
        gpu_hours = num_gpus * makespan_s / 3600.0
        cost = {"num_gpus": num_gpus, "gpu_hours": _float(gpu_hours)}
        if gpu_price_per_h is not None:
            dollars = gpu_hours * gpu_price_per_h
            cost.update(gpu_price_per_h=gpu_price_per_h, dollars=_float(dollars))
            cost["tokens_per_dollar"] = _ratio(output_tokens, dollars)
        if gpu_power_w is not None:
            joules = num_gpus * gpu_power_w * makespan_s
            cost.update(gpu_power_w=gpu_power_w, joules=_float(joules))
            cost["tokens_per_joule"] = _ratio(output_tokens, joules)

    n_done = int(done.sum())
    return {
        "workflows": n_done,
        "workflows_unfinished": len(wfs) - n_done,
        "turns": n_done_turns,
        "turns_unfinished": n_turns_total - n_done_turns,
        "output_tokens": output_tokens,
        "makespan_s": _float(makespan_s),
        "last_completion_s": _float(finished.max()) if n_done_turns else None,
        "flow_time_s": summarize(flow),
        "ttft_s": summarize(ttft),
        "engine_ttft_s": summarize(engine_ttft),
        "hold_s": summarize(hold),
        "tpot_s": summarize(tpot),
        "e2e_s": summarize(e2e),
        "throughput": {
            "output_tokens_per_s": _ratio(output_tokens, makespan_s),
            "workflows_per_s": _ratio(n_done, makespan_s),
        },
        "slo": slo,
        "prefix_hit_rate": hit_rate,
        "recomputed_prefill_tokens": totals.get("recomputed_prefill_tokens"),
        "preemptions": totals.get("preemptions"),
        "paused_kv_gb_s": totals.get("paused_kv_gb_s"),
        "engine_totals": totals,
        "cost": cost,
        "_flow_times_s": flow.tolist(),
    }


def public_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A copy without private sample keys (those starting with ``_``), at every depth."""
    return _strip_private(metrics)


def _strip_private(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {
            k: _strip_private(v)
            for k, v in obj.items()
            if not (isinstance(k, str) and k.startswith(PRIVATE_PREFIX))
        }
    if isinstance(obj, list | tuple):
        return [_strip_private(v) for v in obj]
    return obj
