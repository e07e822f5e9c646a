"""Decision rules of the release policies, pinned on hand-made cases."""

from __future__ import annotations

from turnstile.core import Release, Scheduler, TurnState
from turnstile.core.state import EngineLoad, WorkflowRecord
from turnstile.policies import PolicySet
from turnstile.policies.cvar import CvarRelease
from turnstile.policies.gated import PlasRelease
from turnstile.workload import ToolCall, Turn, Workflow


def one_turn(wf_id: str, tokens: int, out: int = 10, arrival: float = 0.0) -> Workflow:
    return Workflow(wf_id, arrival, (Turn(input_tokens=tokens, output_tokens=out),))


def released(actions) -> list[str]:
    return [a.turn.workflow_id for a in actions if isinstance(a, Release)]


def cvar_scheduler(budget_per_engine: float, engines: int = 1, **kw) -> Scheduler:
    ps = PolicySet.from_spec("cvar")
    ps.release = CvarRelease(budget_per_engine=budget_per_engine, budget="fixed", gate="fixed",
                             **kw)
    return Scheduler(ps, [f"e{i}" for i in range(engines)])


def test_cvar_holds_when_budget_full_and_releases_when_engine_idles():
    # γ·prior output = 8·256 = 2048 token-equivalents of decode per turn
    s = cvar_scheduler(budget_per_engine=5_000)
    assert released(s.workflow_arrived(0.0, one_turn("a", 2_000))) == ["a"]  # W = 4048
    # b would push W to 8096 > 5000: held, although it is ready
    assert released(s.workflow_arrived(0.1, one_turn("b", 2_000))) == []
    assert s.held_turns == 1
    assert s.workflows["b"].turns[0].state == TurnState.READY
    # a finishes: W drops to 0, the engine idles, b goes
    assert released(s.turn_finished(1.0, "a", 0)) == ["b"]


def test_cvar_releases_an_oversized_turn_to_an_idle_engine():
    s = cvar_scheduler(budget_per_engine=1_000)
    assert released(s.workflow_arrived(0.0, one_turn("huge", 50_000))) == ["huge"]


def two_turns(wf_id: str, second_tokens: int, arrival: float = 0.0) -> Workflow:
    """A workflow whose second turn (after a tool call) has ``second_tokens`` of new input."""
    return Workflow(wf_id, arrival, (
        Turn(input_tokens=10, output_tokens=1, tools=(ToolCall("Bash", 1.0),)),
        Turn(input_tokens=second_tokens, output_tokens=10, context_tokens=11),
    ))


def start(s: Scheduler, wf: Workflow, now: float) -> None:
    """Arrive and run the first turn, so the workflow counts as started."""
    s.workflow_arrived(now, wf)
    s.turn_finished(now, wf.id, 0, output_tokens=1)


def test_cvar_orders_started_workflows_by_shortest_work():
    # γ = 0: work = new input + 0.1·context, so the arithmetic below is exact
    s = cvar_scheduler(budget_per_engine=900, gamma=0.0)
    for name in ("big", "small", "mid"):
        start(s, two_turns(name, {"big": 800, "small": 10, "mid": 300}[name]), 0.0)
    s.workflow_arrived(0.5, one_turn("first", 900))  # new workflow; engine idle: released
    for name in ("big", "small", "mid"):
        assert released(s.tool_finished(1.0, name, 0)) == []  # held: budget full
    # first done, W = 0: small (11.1) and mid (301.1) fit in 900; big (801.1) waits for both
    assert released(s.turn_finished(2.0, "first", 0)) == ["small", "mid"]
    assert released(s.turn_finished(3.0, "small", 1)) == []
    assert released(s.turn_finished(4.0, "mid", 1)) == ["big"]


def test_cvar_admits_new_workflows_oldest_first_while_kv_has_room():
    ps = PolicySet.from_spec("cvar")
    ps.release = CvarRelease(budget_per_engine=1e9, budget="fixed", gate="fixed", kv_fill=1.0)
    s = Scheduler(ps, [EngineLoad("e0", capacity_tokens=10_000)])
    assert released(s.workflow_arrived(0.0, one_turn("a", 6_000))) == ["a"]
    # 6000 + expected output released on e0: 'b' (5000 tokens) does not fit in 10k
    assert released(s.workflow_arrived(1.0, one_turn("b", 5_000))) == []
    assert released(s.workflow_arrived(2.0, one_turn("c", 100))) == []  # FCFS: behind b
    assert released(s.turn_finished(3.0, "a", 0)) == ["b", "c"]


def paused_sessions(s: Scheduler, names: list[str]) -> None:
    """Start each workflow and leave it paused in a tool call (its KV on the engine)."""
    for name in names:
        s.workflow_arrived(0.0, two_turns(name, 10))
        s.turn_finished(0.0, name, 0, output_tokens=1)
    for name in names:
        assert s.workflows[name].paused_engine is not None


def slot_engine_scheduler(kv_slots: int) -> Scheduler:
    ps = PolicySet.from_spec("cvar")
    # a tiny KV fill: the token gate never has room, only the idle override can admit
    ps.release = CvarRelease(budget_per_engine=1e9, budget="fixed", gate="fixed", kv_fill=0.001,
                             min_kv_fill=0.001)
    return Scheduler(ps, [EngineLoad("e0", capacity_tokens=10_000, kv_slots=kv_slots)])


def test_cvar_idle_override_starts_no_session_onto_full_slots():
    # a llama.cpp engine with 2 slots, both held by sessions paused in tool calls: the engine
    # is idle, but a new session would evict one of them
    s = slot_engine_scheduler(kv_slots=2)
    paused_sessions(s, ["p1", "p2"])
    e0 = s.view["e0"]
    assert e0.outstanding_turns == 0 and e0.open_sessions == 2 and not e0.has_free_slot
    assert s.view.any_idle() and not s.release.idle_with_free_slot(s.view, now=1.0)
    assert released(s.workflow_arrived(1.0, one_turn("new", 100))) == []
    assert s.held_turns == 1
    # p1 comes back from its tool and finishes: its slot is free again, the newcomer starts
    assert released(s.tool_finished(2.0, "p1", 0)) == ["p1"]
    assert released(s.turn_finished(3.0, "p1", 1)) == ["new"]


def test_cvar_idle_override_admits_when_a_slot_is_free_or_kv_is_not_slot_limited():
    s = slot_engine_scheduler(kv_slots=3)  # one slot still free
    paused_sessions(s, ["p1", "p2"])
    assert s.view["e0"].has_free_slot
    assert released(s.workflow_arrived(1.0, one_turn("new", 100))) == ["new"]
    # paged KV (kv_slots 0): the override admits onto the idle engine as before
    s = slot_engine_scheduler(kv_slots=0)
    paused_sessions(s, ["p1", "p2", "p3"])
    assert s.view["e0"].has_free_slot and s.release.idle_with_free_slot(s.view, now=1.0)
    assert released(s.workflow_arrived(1.0, one_turn("new", 100))) == ["new"]


def test_cvar_takes_a_session_paused_longer_than_any_seen_as_done() -> None:
    # 2 slots held by sessions paused since t=0; pauses seen so far all took 1 s
    s = slot_engine_scheduler(kv_slots=2)
    s.release.min_pause_samples = 3
    paused_sessions(s, ["p1", "p2"])
    rel = s.release
    assert rel.done_pause_s() == float("inf")  # too few pauses seen: nobody is taken as done
    for x in (0.8, 1.0, 0.9):
        rel._pauses.add(x)
    assert rel.done_pause_s() == 1.0
    assert not rel.idle_with_free_slot(s.view, now=0.5)  # both sessions may still come back
    assert released(s.workflow_arrived(0.5, one_turn("early", 100))) == []
    # the scheduler is woken when the first paused session passes the longest pause seen
    assert s.next_wakeup(0.5) == 1.0
    # ... on an engine the override could use: a down engine wakes nobody
    s.engine_stats(0.5, "e0", healthy=False)
    assert s.next_wakeup(0.5) > 1.2 and not rel.idle_with_free_slot(s.view, now=1.2)
    s.engine_stats(0.5, "e0", healthy=True)
    # past it, both have been paused longer than any pause seen: their slots count as free
    assert rel.idle_with_free_slot(s.view, now=1.2)
    assert released(s.tick(1.2)) == ["early"]
    # a session that comes back teaches its pause
    s.tool_finished(3.0, "p1", 0)
    assert len(rel._pauses) == 4 and rel.done_pause_s() == 3.0


def test_cvar_tail_weight_switches_on_past_the_quantile():
    rel = CvarRelease(alpha=0.95, budget="fixed", gate="fixed")
    rel.flow_q.q = 100.0  # pretend the online P95 of flow time is 100 s
    wf_old = WorkflowRecord("old", 0.0, "default", None)
    wf_new = WorkflowRecord("new", 50.0, "default", None)
    assert not rel.is_tail(wf_old, now=99.0)
    assert rel.is_tail(wf_old, now=101.0)
    assert not rel.is_tail(wf_new, now=101.0)
    # a tail turn with 10x the work still outranks a mean turn (weight 1 + 1/(1-α) = 21)
    s = cvar_scheduler(budget_per_engine=2_100)
    s.release.flow_q.q = 100.0
    s.workflow_arrived(0.0, one_turn("blocker", 10))
    s.workflow_arrived(0.0, one_turn("old", 10_000, arrival=0.0))
    s.workflow_arrived(95.0, one_turn("young", 1_000, arrival=95.0))
    # at t=101 'old' (age 101 > q) is tail, 'young' is not: old first despite larger work
    acts = s.turn_finished(101.0, "blocker", 0)
    assert released(acts)[0] == "old"


def test_cvar_releases_anything_held_longer_than_h():
    s = cvar_scheduler(budget_per_engine=15, gamma=0.0, hold_limit_s=30.0,
                       gate_hold_limit_s=50.0)
    start(s, two_turns("b", 10), 0.0)
    s.workflow_arrived(0.0, one_turn("a", 10))  # released (engine idle), fills the budget
    assert released(s.tool_finished(1.0, "b", 0)) == []  # b's second turn: held
    assert released(s.workflow_arrived(1.0, one_turn("new", 10))) == []  # at the gate
    assert s.next_wakeup(1.0) == 31.0
    assert released(s.tick(31.0)) == ["b"]
    assert s.next_wakeup(31.0) == 51.0  # new workflows wait at most the gate limit
    assert released(s.tick(51.0)) == ["new"]


def test_cvar_learns_output_length_online_never_from_the_trace():
    s = cvar_scheduler(budget_per_engine=1e9)
    turns = tuple(Turn(input_tokens=10, output_tokens=999, tools=(ToolCall("Bash", 1.0),))
                  for _ in range(4))
    s.workflow_arrived(0.0, Workflow("w", 0.0, turns))
    est = s.release.outputs
    rec = s.workflows["w"].turns[0]
    assert est.expect(rec) == 256.0  # the prior, not the trace's 999
    s.turn_finished(1.0, "w", 0, output_tokens=40)
    s.tool_finished(2.0, "w", 0)
    s.turn_finished(3.0, "w", 1, output_tokens=60)
    assert est.expect(s.workflows["w"].turns[2]) == 50.0  # the workflow's own mean


def test_cvar_budget_shrinks_under_engine_queueing_and_grows_when_clear():
    rel = CvarRelease(budget_per_engine=20_000, target_wait_s=0.5, target_p95_wait_s=2.0)
    rel._waits.extend([3.0] * 16)
    rel._adapt()
    assert rel.budget_per_engine == 16_000
    rel._waits.clear()
    rel._waits.extend([0.01] * 16)
    rel._n = 1  # turns are held
    rel._adapt()
    assert rel.budget_per_engine == 17_600


def test_plas_levels_and_engine_priority():
    p = PlasRelease(thresholds=(100, 1_000))
    assert [p.level(x) for x in (0, 99, 100, 999, 1_000, 10**9)] == [0, 0, 1, 1, 2, 2]
    ps = PolicySet.from_spec("plas")
    assert ps.admission is ps.release  # PLAS orders the engine queue too
    ps.release.max_inflight_per_engine = 1
    s = Scheduler(ps, ["e0"])
    long_turns = tuple(Turn(input_tokens=5_000, output_tokens=10) for _ in range(3))
    s.workflow_arrived(0.0, Workflow("long", 0.0, long_turns))  # released (idle engine)
    s.turn_finished(1.0, "long", 0)  # long attained 5010 tokens: level 1; its turn 1 released
    s.workflow_arrived(1.5, one_turn("short", 50, arrival=1.5))  # level 0, held (cap 1)
    acts = s.turn_finished(2.0, "long", 1)
    # short (level 0, arrived later) goes before long's turn 2 (level 1)
    assert released(acts) == ["short"]
    assert acts[0].priority == 0.0


def test_cvar_kv_gate_shrinks_when_sessions_lose_their_cache_and_grows_when_kept():
    rel = CvarRelease(kv_fill=0.5, target_context_miss=0.05)
    rel._waits.extend([0.01] * 16)
    rel._miss = [50.0, 100.0]  # half the reused context was recomputed
    rel._adapt()
    assert rel.kv_fill == 0.45
    rel._miss = [1.0, 100.0]
    rel._gate.append((0, None))  # new workflows are waiting at the gate
    rel._adapt()
    assert rel.kv_fill == 0.45 * 1.05
