"""Property tests of the core state machine, driven by a random fake driver."""

from __future__ import annotations

import random
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from turnstile.core import Release, Retain, Scheduler, TurnState
from turnstile.core.state import ClusterView, TurnRecord, WorkflowRecord
from turnstile.policies import PolicySet, all_policy_names
from turnstile.workload import ToolCall, Turn, Workflow


class RandomHoldRelease:
    """A test release policy that holds turns and releases a random subset on each call."""

    name = "random-hold"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.queue: list[TurnRecord] = []

    def add(self, turn: TurnRecord, now: float) -> None:
        self.queue.append(turn)

    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        keep: list[TurnRecord] = []
        out: list[TurnRecord] = []
        for t in self.queue:
            (keep if self.rng.random() < 0.5 else out).append(t)
        self.queue = keep
        yield from out

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        pass

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        pass

    def next_wakeup(self, now: float) -> float | None:
        return now + 1.0 if self.queue else None

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float | None:
        return None

    def hold_bound_s(self, now: float) -> float:
        return float("inf")  # a random hold has no bound

    def admission_order(self) -> None:
        return None

    def __len__(self) -> int:
        return len(self.queue)


@st.composite
def workflows(draw: st.DrawFn) -> list[Workflow]:
    n = draw(st.integers(1, 6))
    out = []
    for w in range(n):
        k = draw(st.integers(1, 5))
        dag = draw(st.booleans())
        turns = []
        for i in range(k):
            parents = None
            if dag and i > 0:
                parents = tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=i))))
            tools = (ToolCall("t", 1.0, "ok"),) if draw(st.booleans()) else ()
            turns.append(Turn(input_tokens=draw(st.integers(1, 50)), output_tokens=5,
                              tools=tools, parents=parents))
        out.append(Workflow(id=f"w{w}", arrival_s=float(w), turns=tuple(turns)))
    return out


def run_random(wfs: list[Workflow], policies: PolicySet, n_engines: int, seed: int) -> Scheduler:
    rng = random.Random(seed)
    done_ids: list[str] = []
    sched = Scheduler(policies, [f"e{i}" for i in range(n_engines)],
                      on_workflow_done=lambda wf: done_ids.append(wf.id))
    released: dict[tuple[str, int], int] = {}
    in_flight: list[TurnRecord] = []  # released or running
    in_tool: list[TurnRecord] = []
    now = 0.0

    def apply(actions: list) -> None:
        for a in actions:
            if isinstance(a, Release):
                key = (a.turn.workflow_id, a.turn.index)
                released[key] = released.get(key, 0) + 1
                assert released[key] == 1, f"{key} released twice"
                rec = a.turn
                # order: every parent (or the previous turn) is DONE
                wf = rec.workflow
                for p in wf.source.parents_of(rec.index):
                    assert wf.turns[p].state == TurnState.DONE
                assert a.engine in sched.view
                in_flight.append(rec)
            else:
                assert isinstance(a, Retain)

    pending = sorted(wfs, key=lambda w: w.arrival_s)
    steps = 0
    while pending or in_flight or in_tool or sched.held_turns:
        steps += 1
        assert steps < 10_000, "driver did not converge"
        now += rng.random()
        choices = []
        if pending:
            choices.append("arrive")
        if in_flight:
            choices.append("progress")
        if in_tool:
            choices.append("tool")
        if sched.held_turns:
            choices.append("tick")
        c = rng.choice(choices)
        if c == "arrive":
            apply(sched.workflow_arrived(now, pending.pop(0)))
        elif c == "tick":
            apply(sched.tick(now))
        elif c == "progress":
            rec = in_flight[rng.randrange(len(in_flight))]
            if rec.state == TurnState.RELEASED and rng.random() < 0.5:
                sched.turn_started(now, rec.workflow_id, rec.index)
                continue
            in_flight.remove(rec)
            apply(sched.turn_finished(now, rec.workflow_id, rec.index))
            if rec.state == TurnState.TOOL:
                in_tool.append(rec)
        else:
            rec = in_tool.pop(rng.randrange(len(in_tool)))
            apply(sched.tool_finished(now, rec.workflow_id, rec.index))

    # none lost, every workflow ends
    total_turns = sum(len(w.turns) for w in wfs)
    assert len(released) == total_turns
    assert sorted(done_ids) == sorted(w.id for w in wfs)
    for wf in sched.workflows.values():
        assert wf.done
        assert all(t.state == TurnState.DONE for t in wf.turns)
        assert wf.finished_s >= max(t.finished_s for t in wf.turns)
    # counters return to zero
    assert sched.view.released_turns == 0 and sched.view.released_tokens == 0
    assert sched.view.ready_turns == 0
    for e in sched.view.values():
        assert e.outstanding_turns == 0 and e.outstanding_tokens == 0
        assert e.paused_context_tokens == 0 and not e.cached_sessions
    assert sched.active_workflows == 0
    return sched


@settings(max_examples=150, deadline=None)
@given(wfs=workflows(), n_engines=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_invariants_with_every_registered_baseline(wfs, n_engines, seed):
    names = all_policy_names()
    for routing in names["routing"]:
        run_random(wfs, PolicySet.from_spec(f"eager+{routing}"), n_engines, seed)


@settings(max_examples=150, deadline=None)
@given(wfs=workflows(), n_engines=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_invariants_with_a_holding_release_policy(wfs, n_engines, seed):
    ps = PolicySet.from_spec("eager")
    ps.release = RandomHoldRelease(seed)
    run_random(wfs, ps, n_engines, seed)
