"""The rollout simulator: leaping matches iteration-by-iteration, accounting closes, elastic
drains never drop a trajectory, joining engines take parked work."""

from __future__ import annotations

import dataclasses

import pytest

from turnstile.rollout.routing import CMLFQRouter, LevelBounds, LoadBalanceRouter, create_router
from turnstile.rollout.sim import Bucket, RolloutSim, SimConfig, parse_mix, simulate_batch
from turnstile.rollout.workload import RolloutSpec, RolloutWorkload

from .conftest import LinearPerf, simple_batch

CFG = SimConfig(perf=lambda tp: LinearPerf(tp, base=2e-3, per_seq=2e-4, per_kv=1e-8),
                kv_tokens=200_000, engine_start_s=5.0)


def test_parse_mix() -> None:
    assert parse_mix("tp4x1, tp1x8,tp2x2") == (Bucket(1, 8), Bucket(2, 2), Bucket(4, 1))
    assert parse_mix("tp1x8,tp8x0") == (Bucket(1, 8),)
    with pytest.raises(ValueError):
        parse_mix("8xtp1")


def test_leaping_matches_iteration_by_iteration() -> None:
    batch = RolloutWorkload(RolloutSpec(n_prompts=4, group_size=4, tool_time_scale=0.2)).batch(0)
    mix = parse_mix("tp1x2,tp2x1")
    fast, sim_fast, _ = simulate_batch(batch, mix, LoadBalanceRouter(), CFG)
    exact, sim_exact, _ = simulate_batch(
        batch, mix, LoadBalanceRouter(), dataclasses.replace(CFG, max_leap_iters=1)
    )
    assert fast.makespan_s == pytest.approx(exact.makespan_s, rel=0.01)
    for tid, t in exact.finish_s.items():
        assert fast.finish_s[tid] == pytest.approx(t, rel=0.02, abs=0.05)
    assert sim_fast.events < sim_exact.events / 5
    assert sim_fast.stats()["decode_tokens"] == sim_exact.stats()["decode_tokens"]


def test_roofline_default_runs_and_accounting_closes() -> None:
    batch = RolloutWorkload(RolloutSpec(n_prompts=8, group_size=4)).batch(0)
    res, sim, _ = simulate_batch(batch, parse_mix("tp1x4,tp4x1"), create_router("cmlfq"))
    assert res.done == res.n == len(batch)
    for tr in batch:
        st = sim.trajectory(tr.id)
        assert st.done and st.turns_done == tr.num_turns
        assert st.attained_output_tokens == tr.total_output_tokens
    for e in sim.engines:
        assert e.idle and e.used == 0 and e.info.open_trajectories == 0
        assert e.info.open_tokens == 0 and e.info.open_attained_tokens == 0
    assert sim.stats()["decode_tokens"] + len(sim.done_order) > 0


def test_stickiness_keeps_the_cache() -> None:
    batch = simple_batch(24, turns=4)
    mix = parse_mix("tp1x3")
    _, sticky, _ = simulate_batch(batch, mix, LoadBalanceRouter(), CFG)
    _, loose, _ = simulate_batch(batch, mix, LoadBalanceRouter(sticky=False), CFG)
    assert sticky.migrations == 0 and sticky.stats()["recomputed_tokens"] == 0
    assert loose.migrations > 0 and loose.stats()["recomputed_tokens"] > 0


@pytest.mark.parametrize("mode", ["finish", "migrate"])
def test_drain_never_drops_a_trajectory(mode: str) -> None:
    batch = simple_batch(30, turns=6, out=80, tool_s=2.0)
    sim = RolloutSim(parse_mix("tp1x3"), LoadBalanceRouter(), CFG)
    res = sim.add_batch(batch, 0.0)
    sim.run_until(3.0)  # mid-rollout: every engine holds open trajectories
    victim = sim.engines[0].info.id
    on_victim = [t.id for t in sim.open_trajectories() if t.engine == victim]
    assert on_victim
    sim.drain([victim], mode=mode)  # type: ignore[arg-type]
    sim.run()
    assert res.done == len(batch)
    for tr in batch:
        st = sim.trajectory(tr.id)
        assert st.turns_done == tr.num_turns
    moved = [tid for tid in on_victim if sim.trajectory(tid).migrations > 0]
    if mode == "finish":
        assert not moved  # they finished where they were
        assert all(sim.trajectory(t).engine == victim for t in on_victim)
    else:
        assert moved == on_victim or len(moved) >= len(on_victim) - 1
    assert [r[0] for r in sim.retired] == [victim]
    # nothing new went to the drained engine
    others = [t.id for t in batch if t.id not in on_victim]
    assert all(sim.trajectory(t).engine != victim for t in others)


def test_joining_engines_take_parked_turns() -> None:
    batch = simple_batch(8, turns=2)
    sim = RolloutSim(parse_mix("tp1x1"), LoadBalanceRouter(), CFG)
    sim.drain([sim.engines[0].info.id], at_s=0.0)
    sim.run_until(0.0)
    new = sim.add_engines(2, 2)
    res = sim.add_batch(batch, 0.0)
    sim.run()
    assert res.done == len(batch)
    assert {sim.trajectory(t.id).engine for t in batch} <= set(new)
    # nothing could start before the engines loaded their weights
    assert min(res.finish_s.values()) > CFG.engine_start_s


def test_every_router_completes_a_batch() -> None:
    batch = RolloutWorkload(RolloutSpec(n_prompts=4, group_size=4, tool_time_scale=0.1)).batch(0)
    for name in ("load-balance", "length-predict", "cmlfq", "round-robin"):
        res, _, _ = simulate_batch(batch, parse_mix("tp1x2,tp2x1,tp4x1"), create_router(name),
                                   CFG)
        assert res.done == len(batch), name


def test_cmlfq_moves_long_trajectories_to_the_fast_bucket() -> None:
    long = simple_batch(2, turns=12, out=400)
    short = simple_batch(30, turns=2, out=40, step=0)
    for i, tr in enumerate(long):
        long[i] = dataclasses.replace(tr, workflow=dataclasses.replace(tr.workflow, id=f"L{i}"))
    router = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)))
    res, sim, _ = simulate_batch(long + short, parse_mix("tp1x2,tp4x1"), router, CFG)
    assert res.done == 32
    assert all(sim.trajectory(f"L{i}").engine.endswith("tp4") for i in range(2))
    assert router.moves >= 2
