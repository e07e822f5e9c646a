"""Asynchronous RL with bounded staleness and the elastic pool (simulated, small)."""

from __future__ import annotations

import pytest

from turnstile.rollout.elastic import AsyncRLLoop, ElasticConfig
from turnstile.rollout.planner import Plan, PlannerConfig
from turnstile.rollout.sim import SimConfig, parse_mix
from turnstile.rollout.training import TrainModel
from turnstile.rollout.workload import RolloutSpec, RolloutWorkload

from .conftest import LinearPerf

CFG = SimConfig(perf=lambda tp: LinearPerf(tp, per_seq=1e-3, per_prefill=1e-6),
                kv_tokens=10**6, engine_start_s=5.0, block_size=256)


def _workload() -> RolloutWorkload:
    return RolloutWorkload(RolloutSpec(n_prompts=2, group_size=2, tool_time_scale=0.05))


def _train(mfu: float = 0.4) -> TrainModel:
    return TrainModel(params=1e9, peak_flops=1e13, gpu_memory_bytes=1e12, mfu=mfu,
                      tp_options=(1,), pp_options=(1,), overhead_s=1.0)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_bounded_staleness_and_order(staleness: int) -> None:
    loop = AsyncRLLoop(_workload(), "least-open", sim_config=CFG, train=_train(),
                       planner=PlannerConfig(total_gpus=8, static=Plan(parse_mix("tp1x4"), 4)),
                       elastic=ElasticConfig(staleness=staleness, lend=False))
    res = loop.run(6)
    assert [s.step for s in res.steps] == list(range(6))
    for prev, s in zip(res.steps, res.steps[1:], strict=False):
        assert s.train_start_s >= prev.train_end_s - 1e-9  # one trainer, in order
    for s in res.steps:
        assert 0 <= s.staleness <= staleness
        assert s.train_start_s >= s.batch_end_s - 1e-9
    if staleness == 0:  # on-policy: a batch starts once the previous step has trained
        for prev, s in zip(res.steps, res.steps[1:], strict=False):
            assert s.batch_start_s >= prev.train_end_s - 1e-9
    assert res.total_s == pytest.approx(res.steps[-1].train_end_s)
    assert loop.sim is not None and len(loop.sim.done_order) == 6 * 4


def test_staleness_overlaps_batches_and_raises_throughput() -> None:
    def run(staleness: int) -> float:
        loop = AsyncRLLoop(_workload(), "least-open", sim_config=CFG, train=_train(),
                           planner=PlannerConfig(total_gpus=8,
                                                 static=Plan(parse_mix("tp1x4"), 4)),
                           elastic=ElasticConfig(staleness=staleness, lend=False))
        return loop.run(6).steps_per_hour

    assert run(2) > run(0)


def test_slow_training_borrows_rollout_replicas() -> None:
    loop = AsyncRLLoop(_workload(), "least-open", sim_config=CFG, train=_train(mfu=0.002),
                       planner=PlannerConfig(total_gpus=8, static=Plan(parse_mix("tp1x4"), 4)),
                       elastic=ElasticConfig(staleness=1, lend=True, min_rollout_gpus=2))
    res = loop.run(6)
    assert res.lends >= 1
    gpus = [s.train_gpus for s in res.steps]
    assert max(gpus) > 4  # training grew with lent replicas
    assert all(s.rollout_gpus >= 2 for s in res.steps)
    assert loop.sim is not None and len(loop.sim.done_order) == 6 * 4
