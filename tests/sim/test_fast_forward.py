"""Fast-forward (``EngineModel.leap``) changes nothing but the number of events."""

from __future__ import annotations

import math
import random

import pytest

from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest
from turnstile.sim.engine_profile import WarmRule
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.roofline_perf import RooflinePerf
from turnstile.workload import Turn, Workflow, synth


def request_trace(n: int, seed: int) -> list[Workflow]:
    rng = random.Random(seed)
    t = 0.0
    wfs = []
    for i in range(n):
        t += rng.expovariate(4.0)
        p = max(1, int(rng.lognormvariate(math.log(800), 0.9)))
        o = max(1, int(rng.lognormvariate(math.log(150), 0.8)))
        wfs.append(Workflow(f"r{i}", t, (Turn(min(p, 3_000), min(o, 1_000)),)))
    return wfs


def run(wfs, spec, groups, ff):
    res = ClusterSim(wfs, PolicySet.from_spec(spec), groups, fast_forward=ff).run()
    turns = {
        (t.workflow.id, t.index): (t.started_s, t.first_token_s, t.finished_s)
        for w in res.workflows
        for t in w.turns
    }
    return res, turns


def assert_same(wfs, spec, groups):
    off, t_off = run(wfs, spec, groups, False)
    on, t_on = run(wfs, spec, groups, True)
    assert t_on.keys() == t_off.keys()
    for k, a in t_off.items():
        b = t_on[k]
        for x, y in zip(a, b, strict=True):
            assert y == pytest.approx(x, rel=1e-9, abs=0.0), (k, a, b)
    assert on.engine_stats == off.engine_stats  # every counter, busy_s included
    assert on.iterations == off.iterations
    assert on.makespan_s == off.makespan_s
    assert on.events <= off.events
    return off, on


H100 = dict(gpu="H100", model="llama-3.1-8b")


@pytest.mark.parametrize("spec", ["eager", "cvar"])
@pytest.mark.parametrize("engines", [1, 2])
def test_request_trace_is_unchanged_by_fast_forward(spec, engines):
    groups = [EngineGroup(**H100, count=engines, max_num_seqs=64, max_batched_tokens=2048)]
    off, on = assert_same(request_trace(300, seed=engines), spec, groups)
    if engines == 1:
        assert on.events < off.events / 2  # it does leap


@pytest.mark.parametrize(
    "spec", ["eager", "cvar", "cvar+composite+ttl", "cvar+kv-affinity+infercept"]
)
def test_agent_sessions_with_tools_are_unchanged_by_fast_forward(spec):
    wfs = synth.generate(synth.DEFAULT_SPEC, 25, seed=3, arrivals=0.1)
    groups = [EngineGroup(**H100, count=2, kv_tokens=200_000)]
    assert_same(wfs, spec, groups)


@pytest.mark.parametrize("spec", ["eager", "cvar+composite+ttl"])
def test_tight_kv_with_offload_preemption_and_pins_is_unchanged(spec):
    # KV just above the largest turn: eviction to the CPU tier, reloads, preemption and pinned
    # sessions all happen inside decode runs
    wfs = synth.generate(synth.DEFAULT_SPEC, 20, seed=5, arrivals=0.05)
    biggest = max(t.prompt_tokens + t.output_tokens for w in wfs for t in w.turns)
    groups = [
        EngineGroup(
            **H100, count=2, kv_tokens=biggest + 20_000, cpu_offload_tokens=60_000, max_num_seqs=32
        )
    ]
    off, _ = assert_same(wfs, spec, groups)
    total = {
        k: sum(s[k] for s in off.engine_stats.values())
        for k in ("preemptions", "evicted_blocks", "reloaded_blocks")
    }
    assert all(total.values()), total


def test_a_fitted_perf_model_is_unchanged_too():
    perf = FittedPerf(b0=0.004, b1=2e-5, b2=1e-4, b3=3e-8, b4=1e-10)
    groups = [EngineGroup(**H100, count=1, perf=perf, max_num_seqs=32)]
    assert_same(request_trace(150, seed=9), "eager", groups)


@pytest.mark.parametrize("spec", ["eager", "cvar"])
def test_cold_steps_are_stepped_and_unchanged_by_fast_forward(spec):
    """With ``cold_step_s`` the iterations after a large chunk or a pause cost more: a leap
    does not start over them, and the rest is leapt over as before."""
    perf = FittedPerf(b0=0.004, b1=2e-5, b2=1e-4, b3=3e-8, b4=1e-10, cold_step_s=0.003,
                      warm=WarmRule(0.1, 3, 64))
    groups = [EngineGroup(**H100, count=2, perf=perf, max_num_seqs=8)]
    wfs = synth.generate(synth.DEFAULT_SPEC, 25, seed=3, arrivals=0.1)
    off, on = assert_same(wfs, spec, groups)
    assert on.events < off.events
    plain = [EngineGroup(**H100, count=2, perf=FittedPerf(b0=0.004, b1=2e-5, b2=1e-4, b3=3e-8,
                                                          b4=1e-10), max_num_seqs=8)]
    _, t_cold = run(wfs, spec, groups, True)
    _, t_warm = run(wfs, spec, plain, True)

    first = (min(wfs, key=lambda w: w.arrival_s).id, 0)  # the engine's first step: cold
    (s0, f0, _), (s1, f1, _) = t_cold[first], t_warm[first]
    assert s0 == s1 and f0 - f1 >= 0.003 - 1e-12


def engine() -> EngineModel:
    """Six requests of different lengths queued at 0 on one H100 engine."""
    eng = EngineModel("e", EngineConfig(num_gpu_blocks=400, max_num_seqs=8),
                      RooflinePerf("H100", "llama-3.1-8b"))
    for i in range(6):
        eng.submit(SimRequest(i, f"s{i}", 100 + 37 * i, 50 + 29 * i), 0.0)
    return eng


def test_leap_matches_stepping_one_iteration_at_a_time():
    stepped, leaped = engine(), engine()
    ends_a, ends_b = [], []
    now = 0.0
    while (out := stepped.step(now)) is not None:
        now = out.end_s
        ends_a += [(r.rid, now) for r in out.finished]
    now = 0.0
    n = 0
    while (out := leaped.step(now)) is not None:
        leaped.leap(out, math.inf)
        n += 1
        assert out.iterations >= 1
        now = out.end_s
        ends_b += [(r.rid, now) for r in out.finished]
        leaped.check_integrity()
    assert ends_a == ends_b
    assert stepped.stats() == leaped.stats()
    assert n < stepped.iterations / 5
    # a leap stops before ``until``: the next iteration would start at or after it
    eng = engine()
    out = eng.step(0.0)
    out2 = eng.step(out.end_s)
    eng.leap(out2, out2.end_s + 1e-9)
    assert out2.iterations == 2 or out2.finished


def test_resume_continues_a_cut_leap_exactly_and_only_when_nothing_reached_the_engine():
    def cuts(resume: bool) -> tuple[list, dict, int]:
        """Leap in slices of 0.01 s (as if other engines' events cut it), resuming or not."""
        eng = engine()
        now, out, seen, resumed = 0.0, None, [], 0
        while True:
            if resume and out is not None and eng.resume(out, now, now + 0.01):
                resumed += 1
            else:
                out = eng.step(now)
                if out is None:
                    return seen, eng.stats(), resumed
                eng.leap(out, now + 0.01)
            eng.check_integrity()
            now = out.end_s
            seen += [(r.rid, now) for r in out.finished + out.first_token]

    seen, stats, resumed = cuts(resume=True)
    assert (seen, stats) == cuts(resume=False)[:2]
    assert resumed > 10
    # a submit in between reaches the engine: the next step must be a real step (admission)
    twins = engine(), engine()
    outs = []
    for eng in twins:
        out = eng.step(0.0)
        while out.first_token or out.finished or out.iterations < 2:
            out = eng.step(out.end_s)
            eng.leap(out, out.end_s + 0.01)
        outs.append(out)
    twins[1].submit(SimRequest("late", "late", 64, 4), outs[1].end_s)
    assert twins[0].resume(outs[0], outs[0].end_s, math.inf)
    assert not twins[1].resume(outs[1], outs[1].end_s, math.inf)


def test_other_engines_do_not_cut_a_leap():
    # lazily committed leaps: eight decoding engines, each leap one event however the others'
    # step ends interleave (cut at every cluster event, this took about one event per iteration)
    wfs = [Workflow(f"r{i}", 0.0, (Turn(200, 400 + 37 * i),)) for i in range(64)]
    groups = [EngineGroup(**H100, count=8, max_num_seqs=16)]
    _, on = assert_same(wfs, "eager", groups)
    assert on.iterations > 3000
    assert on.events < on.iterations / 10, (on.events, on.iterations)


def test_stopping_early_records_planned_leaps_and_changes_nothing():
    # run_until stopping inside planned leaps records them up to the clock (callers may read the
    # engines) and the run goes on exactly: the same result as one run
    wfs = synth.generate(synth.DEFAULT_SPEC, 15, seed=7, arrivals=0.1)
    groups = [EngineGroup(**H100, count=3, kv_tokens=200_000)]
    whole, t_whole = run(wfs, "cvar+composite+ttl", groups, True)
    sim = ClusterSim(wfs, PolicySet.from_spec("cvar+composite+ttl"), groups)
    sim._arrivals = sim.workflows  # what run() sets up before run_until
    sim._next_arrival = 0
    t = 0.0
    mid_iterations = []
    while sim.scheduler.active_workflows or t == 0.0:
        t += whole.makespan_s / 7
        sim.run_until(t)
        assert all(e.lazy_out is None for e in sim.engines)
        mid_iterations.append(sum(e.iterations for e in sim.engines))
    sim.run_until()
    assert mid_iterations == sorted(mid_iterations) and mid_iterations[0] > 0
    stats = {e.engine_id: e.stats() for e in sim.engines}
    assert stats == whole.engine_stats
    assert sim.iterations == whole.iterations
    turns = {(tr.workflow.id, tr.index): (tr.started_s, tr.first_token_s, tr.finished_s)
             for w in sim.finished for tr in w.turns}
    assert turns == t_whole
