"""The core API drivers use to continue state from elsewhere (a restarted gateway, other
gateway replicas) instead of writing records behind the scheduler's back."""

from __future__ import annotations

from turnstile.core import Release, Scheduler
from turnstile.core.state import EngineLoad
from turnstile.policies import PolicySet
from turnstile.policies.cvar import CvarRelease
from turnstile.workload import Turn, Workflow


def test_open_session_carries_arrival_service_and_residency() -> None:
    s = Scheduler(PolicySet.from_spec("eager+kv-affinity"), ["e0", "e1"])
    s.open_session(100.0, "a", arrival_s=40.0, attained_tokens=500, last_engine="e1")
    wf = s.workflows["a"]
    assert (wf.arrival_s, wf.attained_tokens, wf.last_engine) == (40.0, 500, "e1")
    rec, actions = s.turn_ready(100.0, "a", Turn(10, 5, 20), ready_s=90.0)
    assert rec.ready_s == 90.0 and rec.released_s == 100.0
    assert actions == [Release(rec, "e1", actions[0].priority)]  # where its KV is
    s.open_session(100.0, "b", last_engine="gone")  # an engine this scheduler does not know
    assert s.workflows["b"].last_engine is None


def test_session_moved_routes_the_next_turn_to_the_new_engine() -> None:
    s = Scheduler(PolicySet.from_spec("eager+kv-affinity"), ["e0", "e1"])
    s.open_session(0.0, "a")
    rec, actions = s.turn_ready(0.0, "a", Turn(10, 5))
    first = actions[0].engine
    s.turn_started(0.1, "a", rec.index)
    s.turn_finished(0.2, "a", rec.index, 5)
    other = "e1" if first == "e0" else "e0"
    s.session_moved("a", other, 1000)  # another replica served a turn there since
    _, actions = s.turn_ready(1.0, "a", Turn(10, 5, 15))
    assert actions[0].engine == other and s.workflows["a"].attained_tokens >= 1000


def test_peer_load_is_seen_by_policies_and_replaced_not_accumulated() -> None:
    s = Scheduler(PolicySet.from_spec("eager+least-loaded"), ["e0", "e1"])
    s.peer_load(0.0, {"e0": (5, 5000, 700)}, ready_turns=3)
    view = s.view
    assert (view["e0"].outstanding_turns, view["e0"].outstanding_tokens,
            view["e0"].paused_context_tokens) == (5, 5000, 700)
    assert (view.released_turns, view.released_tokens, view.ready_turns) == (5, 5000, 3)
    s.open_session(0.0, "a")
    _, actions = s.turn_ready(0.0, "a", Turn(10, 5))
    assert actions[0].engine == "e1"  # e0 is loaded by the other replicas
    own = s.own_load("e1")
    assert own[0] == 1 and own[1] == view["e1"].outstanding_tokens
    s.peer_load(1.0, {"e0": (1, 100, 0)}, ready_turns=0)  # a new report replaces the last
    assert (view["e0"].outstanding_turns, view["e0"].outstanding_tokens) == (1, 100)
    assert view.released_turns == 2 and view.ready_turns == 0
    assert s.own_load("e0") == (0, 0, 0, 0)


def test_sessions_other_replicas_keep_paused_fill_a_slot_engine() -> None:
    """On a llama.cpp engine shared by replicas, a session paused through another replica holds
    a slot: the view counts it in open sessions and free slots, and own_load reports only this
    replica's paused sessions."""
    s = Scheduler(PolicySet.from_spec("eager"), [EngineLoad("e0", 4096, kv_slots=2)])
    s.open_session(0.0, "a")
    rec, _ = s.turn_ready(0.0, "a", Turn(10, 5))
    s.turn_started(0.1, "a", rec.index)
    s.turn_finished(0.2, "a", rec.index, 5)  # "a" is paused here, holding one slot
    e0 = s.view["e0"]
    assert e0.open_sessions == 1 and e0.has_free_slot
    s.peer_load(0.3, {"e0": (0, 0, 300, 1)})  # one session paused through another replica
    assert e0.open_sessions == 2 and not e0.has_free_slot
    assert s.own_load("e0") == (0, 0, e0.paused_context_tokens - 300, 1)
    s.peer_load(0.4, {"e0": (0, 0, 0)})  # a replica that reports no sessions: none
    assert e0.peer_paused_sessions == 0 and e0.has_free_slot


def test_peer_observations_teach_the_policies_through_their_hooks() -> None:
    s = Scheduler(PolicySet.from_spec("cvar+kv-affinity+ttl"), ["e0"])
    for i in range(40):
        s.peer_observed(100.0 + i, flow_time_s=10.0 + i, tool_time_s=2.0)
    assert 35.0 < s.release.flow_q.q < 50.0  # the flow-time tail learned from peers
    assert s.retention.estimator.count("") == 40
    assert s.retention.estimator.quantile("", 0.9) == 2.0
    assert not s.workflows  # nothing of the peers' is tracked here


def test_cvar_budget_counts_what_other_replicas_released() -> None:
    """Gateway replicas share cvar's released-work budget: work other replicas report through
    ``peer_load`` fills it as this replica's own releases do."""
    def scheduler() -> Scheduler:
        ps = PolicySet.from_spec("cvar+least-loaded")
        ps.release = CvarRelease(budget_per_engine=5_000)
        return Scheduler(ps, ["e0"])

    wf = Workflow("a", 0.0, (Turn(input_tokens=1_000, output_tokens=10),))
    alone = scheduler()
    alone.peer_load(0.0, {"e0": (1, 100, 0)})  # the engine is busy, the budget nearly free
    assert [a.turn.workflow.id for a in alone.workflow_arrived(0.0, wf)] == ["a"]
    shared = scheduler()
    shared.peer_load(0.0, {"e0": (3, 4_800, 0)})  # other replicas filled the budget
    assert shared.view.peer_released_tokens == 4_800
    assert shared.workflow_arrived(0.0, wf) == [] and shared.held_turns == 1
    # the other replicas' turns finish: the held turn goes
    actions = shared.peer_load(1.0, {"e0": (1, 100, 0)})
    assert [a.turn.workflow.id for a in actions] == ["a"]
