"""Unannounced workflow ends: the simulator tells the policies only what the gateway knows.

A real session ends silently; the gateway closes it by its idle rule
(:mod:`turnstile.core.session_idle`). With ``session_idle_s`` the simulator does the same, so a
policy that is safe only because it hears of every end at once is caught in simulation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from turnstile.core.session_idle import idle_close_s, sweep_period_s
from turnstile.core.state import ClusterView, TurnRecord, WorkflowRecord
from turnstile.policies import PolicySet
from turnstile.policies.release import EagerRelease
from turnstile.sim.closed_loop import run_closed_loop
from turnstile.sim.cluster import ClusterSim, run_sim
from turnstile.sim.engine_group import EngineGroup
from turnstile.workload.model import ToolCall, Turn, Workflow

IDLE = 300.0


def _paged(count: int = 1) -> list[EngineGroup]:
    return [EngineGroup(gpu="H100", model="llama-3.1-8b", count=count)]


def _slots(slots: int = 4) -> list[EngineGroup]:
    return [EngineGroup(gpu="H100", model="llama-3.1-8b", count=1, kv_slots=slots,
                        slot_tokens=131_072, max_num_seqs=slots)]


def _session(i: int, arrival_s: float, last_tool_s: float = 0.0) -> Workflow:
    last = (ToolCall("t", last_tool_s, "ok"),) if last_tool_s else ()
    turns = (Turn(2_000, 50, 0, tools=(ToolCall("t", 1.0, "ok"),)),
             Turn(200, 50, 2_050, tools=last))
    return Workflow(f"s{i}", arrival_s, turns)


class _Ends(EagerRelease):
    """Eager, recording when it hears of each workflow's end."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[str, float] = {}

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        self.ends[workflow.id] = now


def _sim(wfs: list[Workflow], release: object, groups: list[EngineGroup],
         idle: float | None) -> ClusterSim:
    policies = dataclasses.replace(PolicySet.from_spec("eager"), release=release)
    return ClusterSim(wfs, policies, groups, session_idle_s=idle)


def test_announced_ends_reach_the_policy_when_the_last_turn_is_over():
    rel = _Ends()
    res = _sim([_session(0, 0.0)], rel, _paged(), None).run()
    (wf,) = res.workflows
    assert rel.ends["s0"] == pytest.approx(wf.turns[-1].finished_s)


def test_an_unannounced_end_reaches_the_policy_only_when_the_idle_rule_closes_it():
    rel = _Ends()
    sim = _sim([_session(0, 0.0)], rel, _paged(), IDLE)
    sim._arrivals = sim.workflows
    sim.run_until(200.0)
    assert sim.scheduler.active_workflows == 1  # its work is over; nobody told the policy
    assert rel.ends == {}
    assert len(sim.scheduler.release) == 0
    sim.run_until()
    assert sim.scheduler.active_workflows == 0
    (wf,) = sim.finished
    last = wf.turns[-1].finished_s
    assert last < 200.0
    # the session closes by the gateway's rule: idle for more than IDLE, at a sweep
    assert rel.ends["s0"] == pytest.approx(idle_close_s(last, IDLE))
    assert last + IDLE < rel.ends["s0"] <= last + IDLE + sweep_period_s(IDLE) + 1e-9
    # the record keeps the real end: flow time is not inflated by the idle wait
    assert wf.finished_s == pytest.approx(last)


def test_the_real_end_counts_the_last_tool_call_as_announced_ends_do():
    wfs = [_session(0, 0.0, last_tool_s=7.0)]
    told = run_sim(wfs, "eager", _paged(), session_idle_s=None).workflows[0]
    silent = run_sim(wfs, "eager", _paged(), session_idle_s=IDLE).workflows[0]
    assert silent.finished_s == pytest.approx(told.finished_s)
    assert silent.finished_s == pytest.approx(silent.turns[-1].finished_s + 7.0)


def test_metrics_of_a_policy_blind_to_ends_are_unchanged_and_the_run_ends():
    wfs = [_session(i, 3.0 * i) for i in range(12)]
    a = run_sim(wfs, "eager", _paged(2), session_idle_s=None)
    b = run_sim(wfs, "eager", _paged(2), session_idle_s=IDLE)
    assert [w.finished_s for w in sorted(a.workflows, key=lambda w: w.id)] == pytest.approx(
        [w.finished_s for w in sorted(b.workflows, key=lambda w: w.id)])
    assert b.makespan_s == pytest.approx(a.makespan_s)
    assert b.extra["clock_end_s"] > a.extra["clock_end_s"] + IDLE  # the idle closes ran


def test_a_closed_loop_worker_starts_its_next_session_when_its_work_ends_not_at_the_close():
    wfs = [_session(i, 0.0) for i in range(4)]
    res = run_closed_loop(wfs, 1, "eager", _paged(), think_s=1.0, session_idle_s=IDLE)
    by_id = {w.id: w for w in res.workflows}
    for prev, nxt in zip(("s0", "s1", "s2"), ("s1", "s2", "s3"), strict=True):
        assert by_id[nxt].arrival_s == pytest.approx(by_id[prev].finished_s + 1.0)


def test_idle_must_be_positive():
    with pytest.raises(ValueError, match="session_idle_s"):
        ClusterSim([], PolicySet.from_spec("eager"), _paged(), session_idle_s=0.0)


class _SlotGate(EagerRelease):
    """The stall class of issue 36: release a new session's turn only while some engine has a
    slot not held by a running or paused session (a resumed session goes to its own slot)."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[TurnRecord] = []

    def add(self, turn: TurnRecord, now: float) -> None:
        self._held.append(turn)

    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        keep: list[TurnRecord] = []
        for t in self._held:
            free = any(len(e.cached_sessions) + e.outstanding_turns < e.kv_slots
                       for e in view.values())
            if t.workflow.paused_engine is not None or free:
                yield t
            else:
                keep.append(t)
        self._held = keep

    def __len__(self) -> int:
        return len(self._held)


def _worst_hold(res: object) -> float:
    return max(t.released_s - t.ready_s for w in res.workflows for t in w.turns)  # type: ignore[attr-defined]


def test_unannounced_ends_expose_a_gate_that_counts_ended_sessions_as_holding_slots():
    # eight sessions, one at a time (each over long before the next arrives) on one engine of
    # four slots: the engine is idle whenever a session arrives
    wfs = [_session(i, 20.0 * i) for i in range(8)]
    told = _sim(wfs, _SlotGate(), _slots(4), None).run()
    assert _worst_hold(told) == 0.0  # told of every end, the gate never blocks
    silent = _sim(wfs, _SlotGate(), _slots(4), IDLE).run()
    # the fifth session waits on an idle engine until the first one idles out
    assert _worst_hold(silent) > IDLE - 5 * 20.0
    assert silent.makespan_s > told.makespan_s + 100.0
    # eager, blind to ends, does not stall either way
    assert _worst_hold(_sim(wfs, EagerRelease(), _slots(4), IDLE).run()) == 0.0
