"""Hand-made cases for the scheduler core."""

from __future__ import annotations

import pytest

from turnstile.core import Release, Retain, Scheduler, SchedulerError, TurnState
from turnstile.core.registry import UnknownNameError
from turnstile.policies import ROUTING, PolicySet, parse_policy_list
from turnstile.workload import ToolCall, Turn, Workflow


def chain(wf_id: str, n: int, tool_s: float = 2.0, arrival: float = 0.0) -> Workflow:
    turns = tuple(
        Turn(input_tokens=100, output_tokens=10, context_tokens=110 * i,
             tools=(ToolCall("Bash", tool_s, "ok"),) if i < n - 1 else ())
        for i in range(n)
    )
    return Workflow(id=wf_id, arrival_s=arrival, turns=turns)


def test_chain_walks_the_state_machine():
    s = Scheduler(PolicySet.from_spec("eager"), ["e0"])
    acts = s.workflow_arrived(0.0, chain("a", 2))
    assert [type(a) for a in acts] == [Release]
    rec = acts[0].turn
    assert rec.state == TurnState.RELEASED and rec.ready_s == 0.0 and rec.released_s == 0.0
    s.turn_started(0.5, "a", 0)
    assert rec.state == TurnState.RUNNING
    acts = s.turn_finished(1.0, "a", 0)
    # the turn has a tool call: TOOL state, a retention decision, nothing released
    assert rec.state == TurnState.TOOL
    assert [type(a) for a in acts] == [Retain]
    assert acts[0].decision.action == "lru"
    assert s.view["e0"].paused_context_tokens == 110
    acts = s.tool_finished(3.0, "a", 0)
    assert rec.state == TurnState.DONE
    assert [type(a) for a in acts] == [Release]
    assert acts[0].turn.index == 1 and acts[0].turn.ready_s == 3.0
    assert s.view["e0"].paused_context_tokens == 0
    s.turn_finished(4.0, "a", 1)
    wf = s.workflows["a"]
    assert wf.done and wf.finished_s == 4.0
    assert wf.attained_tokens == 100 + 10 + 210 + 10


def test_finish_before_release_is_an_error():
    s = Scheduler(PolicySet.from_spec("eager"), ["e0"])
    s.workflow_arrived(0.0, chain("a", 2))
    with pytest.raises(SchedulerError, match="a#1"):
        s.turn_finished(1.0, "a", 1)
    with pytest.raises(SchedulerError, match="unknown workflow"):
        s.turn_finished(1.0, "zzz", 0)
    with pytest.raises(SchedulerError, match="twice"):
        s.workflow_arrived(0.0, chain("a", 1))


def test_round_robin_and_least_loaded():
    rr = Scheduler(PolicySet.from_spec("round-robin"), ["e0", "e1"])
    engines = [rr.workflow_arrived(0.0, chain(f"w{i}", 1))[0].engine for i in range(4)]
    assert engines == ["e0", "e1", "e0", "e1"]
    ll = Scheduler(PolicySet.from_spec("least-loaded"), ["e0", "e1"])
    big = Workflow("big", 0.0, (Turn(input_tokens=5000, output_tokens=10),))
    assert ll.workflow_arrived(0.0, big)[0].engine == "e0"
    # e0 now carries 5000+ tokens: the next three small turns all go to e1
    smalls = [ll.workflow_arrived(0.0, chain(f"s{i}", 1))[0].engine for i in range(3)]
    assert smalls == ["e1", "e1", "e1"]


def test_unhealthy_engine_is_skipped():
    s = Scheduler(PolicySet.from_spec("round-robin"), ["e0", "e1"])
    s.engine_stats(0.0, "e0", healthy=False)
    assert {s.workflow_arrived(0.0, chain(f"w{i}", 1))[0].engine for i in range(3)} == {"e1"}


def test_open_session_gateway_style():
    s = Scheduler(PolicySet.from_spec("eager"), ["e0"])
    s.open_session(0.0, "sess")
    rec, acts = s.turn_ready(0.0, "sess", Turn(input_tokens=50, output_tokens=5))
    assert acts[0].turn is rec
    s.turn_finished(1.0, "sess", 0, output_tokens=7)
    assert rec.state == TurnState.TOOL and rec.output_tokens == 7
    with pytest.raises(SchedulerError, match="one turn at a time"):
        s.turn_ready(1.5, "sess", Turn(input_tokens=1, output_tokens=1))
        s.turn_ready(1.5, "sess", Turn(input_tokens=1, output_tokens=1))
    s.turn_finished(2.0, "sess", 1)
    s.close_session(5.0, "sess")
    assert s.workflows["sess"].finished_s == 5.0
    assert s.active_workflows == 0


def test_a_session_end_is_not_a_tool_latency():
    """The gateway learns a tool's latency when the next turn arrives; closing an idle session
    is not a tool return, and neither is the end of a known chain's last tool call."""
    s = Scheduler(PolicySet.from_spec("eager+ttl"), ["e0"])
    est = s.retention.estimator
    s.open_session(0.0, "sess")
    s.turn_ready(0.0, "sess", Turn(input_tokens=50, output_tokens=5))
    s.turn_finished(1.0, "sess", 0)
    s.turn_ready(1.3, "sess", Turn(input_tokens=5, output_tokens=5, context_tokens=55))
    assert est.quantile("", 1.0) == pytest.approx(0.3)  # learned from the next turn
    s.turn_finished(2.0, "sess", 1)
    s.close_session(60.0, "sess")  # 58 s idle: the gateway gave up waiting
    assert est.quantile("", 1.0) == pytest.approx(0.3)
    assert s.workflows["sess"].finished_s == 60.0

    known = Scheduler(PolicySet.from_spec("eager+ttl"), ["e0"])
    wf = Workflow("w", 0.0, (Turn(100, 10, tools=(ToolCall("Bash", 0.5),)),
                             Turn(10, 10, 120, tools=(ToolCall("Bash", 9.0),))))
    known.workflow_arrived(0.0, wf)
    known.turn_finished(1.0, "w", 0)
    known.tool_finished(1.5, "w", 0)
    known.turn_finished(2.0, "w", 1)
    known.tool_finished(11.0, "w", 1, session_end=True)  # the driver: nothing follows
    assert known.retention.estimator.quantile("Bash", 1.0) == pytest.approx(0.5)
    assert known.workflows["w"].done


def test_dag_turn_waits_for_all_parents():
    turns = (
        Turn(input_tokens=10, output_tokens=1),
        Turn(input_tokens=10, output_tokens=1, parents=()),  # a second root
        Turn(input_tokens=10, output_tokens=1, parents=(0, 1)),
    )
    s = Scheduler(PolicySet.from_spec("eager"), ["e0"])
    acts = s.workflow_arrived(0.0, Workflow("d", 0.0, turns))
    assert sorted(a.turn.index for a in acts) == [0, 1]
    assert s.turn_finished(1.0, "d", 0) == []
    acts = s.turn_finished(2.0, "d", 1)
    assert [a.turn.index for a in acts] == [2]


def test_policy_specs_and_registry_errors():
    ps = PolicySet.from_spec("eager+least-loaded")
    assert ps.routing.name == "least-loaded" and ps.retention.name == "lru"
    with pytest.raises(ValueError, match="valid names"):
        PolicySet.from_spec("nonsense")
    with pytest.raises(ValueError, match="two routing"):
        PolicySet.from_spec("round-robin+least-loaded")
    with pytest.raises(UnknownNameError, match="round-robin"):
        ROUTING.create("nope")
    assert parse_policy_list("eager, eager+least-loaded") == ["eager", "eager+least-loaded"]
    with pytest.raises(ValueError):
        parse_policy_list(" , ")


def test_the_view_policies_read_is_read_only():
    from turnstile.core.state import ClusterView, EngineLoad, charge, pause_session

    e0 = EngineLoad("e0")
    view = ClusterView([e0])
    for obj, name in ((e0, "outstanding_tokens"), (e0, "healthy"), (e0, "cached_sessions"),
                      (view, "released_turns"), (view, "ready_turns")):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(obj, name, 1)
    with pytest.raises(AttributeError):
        e0.cached_sessions.add("w")  # type: ignore[attr-defined]
    # the core's write path changes what the policies see
    charge(e0, 100)
    pause_session(e0, "w", 40)
    assert (e0.outstanding_turns, e0.outstanding_tokens, e0.paused_context_tokens) == (1, 100, 40)
    assert "w" in view["e0"].cached_sessions and len(e0.cached_sessions) == 1


def test_engines_added_to_the_view_are_seen_and_routed_to():
    from turnstile.core.state import ClusterView, EngineLoad, add_engine

    view = ClusterView([EngineLoad("e0")])
    add_engine(view, EngineLoad("e1", weight=2.0))
    assert view.ids == ("e0", "e1") and list(view) == ["e0", "e1"] and view["e1"].weight == 2.0
    with pytest.raises(ValueError, match="already registered"):
        add_engine(view, EngineLoad("e1"))
