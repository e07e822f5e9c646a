"""The default release policy where sessions end unannounced (a gateway's open sessions).

A gateway learns that a session ended only from the client or after ``session_idle_s``, so the
sessions paused in tool calls may be over. On slot-limited engines whose slots all hold such
sessions, a new session must not wait on idle engines (issue 36), and the hold bound must not
grow while the turns it bounds wait.
"""

from __future__ import annotations

from turnstile.core import Scheduler
from turnstile.core.actions import Release
from turnstile.core.state import EngineLoad
from turnstile.policies import PolicySet
from turnstile.policies.auto import AutoRelease
from turnstile.workload import Turn


def _slot_engines(n: int = 2, slots: int = 4) -> list[EngineLoad]:
    return [EngineLoad(f"e{i}", capacity_tokens=4 * 4096, kv_slots=slots,
                       prefill_s_per_token=1e-4) for i in range(n)]


def _one_turn(sched: Scheduler, now: float, sid: str) -> bool:
    """Open ``sid``, make its first turn ready; serve it at once if released. Returns whether
    it was released at once."""
    sched.open_session(now, sid)
    rec, actions = sched.turn_ready(now, sid, Turn(200, 8, 0))
    released = any(isinstance(a, Release) and a.turn is rec for a in actions)
    if released:
        sched.turn_started(now, sid, rec.index)
        sched.turn_finished(now + 0.01, sid, rec.index, 8)
    return released


def test_new_sessions_past_the_slots_go_at_once_on_idle_engines() -> None:
    sched = Scheduler(PolicySet.from_spec("auto"), _slot_engines())
    now = 0.0
    for i in range(10):  # ten sequential one-turn keyed sessions, none announced as ended
        assert _one_turn(sched, now, f"s{i}"), f"session {i + 1} was held on idle engines"
        now += 0.05
    assert sched.held_turns == 0


def test_the_hold_bound_does_not_grow_while_every_session_is_paused() -> None:
    sched = Scheduler(PolicySet.from_spec("auto"), _slot_engines())
    release = sched.release
    assert isinstance(release, AutoRelease)
    for i in range(8):  # as many sessions as slots: each served, then paused for good
        assert _one_turn(sched, 0.05 * i, f"s{i}")
    early = release.hold_bound_s(20.0)
    assert early < 20.0
    assert release.hold_bound_s(2000.0) == early  # paused sessions count at their pause
