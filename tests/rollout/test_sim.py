"""Rollout batches on the shared simulator (ClusterSim + EngineModel): accounting closes,
stickiness keeps the cache, elastic drains never drop a trajectory, joining engines take held
turns, every router completes a batch."""

from __future__ import annotations

import dataclasses

import pytest

from turnstile.policies.buckets import LeastOpenRouting
from turnstile.policies.cmlfq import AdaptiveCmlfqRouting
from turnstile.policies.estimators import LevelBounds
from turnstile.rollout.sim import Bucket, RolloutCluster, SimConfig, parse_mix, simulate_batch
from turnstile.rollout.workload import RolloutSpec, RolloutWorkload

from .conftest import LinearPerf, simple_batch

CFG = SimConfig(perf=lambda tp: LinearPerf(tp, base=2e-3, per_seq=2e-4, per_kv=1e-8),
                kv_tokens=200_000, engine_start_s=5.0, block_size=16)


def test_parse_mix() -> None:
    assert parse_mix("tp4x1, tp1x8,tp2x2") == (Bucket(1, 8), Bucket(2, 2), Bucket(4, 1))
    assert parse_mix("tp1x8,tp8x0") == (Bucket(1, 8),)
    with pytest.raises(ValueError):
        parse_mix("8xtp1")


def test_roofline_default_runs_and_accounting_closes() -> None:
    batch = RolloutWorkload(RolloutSpec(n_prompts=4, group_size=4)).batch(0)
    res, cluster, _ = simulate_batch(batch, parse_mix("tp1x2,tp4x1"), "cmlfq")
    assert res.done == res.n == len(batch)
    assert res.output_tokens == sum(t.total_output_tokens for t in batch)
    assert set(res.finish_s) == {t.id for t in batch}
    assert res.makespan_s == pytest.approx(max(res.finish_s.values()))
    stats = cluster.stats()
    assert stats["decode_tokens"] > 0 and stats["events"] > 0
    view = cluster.sim.scheduler.view
    assert all(view[e].outstanding_turns == 0 for e in view)


def test_stickiness_keeps_the_cache() -> None:
    batch = simple_batch(24, turns=4)
    mix = parse_mix("tp1x3")
    _, sticky, _ = simulate_batch(batch, mix, LeastOpenRouting(), CFG)
    _, loose, _ = simulate_batch(batch, mix, LeastOpenRouting(sticky=False), CFG)
    assert sticky.migrations == 0
    assert loose.migrations > 0
    assert loose.stats()["recomputed_tokens"] > sticky.stats()["recomputed_tokens"]


def test_drain_never_drops_a_trajectory() -> None:
    batch = simple_batch(30, turns=6, out=80, tool_s=2.0)
    cluster = RolloutCluster(parse_mix("tp1x3"), "least-open", CFG)
    retired: list[tuple[str, int, float]] = []
    cluster.on_retire = lambda eid, tp, t: retired.append((eid, tp, t))
    res = cluster.add_batch(batch, 0.0)
    cluster.run_until(3.0)  # mid-rollout: every engine holds open trajectories
    victim = "e0"
    assert cluster.open_on(victim) > 0
    cluster.drain([victim])
    t_drain = cluster.now
    cluster.run_batch(res)
    assert res.done == len(batch)
    assert [r[0] for r in retired] == [victim]
    # nothing released to the drained engine after the drain
    for wf in cluster.sim.finished:
        for t in wf.turns:
            assert t.engine != victim or t.released_s <= t_drain
    assert cluster.gpus_in_use() == 2


def test_joining_engines_take_held_turns() -> None:
    batch = simple_batch(8, turns=2)
    cluster = RolloutCluster(parse_mix("tp1x1"), "least-open", CFG)
    cluster.drain(["e0"])
    new = cluster.add_engines(2, 2)
    res = cluster.add_batch(batch, 0.0)
    cluster.run_batch(res)
    assert res.done == len(batch)
    engines = {t.engine for wf in cluster.sim.finished for t in wf.turns}
    assert engines <= set(new)
    # nothing could start before the engines loaded their weights
    assert min(res.finish_s.values()) > CFG.engine_start_s


@pytest.mark.parametrize("name", ["least-open", "length-predict", "cmlfq", "cmlfq-adaptive",
                                  "kv-affinity", "round-robin"])
def test_every_router_completes_a_batch(name: str) -> None:
    batch = RolloutWorkload(RolloutSpec(n_prompts=4, group_size=4, tool_time_scale=0.1)).batch(0)
    res, _, _ = simulate_batch(batch, parse_mix("tp1x2,tp2x1,tp4x1"), name, CFG)
    assert res.done == len(batch)


def test_adaptive_cmlfq_moves_long_trajectories_to_the_fast_bucket() -> None:
    long = simple_batch(2, turns=12, out=400)
    short = simple_batch(30, turns=2, out=40)
    for i, tr in enumerate(long):
        long[i] = dataclasses.replace(tr, workflow=dataclasses.replace(tr.workflow, id=f"L{i}"))
    router = AdaptiveCmlfqRouting(bounds=LevelBounds(bounds=(1000,)))
    res, cluster, _ = simulate_batch(long + short, parse_mix("tp1x2,tp4x1"), router, CFG)
    assert res.done == 32
    last = {wf.id: wf.turns[-1].engine for wf in cluster.sim.finished}
    assert last["L0"] == last["L1"] == "e2"  # the TP4 engine
    assert router.moves >= 2


@pytest.mark.parametrize("dt", [0.37, 5.1])
def test_run_until_in_slices_with_a_stop_matches_one_run(dt: float) -> None:
    """Stopping a run at t (with a stop condition that never holds) and going on records the
    engines' planned leaps up to t: the batch ends as in one uninterrupted run. (A leap cut at
    the last event before t ended before the clock moved on to t, and its step end was due in
    the past: 'event scheduled in the past', in the elastic loop's run_until(train_end, stop).)"""
    from turnstile.rollout.libra_workloads import make_workload

    batch = make_workload("r2e-gym", n_prompts=4, group_size=4, seed=1).batch(0)
    whole, _, _ = simulate_batch(batch, parse_mix("tp1x2,tp4x1"), "cmlfq")
    cluster = RolloutCluster(parse_mix("tp1x2,tp4x1"), "cmlfq")
    res = cluster.add_batch(batch, 0.0)
    t = 0.0
    while res.done < res.n and t < 10 * whole.makespan_s:
        t += dt
        cluster.run_until(t, stop=lambda: False)
    assert res.done == res.n
    assert res.makespan_s == pytest.approx(whole.makespan_s, rel=1e-9)
