"""Step models side by side on the *same* measured fidelity run, each fitted to the run's own
profile samples, each simulating the run's workflows, each compared with the same real turn times
(``turn_log`` in ``fidelity.json``):

* ``linear``: one pass per step;
* ``linear + small-chunk term``: attention pairs of a small prefill chunk cost more (a knee);
* ``forward passes + small-chunk term``: a fixed cost per forward pass (llama.cpp's
  micro-batches; :func:`turnstile.sim.fitted_perf.forward_passes`), each step's passes counted
  as if its decoders held slots ``0..k-1``, as the profile measures them;
* ``passes by slot + small-chunk term``: the passes counted from the slots the server gives the
  requests (:mod:`turnstile.sim.lanes`: a run of consecutive slots is one pass);
* ``passes by slot + knee or FA-tile threshold``: the small-chunk term may instead stop at once
  at 64 prefill tokens, where llama.cpp's CPU flash attention turns to its tiled kernel; the fit
  keeps whichever of the knees and the threshold fits the samples best;
* ``passes by slot + knee, threshold or FA tiles``: the fit may also count the attention of a
  chunk of 64 tokens or more in 64 x 64 tiles, as that kernel computes it
  (:func:`turnstile.sim.fitted_perf.tile_pairs`); a step's chunks are priced one by one;
* ``+ cold steps``: a step that starts a turn after an idle spell or a large prompt chunk pays
  ``cold_step_s`` more (the llama.cpp profile's warm rule, :mod:`turnstile.sim.profiles.llamacpp`),
  fitted from the warm appends of profiles that have them (runs from before measure none: there it
  is the model above). This is what ``turnstile profile`` fits on llama.cpp.

Nothing is replayed again, so the host's load cannot favour either model: only the model differs.
The forward-pass models run with the profile's measured host contention (the engines slow each
other while both compute; ``--host-contention`` sets it for runs that did not measure it).

    .venv/bin/python benchmarks/fidelity_models.py benchmarks/results/fidelity-llamacpp

Prints a table of median relative errors (TTFT, E2E per turn; flow time per workflow), per rate
and all rates pooled, then, for each model, the median simulated / measured TTFT of the turns by
how many other turns were running on their engine when they were sent (``by_others``), and
writes ``fidelity_models.json`` beside ``fidelity.json``. The forward-pass models are fitted to
the run's samples as they were measured, also for runs whose decode probes were not yet pinned
to slots.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from turnstile.calibrate.fidelity import (
    SimEngineSpec,
    TraceScale,
    on_poisson,
    select_sessions,
    simulate,
)
from turnstile.calibrate.fidelity_report import Observed, compare
from turnstile.calibrate.probes import cold_flags
from turnstile.calibrate.profile import LLAMACPP_FA_TILE_Q, LLAMACPP_UBATCH, SMALL_CHUNK_KNEES
from turnstile.calibrate.replay import assign_round_robin
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.perf import FEATURES
from turnstile.sim.profile_fit import fit_profile
from turnstile.traces import default_traces_dir, load_trace


def real_observed(turn_log: list[list], arrivals: dict[str, float]) -> Observed:
    """Per-turn TTFT/E2E and per-workflow flow time from a saved ``turn_log``
    (``[wf, index, engine, ready, first_token, finished, prompt, cached, output]``)."""
    o = Observed()
    last: dict[str, float] = {}
    for wf, i, _eng, ready, first, done, *_ in turn_log:
        o.ttft[(wf, i)] = first - ready
        o.e2e[(wf, i)] = done - ready
        last[wf] = max(last.get(wf, 0.0), done)
    o.flow = {wf: t - arrivals[wf] for wf, t in last.items()}
    return o


def ttft_by_others(turn_log: list[list], sim_ttft: dict) -> dict[int, tuple[float, int]]:
    """Median simulated / measured TTFT by how many other turns ran on the turn's engine when it
    was sent (3 = three or more), with the number of turns."""
    ratios: dict[int, list[float]] = {}
    for wf, i, eng, ready, first, *_ in turn_log:
        others = sum(1 for w2, i2, e2, r2, _f, d2, *_ in turn_log
                     if e2 == eng and (w2, i2) != (wf, i) and r2 <= ready < d2)
        sim = sim_ttft.get((wf, i))
        if sim is not None and first > ready:
            ratios.setdefault(min(others, 3), []).append(sim / (first - ready))
    return {k: (float(np.median(v)), len(v)) for k, v in sorted(ratios.items())}


@dataclass(frozen=True)
class StepModel:
    """One step model of the comparison: its small-chunk term's candidates, whether a step is
    priced by its forward passes, and whether those are counted from the requests' slots."""

    knees: tuple[float, ...] = ()
    thresholds: tuple[float, ...] = ()
    tiles: tuple[float, ...] = ()
    passes: bool = False
    by_slot: bool = False
    cold: bool = False


MODELS = {
    "linear": StepModel(),
    "linear + small-chunk term": StepModel(SMALL_CHUNK_KNEES),
    "forward passes + small-chunk term": StepModel(SMALL_CHUNK_KNEES, passes=True),
    "passes by slot + small-chunk term": StepModel(SMALL_CHUNK_KNEES, passes=True, by_slot=True),
    "passes by slot + knee or FA-tile threshold": StepModel(
        SMALL_CHUNK_KNEES, (LLAMACPP_FA_TILE_Q,), passes=True, by_slot=True),
    "passes by slot + knee, threshold or FA tiles": StepModel(
        SMALL_CHUNK_KNEES, (LLAMACPP_FA_TILE_Q,), (LLAMACPP_FA_TILE_Q,), passes=True,
        by_slot=True),
    # what ``turnstile profile`` fits on llama.cpp
    "+ cold steps": StepModel(
        SMALL_CHUNK_KNEES, (LLAMACPP_FA_TILE_Q,), (LLAMACPP_FA_TILE_Q,), passes=True,
        by_slot=True, cold=True),
}


def fitted(profile: Path, model: StepModel, host_contention: float | None = None) -> FittedPerf:
    """``model`` refitted to ``profile``'s samples, with the profile's measured host
    contention (or ``host_contention`` when given: runs from before it was measured)."""
    doc = json.loads(profile.read_text())
    samples = [([s[f] for f in FEATURES], s["step_s"]) for s in doc["meta"]["samples"]]
    cold = cold_flags([s["kind"] for s in doc["meta"]["samples"]]) if model.cold else None
    meta = {"request_overhead_s": doc["meta"].get("request_overhead_s", 0.0)}
    split = {"ubatch_tokens": LLAMACPP_UBATCH, "ubatch_split": "equal",
             "one_token_pass": True} if model.passes else {}
    perf = fit_profile(samples, relative=True, small_chunk_knees=model.knees,
                       small_chunk_thresholds=model.thresholds,
                       small_chunk_tiles=model.tiles, cold=cold, meta=meta,
                       engine=doc.get("engine", "llama.cpp"), **split)
    perf.slot_passes = model.by_slot
    if host_contention is None:
        host_contention = doc["coefficients"].get("host_contention_per_engine", 0.0)
    perf.host_contention = float(host_contention)
    return perf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a fidelity output directory (fidelity.json)")
    ap.add_argument("--host-contention", type=float, default=None,
                    help="slowdown per co-running engine for the forward-pass model (default: "
                    "each profile's measured value, 0 in runs from before it was measured)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="the trace the run replayed (default: the run's own path, else the "
                    "trace of that name in $TURNSTILE_TRACES)")
    args = ap.parse_args(argv)
    doc = json.loads((args.run / "fidelity.json").read_text())
    setup = doc["setup"]
    scale = TraceScale(**setup["scale"])
    trace = args.trace or Path(os.path.expandvars(setup["trace"]))
    if not trace.exists():  # a run from another machine: the trace of that name here
        traces = default_traces_dir()
        if traces is None:
            raise SystemExit(f"{trace} not found: set TURNSTILE_TRACES or pass --trace")
        trace = traces / trace.name
    workflows = load_trace(trace, subset=setup["subset"]).workflows
    sessions = select_sessions(workflows, doc["sessions"], scale, seed=0)
    engine = SimEngineSpec(**doc["engine"])
    models = MODELS
    pooled: dict[str, dict[str, list]] = {m: {"ttft": [], "e2e": [], "flow": []} for m in models}
    out: dict[str, dict] = {}
    by_others: dict[str, dict[str, dict]] = {}
    print("| step model | rate | TTFT med | E2E med | flow med | knee / threshold |")
    print("|---|---|---:|---:|---:|---:|")
    for run in doc["runs"]:
        rate = run["rate"]
        profile = args.run / f"profile_rate{rate:g}.json"
        if not profile.is_file():  # older runs kept only the last rate's profile; a run
            # with --profile-once keeps one, profile.json
            rated = sorted(args.run.glob("profile_rate*.json"))
            profile = rated[-1] if rated else args.run / "profile.json"
        wfs = on_poisson(sessions, rate, 0)
        assignment = assign_round_robin(wfs, setup["engines"])
        real = real_observed(run["turn_log"], {w.id: w.arrival_s for w in wfs})
        for name, model in models.items():
            # host contention only with the forward-pass models: the others are as they were
            perf = fitted(profile, model, args.host_contention if model.passes else 0.0)
            sim = simulate(wfs, assignment, engine, perf)
            err = compare(real, sim)
            by_others.setdefault(name, {})[f"{rate:g}"] = ttft_by_others(run["turn_log"],
                                                                          sim.ttft)
            for m in ("ttft", "e2e", "flow"):
                pooled[name][m] += [abs(p - r) / r for r, p in err["pairs"][m] if r > 0]
            out.setdefault(name, {})[f"{rate:g}"] = {m: err[m]["median"] for m in
                                                      ("ttft", "e2e", "flow")}
            below = f" ({perf.small_chunk_rule})" if perf.small_chunk_rule != "knee" else ""
            if perf.cold_step_s:
                below += f", cold {1e3 * perf.cold_step_s:.1f} ms"
            print(f"| {name} | {rate:g} | {100 * err['ttft']['median']:.1f}% "
                  f"| {100 * err['e2e']['median']:.1f}% | {100 * err['flow']['median']:.1f}% "
                  f"| {perf.small_chunk_tokens:g}{below} |")
    for name in models:
        med = {m: float(np.median(v)) for m, v in pooled[name].items()}
        out[name]["all"] = med
        print(f"| {name} | all | {100 * med['ttft']:.1f}% | {100 * med['e2e']:.1f}% "
              f"| {100 * med['flow']:.1f}% | |")
    print("\nsimulated / measured TTFT by the other turns running on the engine (median, turns)")
    print("| step model | rate | alone | 1 other | 2 others | 3+ others |")
    print("|---|---|---:|---:|---:|---:|")
    for name, rates in by_others.items():
        for rate, got in rates.items():
            cells = [f"{got[k][0]:.2f} ({got[k][1]})" if k in got else "–" for k in range(4)]
            print(f"| {name} | {rate} | " + " | ".join(cells) + " |")
        out[name]["ttft_by_others"] = {r: {str(k): v for k, v in g.items()}
                                       for r, g in rates.items()}
    (args.run / "fidelity_models.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
