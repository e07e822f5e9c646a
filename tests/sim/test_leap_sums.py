"""Long decode leaps summed by numpy (:mod:`turnstile.sim.leap_sums`) give exactly what the
leap loop, and so plain stepping, gives: every float equal, not approximately."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

import turnstile.sim.leap_loop as leap_loop
import turnstile.sim.leap_sums as leap_sums
from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.sim.leap_sums import first_at_or_after, leap_durations, running_sums
from turnstile.sim.roofline_perf import RooflinePerf, load_gpu, load_model
from turnstile.sim.tp_perf import tp_perf_model
from turnstile.workload import Turn, Workflow


def requests(n: int, rate: float, seed: int) -> list[Workflow]:
    rng = random.Random(seed)
    t = 0.0
    wfs = []
    for i in range(n):
        t += rng.expovariate(rate)
        p = max(1, int(rng.lognormvariate(math.log(800), 0.9)))
        o = max(1, int(rng.lognormvariate(math.log(300), 0.8)))
        wfs.append(Workflow(f"r{i}", round(t, 6), (Turn(min(p, 3_000), min(o, 2_000)),)))
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


def loop(end, busy, kv, n_dec, cap, until, roof, linear, base, per_kv):
    """The leap loop of ``StepExecutor._run_roofline``, as written there."""
    c_tok, attn_s, weights_s, kv_s, overhead_s, ar_tok, comm = roof
    total = 0.0
    k = cap
    for j in range(cap):
        if end >= until:
            k = j
            break
        if linear:
            dur = base + per_kv * kv + overhead_s + ar_tok + comm
        else:
            compute = c_tok + attn_s * kv
            memory = weights_s + kv_s * kv
            dur = (compute if compute > memory else memory) + overhead_s + ar_tok + comm
        end += dur
        busy += dur
        total += dur
        kv += n_dec
    return k, end, busy, total, kv


def summed(end, busy, kv, n_dec, cap, until, roof, linear, base, per_kv):
    ends, durs = leap_durations(end, kv, n_dec, cap, roof, linear, base, per_kv)
    k = first_at_or_after(ends, cap, until)
    if not k:
        return 0, end, busy, 0.0, kv
    b, t = running_sums(busy, durs, k)
    return k, float(ends[k]), b, t, kv + n_dec * k


def test_numpy_sums_equal_the_loop_bit_for_bit():
    rng = random.Random(7)
    for _ in range(3000):
        roof = (rng.uniform(1e-4, 1e-2), rng.uniform(1e-9, 1e-7), rng.uniform(1e-3, 1e-2),
                rng.uniform(1e-9, 1e-7), rng.uniform(1e-4, 1e-3),
                rng.choice([0.0, rng.uniform(0, 1e-5)]), rng.choice([0.0, rng.uniform(0, 1e-4)]))
        linear = rng.random() < 0.5
        base, per_kv = (roof[2], roof[3]) if rng.random() < 0.5 else (roof[0], roof[1])
        end = rng.uniform(0, 5_000)
        args = (end, rng.uniform(0, 5_000), rng.randint(0, 2_000_000), rng.randint(1, 256),
                rng.randint(1, 2_000), end + rng.choice([rng.uniform(0, 30), float("inf")]),
                roof, linear, base, per_kv)
        assert summed(*args) == loop(*args)


@pytest.mark.parametrize(
    ("rate", "engines", "kv_tokens", "max_seqs", "perf"),
    [
        (4.0, 1, None, 128, None),  # the common case, one engine (leaps cut at once)
        (4.0, 3, None, 64, None),  # lazily planned leaps, cut later from the kept sums
        (6.0, 2, 12_288, 64, None),  # little KV: leaps stop where blocks run out, preemptions
        (4.0, 2, None, 128, 2.0),  # compute-bound decode iterations
        (0.05, 1, None, 128, 4.5),  # crossing from one roofline bound to the other
        (4.0, 2, None, 128, "tp2"),  # the per-TP model: an all-reduce term in every step
    ],
)
def test_every_leap_summed_by_numpy_is_exact(monkeypatch, rate, engines, kv_tokens, max_seqs,
                                             perf):
    wfs = requests(300, rate, seed=5)
    if perf == "tp2":
        model = tp_perf_model("H100", "llama-3.1-8b", 2)
    else:
        model = None if perf is None else slow_compute(perf)
    groups = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=engines, kv_tokens=kv_tokens,
                          max_num_seqs=max_seqs, max_batched_tokens=2_048, perf=model)]
    stepped = timeline(wfs, groups, False)
    calls = []
    real = leap_sums.leap_durations

    def counted(*a):
        calls.append(a[3])
        return real(*a)

    monkeypatch.setattr(leap_loop, "leap_durations", counted)
    monkeypatch.setattr(leap_loop, "_NUMPY_MIN", 1)  # every roofline leap through numpy
    assert timeline(wfs, groups, True) == stepped
    assert calls, "the numpy path never ran"
