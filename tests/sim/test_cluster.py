"""The simulator driver: scheduler core + engine models on a virtual clock."""

from __future__ import annotations

import pytest

from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim, EngineGroup, run_sim
from turnstile.workload import ToolCall, Turn, Workflow, synth


def agent(wf_id: str, arrival: float, n_turns: int = 3, tool_s: float = 5.0) -> Workflow:
    turns = []
    ctx = 0
    for i in range(n_turns):
        tools = (ToolCall("Bash", tool_s, "ok"),) if i < n_turns - 1 else ()
        turns.append(Turn(input_tokens=2_000, output_tokens=100, context_tokens=ctx, tools=tools))
        ctx += 2_100
    return Workflow(wf_id, arrival, tuple(turns))


GROUP = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=1)]


def test_a_single_agent_reuses_its_context_and_waits_for_its_tools():
    res = run_sim([agent("a", 1.0)], "eager", GROUP)
    (wf,) = res.workflows
    t0, t1, t2 = wf.turns
    assert t0.ready_s == 1.0
    # the next turn is ready exactly when the tool returns
    assert t1.ready_s == pytest.approx(t0.finished_s + 5.0)
    assert t2.ready_s == pytest.approx(t1.finished_s + 5.0)
    assert wf.finished_s == pytest.approx(t2.finished_s)
    stats = res.engine_stats["e0"]
    # turn 1 and 2 hit the previous turns' prompt + output (full 16-token blocks)
    assert stats["hit_tokens"] >= (2_100 // 16) * 16 + (4_200 // 16) * 16
    # only the partial last block of each earlier turn is computed again (as in vLLM)
    assert stats["recomputed_tokens"] < 2 * 16
    # order of the turn's timeline
    for t in wf.turns:
        assert t.ready_s <= t.released_s <= t.started_s < t.first_token_s <= t.finished_s


def test_every_workflow_finishes_and_runs_are_deterministic():
    wfs = synth.generate(synth.DEFAULT_SPEC, 30, seed=4, arrivals=0.05)
    groups = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=2, kv_tokens=200_000)]
    a = run_sim(wfs, "eager+least-loaded", groups)
    b = run_sim(wfs, "eager+least-loaded", groups)
    assert len(a.workflows) == 30
    key = lambda r: sorted((w.id, w.finished_s) for w in r.workflows)  # noqa: E731
    assert key(a) == key(b)
    assert a.iterations == b.iterations


@pytest.mark.parametrize("spec", ["cvar", "plas", "fcfs-workflow", "cvar+composite+ttl",
                                  "cvar+kv-affinity+infercept", "cvar-fixed+budget-keep",
                                  "eager+tiered-aging", "eager+compat-batching"])
def test_every_policy_runs_to_completion_in_the_simulator(spec):
    wfs = synth.generate(synth.DEFAULT_SPEC, 12, seed=1, arrivals=0.2)
    groups = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=2, kv_tokens=150_000,
                          cpu_offload_tokens=300_000)]
    res = run_sim(wfs, spec, groups)
    assert len(res.workflows) == 12
    assert all(w.done for w in res.workflows)


def test_holding_counts_in_ttft_but_not_in_engine_time():
    wfs = [agent(f"w{i}", 0.0, n_turns=1) for i in range(6)]
    ps = PolicySet.from_spec("cvar")
    ps.release.budget_per_engine = 1.0  # release one turn at a time (idle-engine override)
    ps.release.adapt = False
    res = ClusterSim(wfs, ps, GROUP).run()
    held = [t for w in res.workflows for t in w.turns if t.released_s > t.ready_s]
    assert held, "a one-turn budget must hold some turns"
    for t in held:
        assert t.first_token_s - t.ready_s > t.first_token_s - t.released_s


def _co_running(contention: float, same_group: bool = True):
    """Two one-turn sessions pinned to two engines, the second arriving while the first's
    prefill runs; the TTFT of each."""
    from turnstile.policies.routing import PinnedRouting
    from turnstile.sim.fitted_perf import FittedPerf

    perf = FittedPerf(0.01, 1e-4, 1e-3, host_contention=contention)
    wfs = [Workflow("a", 0.0, (Turn(4_000, 1, 0),)), Workflow("b", 0.1, (Turn(4_000, 1, 0),))]
    policies = PolicySet.from_spec("eager")
    policies.routing = PinnedRouting({"a": "e0", "b": "e1"})
    if same_group:
        groups = [EngineGroup(count=2, kv_tokens=100_000, max_batched_tokens=8192, perf=perf)]
    else:
        groups = [EngineGroup(count=1, kv_tokens=100_000, max_batched_tokens=8192, perf=perf)
                  for _ in range(2)]
    res = ClusterSim(wfs, policies, groups).run()
    return {w.id: w.turns[0].first_token_s - w.turns[0].ready_s for w in res.workflows}


def test_host_contention_slows_a_step_while_another_engine_of_the_group_computes():
    alone = _co_running(0.0)
    step = 0.01 + 4_000 * 1e-4  # one prefill step of the fitted model
    assert alone["a"] == pytest.approx(step) and alone["b"] == pytest.approx(step)
    slowed = _co_running(0.25)
    # b starts while a computes: 25% slower; a started alone and keeps its time
    assert slowed["b"] == pytest.approx(1.25 * step)
    assert slowed["a"] == pytest.approx(step)
    # engines of different groups do not share a host
    assert _co_running(0.25, same_group=False) == alone


def test_pinned_routing_names_a_missing_workflow():
    from turnstile.policies.routing import PinnedRouting

    policies = PolicySet.from_spec("eager")
    policies.routing = PinnedRouting({})
    with pytest.raises(KeyError, match="no pinned engine"):
        ClusterSim([agent("x", 0.0, n_turns=1)], policies, GROUP).run()


def test_engines_with_host_contention_cannot_join_a_run_that_leaps():
    from turnstile.sim.fitted_perf import FittedPerf

    sim = ClusterSim([agent("a", 0.0, n_turns=1)], PolicySet.from_spec("eager"), GROUP)
    contended = EngineGroup(count=2, kv_tokens=100_000,
                            perf=FittedPerf(0.01, 1e-4, host_contention=0.1))
    with pytest.raises(ValueError, match="host contention"):
        sim.add_engines(contended, 1.0)
    assert sim.add_engines(EngineGroup(count=1, kv_tokens=100_000,
                                       perf=FittedPerf(0.01, 1e-4)), 1.0) == ["e1"]


def test_the_pool_reports_each_engines_gpus_and_retirement():
    """``tps``, ``retired_s``, ``gpus_in_use``: what the elastic pool reads of the engines."""
    groups = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=1),
              EngineGroup(gpu="H100", model="llama-3.1-8b", tp=2, count=1)]
    sim = ClusterSim([], PolicySet.from_spec("eager"), groups)
    sim.submit([agent("a", 0.0, n_turns=2, tool_s=1.0)])
    retired: list[tuple[str, int, float]] = []
    sim.on_retire = lambda eid, tp, t: retired.append((eid, tp, t))
    assert sim.tps == [1, 2] and sim.retired_s == [-1.0, -1.0] and sim.gpus_in_use() == 3
    sim.run_until(0.5)
    idle = next(e.engine_id for e in sim.engines if not e.has_work())
    sim.drain([idle])  # an engine with no running turn retires at once
    i = int(idle[1:])
    assert sim.retired_s[i] == 0.5 and retired == [(idle, sim.tps[i], 0.5)]
    assert sim.gpus_in_use() == 3 - sim.tps[i]
    sim.run_until()
    assert sim.scheduler.active_workflows == 0 and len(sim.finished) == 1
    assert all(t.engine != idle for t in sim.finished[0].turns)  # nothing went to the drained
