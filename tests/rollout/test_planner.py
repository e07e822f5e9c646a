"""The planner's choice on a case with a known optimum, its acceptance rule, and elastic moves
that never drop an in-flight trajectory."""

from __future__ import annotations

import math

import pytest

from turnstile.policies.buckets import LeastOpenRouting
from turnstile.rollout.planner import (
    Plan,
    Planner,
    PlannerConfig,
    RLLoop,
    accept_plan,
    candidate_mixes,
)
from turnstile.rollout.sim import Bucket, GpuPool, RolloutCluster, SimConfig, parse_mix
from turnstile.rollout.training import ParallelConfig, TrainModel
from turnstile.rollout.workload import RolloutSpec, RolloutWorkload, training_tokens

from .conftest import LinearPerf, make_traj, simple_batch

# 1,000 output tokens/s per TP1 engine whatever the batch: rollout time = work / GPUs
THROUGHPUT_CFG = SimConfig(perf=lambda tp: LinearPerf(tp, per_seq=1e-3, per_prefill=1e-6),
                           kv_tokens=10**6, engine_start_s=5.0, block_size=256)


def test_planner_finds_the_known_optimum() -> None:
    # 64 one-turn trajectories of 1,000 tokens: rollout on g GPUs takes ceil(64/g) s
    probe = [make_traj(f"t{i}", [(0, 1000, [])], prompt_id=f"p{i}") for i in range(64)]
    tokens = training_tokens(probe)
    # training on n GPUs takes 64/n s: the period max(rollout(g), train(16-g)) is minimal,
    # uniquely, at g = 8 (8 s; g = 6 gives 11 s, g = 10 gives 10.7 s)
    peak = 1e12
    train = TrainModel(params=64 * peak / (6 * tokens), peak_flops=peak, gpu_memory_bytes=1e15,
                       mfu=1.0, tp_options=(1,), pp_options=(1,), overhead_s=0.0)
    assert train.step_time(8, tokens)[0] == pytest.approx(8.0)
    cfg = PlannerConfig(total_gpus=16, tps=(1,), gpu_step=2)
    planner = Planner(cfg, THROUGHPUT_CFG, train)
    ranked = planner.search(probe, LeastOpenRouting())
    period, rollout_s, train_s, plan = ranked[0]
    assert plan == Plan((Bucket(1, 8),), 8)
    assert rollout_s == pytest.approx(8.0, rel=0.01) and train_s == pytest.approx(8.0)
    assert period == pytest.approx(8.0, rel=0.01)
    assert planner.evals <= 5  # a binary search, not a sweep


def test_acceptance_rule() -> None:
    assert accept_plan(100.0, 90.0, horizon_steps=10, reconfig_s=50.0)  # 10%, pays 100 > 50
    assert not accept_plan(100.0, 96.0, horizon_steps=10, reconfig_s=1.0)  # gain < 5%
    assert not accept_plan(100.0, 90.0, horizon_steps=10, reconfig_s=120.0)  # cost > saving
    assert not accept_plan(100.0, 101.0, horizon_steps=10, reconfig_s=0.0)


def test_candidate_mixes() -> None:
    for g in (2, 4, 8, 12, 16):
        mixes = candidate_mixes(g)
        assert mixes and all(sum(b.gpus for b in m) == g for m in mixes)
        tiered = candidate_mixes(g, tiered=True)
        if g >= 4:
            assert all(len(m) >= 2 for m in tiered)
    assert (Bucket(1, 8), Bucket(2, 2), Bucket(4, 1)) in candidate_mixes(16)


def test_training_model() -> None:
    m = TrainModel.for_names("H100", "qwen3-8b")
    assert m.min_gpus() >= 2  # 8B params with Adam do not fit one 80 GB GPU
    times = [m.step_time(n, 1e7)[0] for n in (4, 8, 16)]
    assert times[0] > times[1] > times[2]
    _, cfg = m.step_time(8, 1e7)
    assert isinstance(cfg, ParallelConfig) and cfg.gpus == 8
    assert m.step_time(1, 1e7) == (math.inf, None)


def test_elastic_move_never_drops_in_flight_trajectories() -> None:
    batch = simple_batch(24, turns=6, out=200, tool_s=1.0)
    old, new = Plan(parse_mix("tp1x4"), 4), Plan(parse_mix("tp2x3"), 2)
    sim = RolloutCluster(old.mix, LeastOpenRouting(), THROUGHPUT_CFG)
    pool = GpuPool(sim, total_gpus=8, train_gpus=old.train_gpus)
    retired: list[float] = []
    sim.on_retire = lambda eid, tp, t: (retired.append(t), pool.start_pending(t))
    res = sim.add_batch(batch, 0.0)
    sim.run_until(2.0)
    assert res.done == 0
    moves = pool.apply(new.mix, new.train_gpus, sim.now)
    assert len(moves["drained"]) == 4
    # drained engines with no running turn retire at once and free their GPUs; the rest of
    # the TP2 engines wait for GPUs
    assert len(moves["started"]) + len(moves["waiting_for_gpus"]) == 3
    assert sim.gpus_in_use() <= 8 - pool.train_gpus
    sim.run_batch(res)
    assert res.done == len(batch)
    done = {wf.id: wf for wf in sim.sim.finished}
    for tr in batch:
        assert len(done[tr.id].turns) == tr.num_turns
    assert pool.mix() == parse_mix("tp2x3")  # the rest started once GPUs were freed
    assert len(retired) == 4 and not pool.pending


def test_lending_a_replica_and_giving_it_back() -> None:
    sim = RolloutCluster(parse_mix("tp1x4"), LeastOpenRouting(), THROUGHPUT_CFG)
    pool = GpuPool(sim, total_gpus=8, train_gpus=4)
    assert pool.lend(min_rollout_gpus=2) is not None
    assert pool.lend(min_rollout_gpus=2) is not None
    assert pool.lend(min_rollout_gpus=2) is None  # would leave 1 GPU rolling out
    assert pool.train_gpus == 6 and pool.mix() == parse_mix("tp1x2")
    assert pool.give_back(sim.now) is not None
    assert pool.train_gpus == 5 and pool.mix() == parse_mix("tp1x3")


def test_rl_loop_with_partial_rollout_completes_everything() -> None:
    wl = RolloutWorkload(RolloutSpec(n_prompts=4, group_size=4, tool_time_scale=0.1))
    loop = RLLoop(wl, "cmlfq", planner=PlannerConfig(total_gpus=8, replan_every=1, min_gain=0.0),
                  partial_frac=0.75, reconfig_s=0.0)
    res = loop.run(3)
    assert loop.sim is not None
    ids = {t.id for k in range(3) for t in wl.batch(k)}
    assert set(loop.sim.done_order) == ids and len(loop.sim.done_order) == len(ids)
    assert sum(s.trajectories_done for s in res.steps) <= len(ids)
    for s in res.steps:
        assert s.plan.rollout_gpus + s.plan.train_gpus <= 8
        assert s.period_s >= s.rollout_s - 1e-9
    assert res.total_s >= sum(s.period_s for s in res.steps)
