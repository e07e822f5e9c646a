"""The decode leap's fast paths (``step_and_leap``, the roofline loop) give exactly what plain
stepping gives: every turn timestamp and engine counter equal as floats, not approximately."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.sim.roofline_perf import RooflinePerf, load_gpu, load_model
from turnstile.workload import Turn, Workflow


def requests(n: int, rate: float, seed: int) -> list[Workflow]:
    rng = random.Random(seed)
    t = 0.0
    wfs = []
    for i in range(n):
        t += rng.expovariate(rate)
        p = max(1, int(rng.lognormvariate(math.log(800), 0.9)))
        o = max(1, int(rng.lognormvariate(math.log(150), 0.8)))
        wfs.append(Workflow(f"r{i}", round(t, 6), (Turn(min(p, 3_000), min(o, 1_000)),)))
    return wfs


def timeline(wfs: list[Workflow], groups: list[EngineGroup], ff: bool):
    res = ClusterSim(wfs, PolicySet.from_spec("eager"), groups, fast_forward=ff).run()
    turns = sorted(
        (t.workflow.id, t.index, repr(t.started_s), repr(t.first_token_s), repr(t.finished_s),
         t.engine)
        for w in res.workflows
        for t in w.turns
    )
    return turns, res.engine_stats, res.iterations, repr(res.makespan_s)


def slow_compute(tflops: float) -> RooflinePerf:
    """An H100 with less compute: decode iterations become compute-bound (or cross over)."""
    return RooflinePerf(replace(load_gpu("H100"), peak_tflops=tflops), load_model("llama-3.1-8b"))


@pytest.mark.parametrize(
    ("rate", "engines", "kv_tokens", "max_seqs", "perf"),
    [
        (4.0, 1, None, 128, None),  # memory-bound decode, ample KV (the common case)
        (4.0, 2, None, 64, None),  # two engines cutting each other's leaps
        (6.0, 1, 12_288, 64, None),  # little KV: leaps stop where blocks run out, preemptions
        (4.0, 1, None, 128, 2.0),  # compute-bound decode iterations
        (0.05, 1, None, 128, 4.5),  # one decoder at a time, crossing from one bound to the other
    ],
)
def test_leap_fast_paths_are_exact(rate, engines, kv_tokens, max_seqs, perf):
    wfs = requests(400, rate, seed=3)
    groups = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=engines, kv_tokens=kv_tokens,
                          max_num_seqs=max_seqs, max_batched_tokens=2_048,
                          perf=None if perf is None else slow_compute(perf))]
    assert timeline(wfs, groups, True) == timeline(wfs, groups, False)
