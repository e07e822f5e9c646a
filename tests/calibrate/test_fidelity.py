"""Fidelity pieces without an engine: trace scaling, the simulated side, comparison, reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from turnstile.calibrate.fidelity import (
    REAL_RERUN,
    SimEngineSpec,
    TraceScale,
    on_poisson,
    rates_for_loads,
    scale_workflow,
    select_sessions,
    simulate,
)
from turnstile.calibrate.fidelity_report import (
    Observed,
    compare,
    observe,
    plot_scatter,
    render_markdown,
    strip_pairs,
    write_report,
)
from turnstile.calibrate.profile import plan_for
from turnstile.calibrate.replay import assign_round_robin
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.workload.model import ToolCall, Turn, Workflow

PERF = FittedPerf(0.01, 2e-3, 5e-3, 1e-5, 1e-6, engine="test")


def agent(wid: str, turns: int = 6, prompt0: int = 12000) -> Workflow:
    ts = [Turn(prompt0, 300, 0, tools=(ToolCall("Bash", 4.0),))]
    ctx = prompt0 + 300
    for i in range(1, turns):
        ts.append(Turn(800 + 100 * i, 150 + 10 * i, ctx, tools=(ToolCall("Read", 50.0),
                                                              ToolCall("Grep", 30.0))))
        ctx += 800 + 100 * i + 150 + 10 * i
    return Workflow(wid, 0.0, tuple(ts))


def test_scale_workflow_keeps_a_growing_chain_within_the_caps() -> None:
    s = TraceScale(token_div=32, output_div=8, max_output=48, tool_div=10, max_tool_s=3.0,
                   max_context=900, max_turns=10)
    wf = scale_workflow(agent("a", 12), s)
    assert wf is not None and wf.is_chain
    t0 = wf.turns[0]
    assert (t0.context_tokens, t0.input_tokens, t0.output_tokens) == (0, 375, 38)
    for prev, t in zip(wf.turns, wf.turns[1:], strict=False):
        assert t.context_tokens == prev.prompt_tokens + prev.output_tokens
        assert t.prompt_tokens + t.output_tokens <= 900
        assert 1 <= t.output_tokens <= 48
        assert t.tool_duration_s <= 3.0 + 1e-9
    assert wf.turns[0].tool_duration_s == pytest.approx(0.4)
    assert len(wf.turns) < 10  # the context cap ended it
    assert scale_workflow(agent("b", 2, prompt0=10**6), s) is None


def test_select_sessions_is_seeded_and_skips_dags() -> None:
    wfs = [agent(f"w{i}", 6) for i in range(10)]
    dag = Workflow("dag", 0.0, (Turn(100, 10), Turn(10, 10, parents=()), Turn(10, 10)))
    got = select_sessions([dag, *wfs], 4, TraceScale(max_context=4000), seed=1)
    assert len(got) == 4 and "dag" not in {w.id for w in got}
    again = select_sessions([dag, *wfs], 4, TraceScale(max_context=4000), seed=1)
    assert [w.id for w in got] == [w.id for w in again]
    with pytest.raises(ValueError):
        select_sessions(wfs, 20, TraceScale(max_context=4000))


def test_simulate_pins_sessions_to_their_engine_and_observes_them() -> None:
    sessions = select_sessions([agent(f"w{i}", 5) for i in range(6)], 6,
                               TraceScale(max_context=1500))
    wfs = on_poisson(sessions, 0.5, seed=0)
    assignment = assign_round_robin(wfs, 2)
    assert sorted(assignment.values()) == [0, 0, 0, 1, 1, 1]
    spec = SimEngineSpec(kv_tokens=8192, max_num_seqs=4, max_batched_tokens=2048,
                         cpu_offload_tokens=65536)
    obs = simulate(wfs, assignment, spec, PERF)
    assert len(obs.flow) == 6 and len(obs.ttft) == sum(len(w.turns) for w in wfs)
    for key, e2e in obs.e2e.items():
        assert 0 < obs.ttft[key] <= e2e
    # a lone first turn: its TTFT is the model's prefill time of that prompt
    alone = simulate(wfs[:1], assignment, spec, PERF)
    t0 = wfs[0].turns[0]
    want = PERF.step_time(t0.prompt_tokens, 0, 0, t0.prompt_tokens * (t0.prompt_tokens + 1) / 2)
    assert alone.ttft[(wfs[0].id, 0)] == pytest.approx(want)


def test_compare_and_reports(tmp_path: Path) -> None:
    real = Observed({("a", 0): 1.0, ("a", 1): 2.0, ("b", 0): 4.0},
                    {("a", 0): 2.0, ("a", 1): 4.0, ("b", 0): 8.0}, {"a": 10.0, "b": 20.0})
    pred = Observed({("a", 0): 1.1, ("a", 1): 1.0, ("b", 0): 4.0},
                    {("a", 0): 2.0, ("a", 1): 4.4, ("b", 0): 8.0}, {"a": 9.0})
    e = compare(real, pred)
    assert e["ttft"]["n"] == 3 and e["ttft"]["median"] == pytest.approx(0.1)
    assert e["ttft"]["bias"] == pytest.approx(0.0)
    assert e["e2e"]["median"] == pytest.approx(0.0)
    assert e["flow"]["n"] == 1 and e["flow"]["median"] == pytest.approx(0.1)
    assert e["pairs"]["flow"] == [(10.0, 9.0)]
    rows: list[dict[str, Any]] = [{"model": "fitted", "rate": 0.5, "errors": e},
            {"model": "fitted", "rate": "all", "errors": e},
            {"model": REAL_RERUN, "rate": "all", "errors": compare(real, real)}]
    md = render_markdown(rows)
    assert "| fitted | 0.5 | 3 | 10.0% |" in md
    assert md.count("\n|") >= 4
    png = plot_scatter(rows, tmp_path / "s.png")
    assert png.stat().st_size > 1000
    slim = strip_pairs({"rows": rows})
    assert all("pairs" not in r["errors"] for r in slim["rows"])
    assert write_report(tmp_path, {"rows": rows}, "t") == md
    pairs = json.loads((tmp_path / "fidelity_pairs.json").read_text())
    assert pairs[0]["pairs"]["flow"] == [[10.0, 9.0]]
    assert "pairs" not in json.loads((tmp_path / "fidelity.json").read_text())["rows"][0]["errors"]
    assert (tmp_path / "fidelity_scatter.png").stat().st_size > 1000


def test_goal_verdict() -> None:
    ok = Observed({("a", 0): 1.0}, {("a", 0): 1.0}, {"a": 1.0})
    near = Observed({("a", 0): 1.05}, {("a", 0): 0.97}, {"a": 1.0})
    far = Observed({("a", 0): 2.0}, {("a", 0): 1.0}, {"a": 1.0})
    md = render_markdown([{"model": "good", "rate": "all", "errors": compare(ok, near)},
                          {"model": "bad", "rate": "all", "errors": compare(ok, far)}])
    assert "Met by: good." in md


def test_observe_skips_unfinished_work() -> None:
    from turnstile.core.state import TurnRecord, WorkflowRecord

    wf = agent("x", 2)
    rec = WorkflowRecord("x", 1.0, "t", wf)
    a, b = TurnRecord(rec, 0, wf.turns[0]), TurnRecord(rec, 1, wf.turns[1])
    a.ready_s, a.first_token_s, a.finished_s = 1.0, 1.5, 2.0
    rec.turns = [a, b]
    o = observe([rec])
    assert o.ttft == {("x", 0): 0.5} and o.e2e == {("x", 0): 1.0} and o.flow == {}


def test_plan_for_fits_the_engine() -> None:
    p = plan_for(max_context=2048, max_seqs=4, chunk=2048)
    assert max(p.prefill_lengths) <= 2048 - p.decode_tokens - 8
    assert p.decode_batches == [1, 2, 3, 4]
    assert all(k < 4 for k, _ in p.mixed)  # a slot stays free for the newcomer
    assert all(a + b <= 2048 for a, b in p.cache_hits)
    # the smallest cache hits again right after a 16-token generation, with room for it
    assert {s for _, s in p.warm_appends} == {1, 4, 16}
    assert all(a + 4 + 16 + b <= 2048 for a, b in p.warm_appends)
    assert {a for a, _ in p.warm_appends} == {a for a, _ in p.cache_hits}
    big = plan_for(max_context=8192, max_seqs=256, chunk=8192)
    assert big.decode_batches[-1] == 256 and 64 in big.decode_batches
    q = plan_for(max_context=1024, max_seqs=4, chunk=512, quick=True)
    assert q.count() < p.count()
    assert all(n + k <= 512 for k, n in q.mixed)
    assert math.isfinite(q.count())


def test_simulate_adds_the_request_overhead_and_uses_the_cache_granularity() -> None:
    wf = Workflow("w", 0.0, (Turn(100, 5, 0), Turn(3, 5, 105), Turn(3, 5, 113)))
    asg = {"w": 0}
    base = SimEngineSpec(kv_tokens=4096, max_num_seqs=4, max_batched_tokens=2048)
    plain = simulate([wf], asg, base, PERF)
    oh = SimEngineSpec(4096, 4, 2048, request_overhead_s=0.002)
    shifted = simulate([wf], asg, oh, PERF)
    for k, v in plain.ttft.items():
        assert shifted.ttft[k] == pytest.approx(v + 0.002)
        assert shifted.e2e[k] == pytest.approx(plain.e2e[k] + 0.002)
    assert shifted.flow["w"] == pytest.approx(plain.flow["w"] + 3 * 0.002)
    # by default the overhead comes from the profile's measurement
    measured = FittedPerf(*PERF.coefficients, meta={"request_overhead_s": 0.003})
    assert simulate([wf], asg, base, measured).ttft[("w", 0)] == pytest.approx(
        plain.ttft[("w", 0)] + 0.003
    )
    # token-granular reuse (llama.cpp) recomputes only the new tokens and the last output
    fine = simulate([wf], asg, SimEngineSpec(4096, 4, 2048, block_size=1), PERF)
    assert fine.ttft[("w", 1)] < plain.ttft[("w", 1)]
    want = PERF.step_time(4, 0, 104, 4 * 104 + 10)  # 3 new + the last output, after 104 cached
    assert fine.ttft[("w", 1)] == pytest.approx(want)


def test_simulated_engines_are_independent_without_host_contention() -> None:
    """One cluster with pinned routing gives each engine exactly what simulating its share
    alone gives; with host contention a session is slower only while the other engine
    computes."""
    from dataclasses import replace

    from turnstile.sim.cluster import run_sim

    sessions = select_sessions([agent(f"w{i}", 4) for i in range(6)], 6,
                               TraceScale(max_context=1500))
    wfs = on_poisson(sessions, 1.0, seed=3)
    assignment = assign_round_robin(wfs, 2)
    spec = SimEngineSpec(kv_tokens=8192, max_num_seqs=4, max_batched_tokens=2048, block_size=1)
    together = simulate(wfs, assignment, spec, PERF)
    for engine in (0, 1):
        share = [w for w in wfs if assignment[w.id] == engine]
        alone = observe(run_sim(share, "eager", [spec.group(PERF)], block_size=1).workflows)
        for key, ttft in alone.ttft.items():
            assert together.ttft[key] == ttft
        for wid, flow in alone.flow.items():
            assert together.flow[wid] == flow
    slowed = simulate(wfs, assignment, spec, replace(PERF, host_contention=0.5))
    assert all(slowed.flow[w] >= together.flow[w] for w in together.flow)
    assert sum(slowed.flow.values()) > sum(together.flow.values())
    # a lone session has no neighbour computing: contention changes nothing for it
    lone = {wfs[0].id: 0}
    assert (simulate(wfs[:1], lone, spec, replace(PERF, host_contention=0.5)).flow
            == simulate(wfs[:1], lone, spec, PERF).flow)


def test_rates_for_loads_follow_the_engines_speed_and_count() -> None:
    """The same loads give rates in proportion to the loads, to the number of engines, and
    inversely to how slow the engine computes (compute-bound here: 6-turn agents on one
    engine), so a protocol given as loads offers a slow host's engines the same load."""
    s = TraceScale(token_div=32, output_div=8, tool_div=10, max_context=1536, max_turns=12)
    sessions = [w for w in (scale_workflow(agent(f"a{i}"), s) for i in range(6)) if w]
    spec = SimEngineSpec(kv_tokens=8192, max_num_seqs=4, max_batched_tokens=2048, block_size=1)
    low, high = rates_for_loads([0.2, 0.8], sessions, spec, PERF)
    assert 0 < low < high and high / low == pytest.approx(4.0, rel=0.01)
    two = rates_for_loads([0.8], sessions, spec, PERF, engines=2)[0]
    assert two == pytest.approx(2 * high, rel=0.01)
    slow = rates_for_loads([0.8], sessions, spec, PERF.scaled(2.0))[0]
    assert slow < high and slow == pytest.approx(high / 2, rel=0.05)
    with pytest.raises(ValueError, match="positive"):
        rates_for_loads([0.5, 0.0], sessions, spec, PERF)
    with pytest.raises(ValueError, match="positive"):
        rates_for_loads([], sessions, spec, PERF)
