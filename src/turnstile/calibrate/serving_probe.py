"""The serving probe's arithmetic: what serving adds to the profiled engines
(:class:`~turnstile.calibrate.ab.ServingTerms`), from one served cell's turns and what the engines
report about them. Two sources, one per kind of engine report:

* :func:`serving_terms`: per-request timings in each reply (llama.cpp's ``timings``:
  ``prompt_ms``, ``predicted_ms``, ``prompt_n``, ``cache_n``), matched to the client's turns;
* :func:`serving_terms_from_totals`: per-request time histograms summed over the cell (an
  engine that reports no per-request timings, only Prometheus histograms, e.g. vLLM's
  ``request_{queue,prefill,decode}_time_seconds``; :class:`RequestTimes`, read before and after
  the cell by the caller, the engine-specific names in
  :func:`~turnstile.calibrate.ab_engines.request_times_from_metrics`).

Either way ``turn_overhead_s`` is the mean, over the probe's turns, of the client's time from
release (after the gateway's hold) to the reply, minus the engine's mean time for a request in
its own queue, prefill and decode: the engine queue, batching and compute are what the
simulator's engine model predicts; the rest (client, gateway, ``/tokenize``, the server's HTTP
front, chat template, the hand-over between the server's front and its compute) is not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np

from turnstile.calibrate.ab import ServingTerms
from turnstile.core.state import WorkflowRecord
from turnstile.gateway.adapters import parse_prometheus
from turnstile.sim.perf import PerfModel
from turnstile.transport.blocking import get as http_get

__all__ = ["RequestTimes", "ServedCell", "describe_probe", "engine_time_per_turn",
           "gateway_running_s", "serving_terms",
           "serving_terms_from_totals", "slowdown_by_simulation"]


class ServedCell(Protocol):
    """What the probe reads of a replayed cell (:class:`~turnstile.bench.replay.Replayer`)."""

    records: list[WorkflowRecord]
    #: (session, turn index) -> the engine's own timings of that request, when it reports them
    engine_timings: dict[tuple[str, int], dict[str, Any]]
    #: (session, turn index) -> (prompt tokens, of them cached), from the reply's usage
    turn_usage: dict[tuple[str, int], tuple[int, int]]


@dataclass(frozen=True)
class RequestTimes:
    """Per-request engine times summed over finished requests (seconds), as an engine's
    histograms give them (``_sum`` and ``_count``); the difference of two readings is a cell's.

    ``queue_s``: queued → first scheduled; ``prefill_s``: scheduled → first token; ``decode_s``:
    first → last token, all stamped by the engine's compute process; ``e2e_s``: the request's
    arrival at the engine's server front → its last token processed there (includes the front's
    own lag on both sides)."""

    requests: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    e2e_s: float = 0.0

    def __add__(self, other: RequestTimes) -> RequestTimes:
        return RequestTimes(*(getattr(self, f.name) + getattr(other, f.name)
                              for f in fields(self)))

    def __sub__(self, other: RequestTimes) -> RequestTimes:
        return RequestTimes(*(getattr(self, f.name) - getattr(other, f.name)
                              for f in fields(self)))

    @property
    def engine_s(self) -> float:
        """Queue + prefill + decode: the time the engine model simulates."""
        return self.queue_s + self.prefill_s + self.decode_s


def _client_turns(cell: ServedCell) -> list[tuple[str, Any]]:
    """(session, record) of every turn the client saw released and answered."""
    return [(wf.id, t) for wf in cell.records for t in wf.turns
            if t.finished_s >= 0 and t.released_s >= 0]


def serving_terms(replayer: ServedCell, perf: PerfModel, *, full_cached_frac: float = 0.25,
                  full_min_tokens: int = 128) -> tuple[ServingTerms, dict[str, Any]]:
    """The serving terms from a served cell's turns, as the engines report them (llama.cpp's
    per-request ``timings``): ``turn_overhead_s`` is the mean, over turns, of the client's time
    from release to reply minus the engine's ``prompt_ms + predicted_ms``; ``engine_slowdown``
    the median, over full prefills (at least ``full_min_tokens`` computed, under
    ``full_cached_frac`` of them cached) that no other full prefill on the same engine
    overlapped (each placed back from its reply by the engine's ``predicted_ms`` and
    ``prompt_ms``), of ``prompt_ms`` against the fitted model's time for that prompt alone (a
    prefill batched with another's reports the whole step's time; with fewer than three
    isolated ones, the lower quartile of all). Measured on a policy whose turns seldom wait for
    a slot (cvar), so the first is not the engine queue the simulator models. Returns the terms
    and what they came from."""
    over: list[float] = []
    full: list[tuple[str, float, float, float]] = []  # engine, start, end, real/model
    for session, t in _client_turns(replayer):
        tm = replayer.engine_timings.get((session, t.index))
        if not tm:
            continue
        compute = (float(tm.get("prompt_ms", 0.0)) + float(tm.get("predicted_ms", 0.0))) / 1e3
        over.append(t.finished_s - t.released_s - compute)
        n, cached = int(tm.get("prompt_n", 0)), int(tm.get("cache_n", 0))
        if n >= full_min_tokens and cached < full_cached_frac * (n + cached):
            alone = perf.step_time(n, 0, 0, n * (n + 1) / 2)
            if alone > 0:  # when it prefilled: back from the reply by the engine's times
                end = t.finished_s - float(tm.get("predicted_ms", 0.0)) / 1e3
                full.append((t.engine or "", end - float(tm["prompt_ms"]) / 1e3, end,
                             float(tm["prompt_ms"]) / 1e3 / alone))
    if not over:
        raise RuntimeError("the serving probe got no engine timings (not a llama.cpp engine?)")
    isolated = [r for e, a, b, r in full
                if not any(e2 == e and a2 < b and a < b2 and (a2, b2) != (a, b)
                           for e2, a2, b2, _ in full)]
    ratios = [r for *_, r in full]
    if len(isolated) >= 3:
        slowdown = float(np.median(isolated))
    elif ratios:
        slowdown = float(np.quantile(ratios, 0.25))
    else:
        slowdown = 1.0
    terms = ServingTerms(turn_overhead_s=max(0.0, float(np.mean(over))),
                         engine_slowdown=slowdown)
    info = {"source": "per-request timings", "turns": len(over),
            "overhead_median_s": float(np.median(over)),
            "full_prefills": len(full), "isolated_prefills": len(isolated),
            "slowdown_quartiles": [float(q) for q in np.quantile(ratios, [0.25, 0.75])]
            if ratios else None}
    return terms, info


def prefill_alone_s(perf: PerfModel, usage: Sequence[tuple[int, int]]) -> float:
    """The fitted model's time for each (prompt, cached) prefill computed alone, summed: its
    uncached tokens on top of the cached prefix, no other sequence in the step."""
    total = 0.0
    for prompt, cached in usage:
        n, c = max(0, prompt - cached), max(0, cached)
        if n:
            total += perf.step_time(n, 0, c, n * c + n * (n + 1) / 2)
    return total


def serving_terms_from_totals(cell: ServedCell, times: RequestTimes, perf: PerfModel, *,
                              gateway_running_s: float | None = None,
                              ) -> tuple[ServingTerms, dict[str, Any]]:
    """The serving terms from a served cell's turns and the engines' per-request times summed
    over the same cell (``times``: the engines' histograms after the cell minus before, all
    engines added). ``turn_overhead_s`` = the client's mean release → reply time minus the
    engines' mean queue + prefill + decode per request.

    ``engine_slowdown`` stays 1.0: from sums alone it cannot be told from batching. vLLM's
    prefill time of a request is the whole of the steps it was scheduled in, which also carry
    the other running sequences' decodes and prefills, so the summed prefill seconds against
    the fitted model's time for the same prompts computed alone (``prefill_vs_alone`` in the
    returned info) is an *upper bound* on the slowdown, reported, not used
    (:func:`slowdown_by_simulation` measures it against the simulated cell instead). Returns
    the terms and what they came from: the client's and the engines' means, and the engine
    front's own share (``e2e`` minus queue + prefill + decode), which is part of the overhead.
    ``gateway_running_s``: the gateway's own mean time per turn from release to finish; given,
    the overhead is split into what the gateway sees as the turn running (beyond the engine's
    time) and what lies outside its window (client, hops to and from it)."""
    turns = _client_turns(cell)
    if not turns:
        raise RuntimeError("the serving probe got no answered turns")
    if times.requests < 1:
        raise RuntimeError("the engines' metrics counted no finished request over the probe")
    client = [t.finished_s - t.released_s for _, t in turns]
    client_mean = float(np.mean(client))
    n = times.requests
    engine_mean = times.engine_s / n
    usage = [u for u in (cell.turn_usage.get((s, t.index)) for s, t in turns) if u]
    alone = prefill_alone_s(perf, usage)
    terms = ServingTerms(turn_overhead_s=max(0.0, client_mean - engine_mean))
    info: dict[str, Any] = {
        "source": "engine metrics (per-request histogram sums)",
        "turns": len(turns),
        "engine_requests": round(n),
        "client_mean_s": client_mean,
        "client_median_s": float(np.median(client)),
        "engine_queue_mean_s": times.queue_s / n,
        "engine_prefill_mean_s": times.prefill_s / n,
        "engine_decode_mean_s": times.decode_s / n,
        "engine_e2e_mean_s": times.e2e_s / n,
        # the engine's server front (request in → compute queued, last token → processed)
        "engine_front_mean_s": (times.e2e_s - times.engine_s) / n,
        # the rest: client, gateway (its hold excluded), /tokenize, HTTP to and from the front
        "outside_engine_server_mean_s": client_mean - times.e2e_s / n,
        "prefill_vs_alone": (times.prefill_s / alone
                             if alone > 0 and len(usage) == len(turns) else None),
        "usage_turns": len(usage),
    }
    if gateway_running_s is not None:
        info["gateway_running_mean_s"] = gateway_running_s
        info["gateway_running_outside_engine_s"] = gateway_running_s - engine_mean
        info["outside_gateway_mean_s"] = client_mean - gateway_running_s
    return terms, info


def engine_time_per_turn(metrics: Mapping[str, Any]) -> float:
    """A simulated cell's mean time per turn from release to finish (``e2e`` less ``hold``):
    the engine's queue, prefill and decode, the simulator having nothing else inside a turn."""
    return float(metrics["e2e_s"]["mean"] - ((metrics.get("hold_s") or {}).get("mean") or 0.0))


def slowdown_by_simulation(real_engine_s: float, simulate: Callable[[float], float], *,
                           grid: Sequence[float] = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5),
                           bounds: tuple[float, float] = (0.5, 3.0),
                           ) -> tuple[float, list[tuple[float, float]]]:
    """``engine_slowdown`` as the engines' measured mean time per request in queue, prefill
    and decode (``real_engine_s``) against the simulator's for the same cell
    (``simulate(slowdown)``): both include batching with the other sequences and the engine
    queue, so the comparison is like for like where the step-time model alone is not. The
    simulated time is not smooth in the slowdown (a cell's events reorder), so it is simulated
    at every slowdown of ``grid``, a line fitted, and the slowdown where the line meets the
    measured time returned (within ``bounds``), with every (slowdown, simulated seconds)."""
    if real_engine_s <= 0:
        raise ValueError("real_engine_s must be > 0")
    tried = [(float(g), simulate(float(g))) for g in grid]
    slope, icpt = np.polyfit([g for g, _ in tried], [t for _, t in tried], 1)
    if slope <= 1e-9:  # flat (or falling): no slowdown to read off it
        raise RuntimeError(f"the simulated engine time does not grow with the slowdown: {tried}")
    return float(min(max((real_engine_s - icpt) / slope, bounds[0]), bounds[1])), tried


def gateway_running_s(gateway: str) -> float | None:
    """The gateway's mean time per turn from release to finish (its ``turn`` less its ``hold``
    histogram), over the turns it has served; None where its ``/metrics`` does not say."""
    text = http_get(gateway + "/metrics", timeout=30.0)
    m = parse_prometheus(text.decode()) if text is not None else {}
    n = m.get("turnstile_gateway_turn_seconds_count")
    if not n or "turnstile_gateway_hold_seconds_sum" not in m:
        return None
    return (m["turnstile_gateway_turn_seconds_sum"] - m["turnstile_gateway_hold_seconds_sum"]) / n


def describe_probe(info: Mapping[str, Any]) -> str:
    """One line of what the serving probe measured its terms from (the run's log)."""
    if "isolated_prefills" in info:
        return f"{info['isolated_prefills']} of {info['full_prefills']} full prefills ran alone"
    q, p, d = (info[f"engine_{k}_mean_s"] for k in ("queue", "prefill", "decode"))
    line = (f"{info['engine_requests']} engine requests; per turn: client "
            f"{info['client_mean_s']:.3f} s, "
            f"engine queue {q:.3f} + prefill {p:.3f} + decode {d:.3f} s, engine front "
            f"{info['engine_front_mean_s']:.3f} s")
    if info.get("gateway_running_outside_engine_s") is not None:
        line += (f", the gateway's running time beyond the engines' "
                 f"{info['gateway_running_outside_engine_s']:.3f} s")
    if info.get("slowdown_by_simulation"):
        line += f"; (slowdown, simulated engine s) tried {info['slowdown_by_simulation']}"
    if info.get("prefill_vs_alone"):
        line += (f"; summed prefill {info['prefill_vs_alone']:.2f}x the model's alone (an upper "
                 "bound)")
    return line
