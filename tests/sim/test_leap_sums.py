"""Long decode leaps summed by numpy (:mod:`turnstile.sim.leap_sums`) give exactly what the
leap loop, and so plain stepping, gives: every float equal, not approximately."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import turnstile.sim.leap_loop as leap_loop
import turnstile.sim.leap_sums as leap_sums
from turnstile.sim.cluster import EngineGroup
from turnstile.sim.leap_sums import first_at_or_after, leap_durations, running_sums
from turnstile.sim.tp_perf import tp_perf_model
from turnstile.workload import Workflow

from .test_leap_exact import requests, slow_compute, timeline


def long_requests(n: int, rate: float, seed: int) -> list[Workflow]:
    """``test_leap_exact``'s requests with twice the outputs: leaps of hundreds of iterations,
    past the numpy threshold even without forcing it."""
    return [replace(w, turns=tuple(replace(t, output_tokens=2 * t.output_tokens)
                                   for t in w.turns))
            for w in requests(n, rate, seed)]


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
    wfs = long_requests(300, rate, seed=5)
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
