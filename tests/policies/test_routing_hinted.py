"""The ``hinted`` routing policy: the client's engine when usable, else the fallback."""

from __future__ import annotations

import pytest

from turnstile.core import Scheduler
from turnstile.core.actions import Release
from turnstile.core.state import (
    ClusterView,
    EngineLoad,
    TurnRecord,
    WorkflowRecord,
    charge,
    report_stats,
)
from turnstile.policies import ROUTING, PolicySet
from turnstile.workload import Turn


def view_of(*loads: int) -> ClusterView:
    engines = []
    for i, load in enumerate(loads):
        e = EngineLoad(f"e{i}")
        charge(e, load)
        engines.append(e)
    return ClusterView(engines)


def turn_of(hint: str | None, last_engine: str | None = None) -> TurnRecord:
    wf = WorkflowRecord("w", 0.0, "default", None)
    wf.last_engine = last_engine
    rec = TurnRecord(wf, 0, Turn(input_tokens=100, output_tokens=10))
    rec.engine_hint = hint
    return rec


def test_hinted_follows_a_healthy_hint_even_against_load() -> None:
    pol = ROUTING.create("hinted")
    assert "hinted" in ROUTING.names() and pol.name == "hinted"
    view = view_of(0, 500_000)
    assert pol.route(turn_of("e1"), view, 0.0) == "e1"  # least-loaded would say e0
    assert pol.route(turn_of("e0", last_engine="e1"), view_of(0, 0), 0.0) == "e0"
    assert (pol.hinted, pol.fell_back) == (2, 0)


def test_hinted_falls_back_without_a_usable_hint() -> None:
    pol = ROUTING.create("hinted")  # fallback kv-affinity
    view = view_of(5_000, 0)
    assert pol.route(turn_of(None), view, 0.0) == "e1"  # no hint: least-loaded first turn
    assert pol.route(turn_of("nope"), view, 0.0) == "e1"  # unknown engine
    report_stats(view["e0"], healthy=False)
    assert pol.route(turn_of("e0"), view, 0.0) == "e1"  # unhealthy engine
    # kv-affinity is the default fallback: a balanced cluster keeps the session's engine
    assert pol.route(turn_of(None, last_engine="e0"), view_of(100, 0), 0.0) == "e0"
    assert (pol.hinted, pol.fell_back) == (0, 4)


def test_hinted_fallback_is_configurable() -> None:
    pol = ROUTING.create("hinted", fallback="round-robin")
    view = view_of(0, 0, 0)
    assert [pol.route(turn_of(None), view, 0.0) for _ in range(3)] == ["e0", "e1", "e2"]
    with pytest.raises(ValueError, match="itself"):
        ROUTING.create("hinted", fallback="hinted")


def test_turn_ready_sets_the_hint_before_release() -> None:
    ps = PolicySet.from_spec("eager+hinted")
    sched = Scheduler(ps, ["a", "b"])
    sched.open_session(0.0, "s")
    rec, actions = sched.turn_ready(0.0, "s", Turn(input_tokens=10, output_tokens=4),
                                    engine_hint="b")
    assert rec.engine_hint == "b"
    assert [(type(a), a.engine) for a in actions] == [(Release, "b")]
    sched.turn_finished(1.0, "s", 0, 4)
    rec2, actions = sched.turn_ready(2.0, "s", Turn(input_tokens=10, output_tokens=4))
    assert rec2.engine_hint is None and [a.engine for a in actions] == ["b"]  # kv-affinity
