"""The default release policy holds a ready turn only where the regime justifies it.

Property (issue 31, docs/policies.md): on random small workloads, the default policy never
holds a turn while an engine is idle with room for it — idle (nothing released to it), taking
work, with a free slot, and KV for the turn's prompt beside the sessions paused there — and no
hold ever outlives the documented bound (``Scheduler.hold_bound_s``): its timer fires on time.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.core import Scheduler
from turnstile.core.state import ClusterView, TurnRecord, TurnState
from turnstile.policies import DEFAULTS, PolicySet
from turnstile.policies.auto import AutoRelease
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.workload import ToolCall, Turn, Workflow


def _idle_room(view: ClusterView, turn: TurnRecord) -> bool:
    for e in view.values():
        if not e.idle or not e.has_free_slot:
            continue
        if e.capacity_tokens <= 0 or e.capacity_tokens - e.paused_context_tokens >= \
                turn.prompt_tokens:
            return True
    return False


@st.composite
def workloads(draw: st.DrawFn) -> list[Workflow]:
    n = draw(st.integers(1, 8))
    out = []
    for w in range(n):
        k = draw(st.integers(1, 5))
        ctx = 0
        turns = []
        for i in range(k):
            inp = draw(st.integers(1, 12_000))
            outp = draw(st.integers(1, 2_000))
            tools = () if i == k - 1 else (
                ToolCall("t", draw(st.floats(0.0, 60.0, allow_nan=False))),)
            turns.append(Turn(inp, outp, ctx, tools=tools))
            ctx += inp + outp
        arrival = draw(st.floats(0.0, 120.0, allow_nan=False))
        out.append(Workflow(f"w{w}", arrival, tuple(turns)))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wfs=workloads(), engines=st.integers(1, 3), kv_k=st.integers(20, 400),
       slots=st.sampled_from([0, 0, 2, 4]))
def test_default_policy_never_holds_past_its_bound_while_an_engine_is_idle_with_room(
        wfs: list[Workflow], engines: int, kv_k: int, slots: int) -> None:
    # every request fits an engine (a slot) on its own: contention, never an impossible turn
    need = max(t.prompt_tokens + t.output_tokens for w in wfs for t in w.turns)
    kv = max(kv_k * 1000, (need + 64) * max(slots, 1))  # + a block of rounding
    group = EngineGroup(count=engines, kv_tokens=kv, kv_slots=slots,
                        max_num_seqs=slots or 256)
    policies = PolicySet.from_spec(DEFAULTS["release"])
    assert isinstance(policies.release, AutoRelease)
    sim = ClusterSim(wfs, policies, [group])
    sched: Scheduler = sim.scheduler
    inner = sched._release

    def checked_release(now: float) -> list:
        bound = sched.hold_bound_s(now)
        assert math.isfinite(bound) and bound > 0
        # the policy's timer fires when a hold reaches its bound: none is older on arrival
        assert sched.oldest_hold_age(now) <= bound + 1e-6, (sched.oldest_hold_age(now), bound)
        actions = inner(now)
        for rec in sched._ready:
            assert rec.state == TurnState.READY
            # room means release: nothing stays held while an engine is idle with room for it
            assert not _idle_room(sched.view, rec), (rec, now - rec.ready_s, bound)
        assert sched.oldest_hold_age(now) == max(
            (now - r.ready_s for r in sched._ready), default=0.0)
        return actions

    sched._release = checked_release  # type: ignore[method-assign]
    res = sim.run()
    assert len(res.workflows) == len(wfs)  # everything finishes: no turn is held forever
    assert all(wf.finished_s >= 0 for wf in res.workflows)


def test_hold_bound_follows_the_workloads_own_times() -> None:
    rel = AutoRelease()
    assert rel.hold_bound_s(0.0) == rel.boot_hold_s  # nothing observed yet: the boot bound
    assert rel.boot_hold_s < 60.0  # never the old 3,600 s
