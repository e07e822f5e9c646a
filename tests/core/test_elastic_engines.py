"""The core's elastic-pool and tool-return entry points: engines join and drain, ready turns
are held while no engine takes work, and a client's tool returns land on the previous turn."""

from __future__ import annotations

from turnstile.core import Release, Scheduler
from turnstile.core.state import EngineLoad
from turnstile.policies import PolicySet
from turnstile.workload import ToolCall, Turn, Workflow


def _sched(*engines: str) -> Scheduler:
    return Scheduler(PolicySet.from_spec("eager+least-loaded"), list(engines))


def _releases(actions: list) -> list[str]:
    return [a.engine for a in actions if isinstance(a, Release)]


def test_held_while_no_engine_accepts_then_released_to_a_joining_one() -> None:
    s = _sched("a")
    s.drain_engine(0.0, "a")
    wf = Workflow("w", 0.0, (Turn(10, 5),))
    assert _releases(s.workflow_arrived(0.0, wf)) == []
    assert s.held_turns == 1
    assert _releases(s.add_engine(1.0, EngineLoad("b", tp=2, tpot_s=0.01))) == ["b"]
    assert s.view["b"].tp == 2 and s.view["b"].bucket == "tp2"


def test_a_draining_engine_gets_no_new_work() -> None:
    s = _sched("a", "b")
    s.drain_engine(0.0, "a")
    for i in range(3):
        wf = Workflow(f"w{i}", 0.0, (Turn(10, 5),))
        assert _releases(s.workflow_arrived(0.0, wf)) == ["b"]


def test_tool_returns_are_recorded_on_the_previous_turn() -> None:
    s = _sched("a")
    s.open_session(0.0, "s")
    rec, _ = s.turn_ready(0.0, "s", Turn(10, 5))
    s.turn_finished(1.0, "s", 0, output_tokens=5)
    back = (ToolCall("search", 0.0, "timeout", 300),)
    s.turn_ready(2.0, "s", Turn(10, 5, context_tokens=15), tool_returns=back)
    assert rec.turn.tools == back
