"""Leaps over chunked-prefill iterations and over decode iterations whose prefills are stalled
on a full KV cache give exactly what plain stepping gives (every float equal)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

import turnstile.sim.leap_loop as leap_loop
import turnstile.sim.step as step
from turnstile.build_info import compiled_build
from turnstile.sim.cluster import EngineGroup
from turnstile.workload import ToolCall, Turn, Workflow

from .test_leap_exact import timeline


def long_prompts(n: int, rate: float, seed: int, turns: int = 1) -> list[Workflow]:
    """Prompts several token budgets long (chunked prefill over many iterations)."""
    rng = random.Random(seed)
    t = 0.0
    wfs = []
    for i in range(n):
        t += rng.expovariate(rate)
        ts = []
        ctx = 0
        for j in range(turns):
            inp = max(1, int(rng.lognormvariate(math.log(6_000), 0.7)))
            out = max(1, int(rng.lognormvariate(math.log(200), 0.8)))
            tools = (ToolCall("t", round(rng.uniform(0.5, 5.0), 6)),) if j < turns - 1 else ()
            ts.append(Turn(min(inp, 30_000), min(out, 1_500), ctx, tools=tools))
            ctx += min(inp, 30_000) + min(out, 1_500)
        wfs.append(Workflow(f"w{i}", round(t, 6), tuple(ts)))
    return wfs


@pytest.mark.parametrize(
    ("engines", "kv_tokens", "turns"),
    [
        (1, None, 1),  # ample KV: prefill leaps cut by arrivals
        (3, None, 3),  # lazily planned, recorded early when a turn reaches the engine
        (1, 40_000, 1),  # a full cache: prefills stall, preemptions
        (2, 60_000, 3),  # both, with sessions re-prefilled after tool calls
    ],
)
def test_prefill_and_stalled_leaps_are_exact(monkeypatch, engines, kv_tokens, turns):
    wfs = long_prompts(60, 1.5, seed=11, turns=turns)
    groups = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=engines, kv_tokens=kv_tokens,
                          max_num_seqs=32, max_batched_tokens=2_048)]
    stepped = timeline(wfs, groups, False)
    seen: Counter[str] = Counter()
    run_prefill = leap_loop.LeapLoops._run_prefill
    stalled = step.StepExecutor._prefills_stalled

    def counted_prefill(self, out, plan, until):
        got = run_prefill(self, out, plan, until)
        seen["prefill"] += bool(got)
        return got

    def counted_stalled(self):
        got = stalled(self)
        seen["stalled"] += got
        return got

    monkeypatch.setattr(leap_loop.LeapLoops, "_run_prefill", counted_prefill)
    monkeypatch.setattr(step.StepExecutor, "_prefills_stalled", counted_stalled)
    assert timeline(wfs, groups, True) == stepped
    if compiled_build() is not None:
        return  # compiled methods call each other directly: the patched counters see nothing
    assert seen["prefill"], "no prefill leap ran"
    if kv_tokens is not None:
        assert seen["stalled"], "no prefill was stalled on memory"


def parallel_branches(n: int, seed: int) -> list[Workflow]:
    """A root turn, three parallel turns on its context, then a join: turns of one session
    prefilling at once, on different engines."""
    rng = random.Random(seed)
    t = 0.0
    wfs = []
    for i in range(n):
        t += rng.expovariate(2.0)
        root = rng.randint(3_000, 12_000)
        turns = [Turn(root, rng.randint(50, 400), tools=(ToolCall("t", 0.5),))]
        turns += [Turn(rng.randint(2_000, 9_000), rng.randint(50, 600), root, parents=(0,))
                   for _ in range(3)]
        turns.append(Turn(rng.randint(500, 3_000), rng.randint(50, 300), root,
                          parents=(1, 2, 3)))
        wfs.append(Workflow(f"d{i}", round(t, 6), tuple(turns)))
    return wfs


@pytest.mark.parametrize("kv_tokens", [None, 60_000])
def test_parallel_turns_of_one_session_count_the_same_recompute(kv_tokens):
    # the engines share each session's mark (what was ever computed): a prefill leap must not
    # hold its chunks back from another engine prefilling the same session meanwhile
    wfs = parallel_branches(40, seed=4)
    groups = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=3, kv_tokens=kv_tokens,
                          max_num_seqs=32, max_batched_tokens=2_048)]
    assert timeline(wfs, groups, True) == timeline(wfs, groups, False)
