"""The simulator's event loop: one short dispatcher and one handler per event kind.

:class:`EventLoop` is the loop of :class:`~turnstile.sim.cluster.ClusterSim`, which builds the
engines and the scheduler and carries out the scheduler's actions (``_act``), steps an engine
(``_step``), records a planned leap early (``_settle``) and reports a step's first tokens and
finishes (``_apply_outcome``). What the loop tracks of each engine is one
:class:`DriverEngine` record.

Event kinds: an arrival (a workflow), a step end (an engine's step and its leap), a tool call's
end (its turn record), a kick (an idle engine steps once every same-time release has landed), the
scheduler's wakeup, an engine joining the pool, and a session closed by the gateway's idle rule
(its last turn record; only where workflow ends are not announced).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from turnstile.core.scheduler import Scheduler
from turnstile.core.state import EngineLoad, TurnRecord, WorkflowRecord
from turnstile.sim.engine import EngineModel, StepOutcome
from turnstile.sim.kernel import EventQueue
from turnstile.workload.model import Workflow

__all__ = ["ARRIVE", "CLOSE", "KICK", "POOL", "STEP_END", "TOOL_END", "WAKE", "DriverEngine",
           "EventLoop", "StepEnd"]

# event kinds (ints: cheap to compare)
ARRIVE, STEP_END, TOOL_END, KICK, WAKE, POOL, CLOSE = range(7)
_NEVER = float("inf")


class DriverEngine:
    """The driver's record of one engine: the model and what the event loop tracks of it."""

    __slots__ = ("busy", "computing", "host", "host_c", "kicked", "live", "live_t", "model",
                 "retired_s", "tp")

    def __init__(self, model: EngineModel, tp: int, host: int, host_c: float) -> None:
        self.model = model
        self.tp = tp
        #: a step of it is under way (its end is queued or due), or it steps after this event
        self.busy = False
        #: a kick is queued: it steps once every same-time release has landed
        self.kicked = False
        #: its one valid step end, outcome and time: a lazily planned leap that was recorded
        #: early ends sooner, and its planned event left in the heap is stale (compared by
        #: outcome and time, not by the event's tuple: compiled, tuples are values without
        #: identity)
        self.live: StepOutcome | None = None
        self.live_t = -1.0
        #: host contention (engines of one group share a host: FittedPerf.host_contention): its
        #: group, its factor per co-running engine, and whether it computes now
        self.host = host
        self.host_c = host_c
        self.computing = False
        #: when it retired (-1: it has not)
        self.retired_s = -1.0


#: a step end's payload: the engine and the outcome whose end it is
StepEnd = tuple[DriverEngine, StepOutcome]


class EventLoop:
    """The driver's event loop (see the module docstring); the cluster fills in the state and
    the four operations on engines and scheduler."""

    queue: EventQueue
    scheduler: Scheduler
    finished: list[WorkflowRecord]
    now: float
    events: int
    iterations: int
    _recs: list[DriverEngine]
    _ff: bool
    _touched: bool
    _pending: tuple[DriverEngine, StepOutcome | None] | None
    _due: StepEnd | None
    _due_t: float
    _wake_at: float
    _arrivals: Sequence[Workflow]
    _next_arrival: int
    _arr_t: float
    _on_progress: Callable[[int], None] | None
    _done_reported: int
    #: whether the scheduler is told when a workflow's last turn is over (else: CLOSE events)
    _announce: bool

    def _act(self, now: float, actions: list) -> None:
        raise NotImplementedError

    def _step(self, now: float, e: DriverEngine) -> None:
        raise NotImplementedError

    def _settle(self, e: DriverEngine, now: float) -> None:
        raise NotImplementedError

    def _apply_outcome(self, now: float, outcome: StepOutcome) -> None:
        raise NotImplementedError

    def run_until(self, t_s: float = math.inf, stop: Callable[[], bool] | None = None) -> float:
        """Process events up to time ``t_s`` (or until ``stop()`` holds after an event);
        returns the clock.

        Each turn of the loop takes the next event and hands it to the handler of its kind
        (``_on_*``), then, when the event called the scheduler or asked for a step,
        :meth:`_after_event` re-arms the scheduler's wakeup and starts that step. The next event is
        the earliest of: the step end due before everything else (``_due``), the heap's top, and the
        run's next arrival. Arrivals are read from the sorted workflow list instead of the heap:
        pushed first, an arrival would win every tie with a later event (priority 0, lowest sequence
        number), so taking it whenever it is not later than the heap's top keeps the same order
        (workflows given later through ``submit`` go through the heap)."""
        q = self.queue
        peek = q.peek_time_or
        clock = q.clock
        arrivals = self._arrivals
        n_arr = len(arrivals)
        a = self._next_arrival
        self._arr_t = arrivals[a].arrival_s if a < n_arr else _NEVER
        progress = self._on_progress
        on_step_end, dispatch, after = self._on_step_end, self._dispatch, self._after_event
        now = self.now
        events = 0
        while True:
            due = self._due
            if due is not None:
                if self._due_t > t_s:
                    break
                self._due = None
                now = clock.t = self._due_t
                self.now = now  # callbacks (finished workflows, retiring engines) read it
                on_step_end(now, due)
            elif peek(_NEVER) < self._arr_t:
                if peek(_NEVER) > t_s:
                    break
                t_pop, kind, payload = q.pop()
                if kind == STEP_END:
                    e, outcome = payload
                    if outcome is not e.live or t_pop != e.live_t:
                        continue  # a planned leap's end, the leap recorded earlier (_settle)
                    now = self.now = t_pop
                    on_step_end(now, payload)
                else:
                    now = self.now = t_pop
                    dispatch(now, kind, payload)
            elif a < n_arr:
                if self._arr_t > t_s:
                    break
                now = self.now = clock.t = self._arr_t
                wf = arrivals[a]
                a = self._next_arrival = a + 1
                self._arr_t = arrivals[a].arrival_s if a < n_arr else _NEVER
                self._on_arrive(now, wf)
            else:
                break
            events += 1
            if self._touched or self._pending is not None:
                after(now)
            if progress is not None and len(self.finished) != self._done_reported:
                self._done_reported = len(self.finished)
                progress(self._done_reported)
            if stop is not None and stop():
                break
        self.events += events
        return self._stopped(now, t_s, stop)

    def _dispatch(self, now: float, kind: int, payload: Any) -> None:
        """Hand a queued event other than a step end to its handler."""
        if kind == KICK:
            self._on_kick(now, payload)
        elif kind == TOOL_END:
            self._on_tool_end(now, payload)
        elif kind == WAKE:
            self._on_wake(now)
        elif kind == ARRIVE:
            self._on_arrive(now, payload)
        elif kind == CLOSE:
            self._on_close(now, payload)
        else:  # POOL: an engine joins
            self._on_pool(now, payload)

    def _stopped(self, now: float, t_s: float, stop: Callable[[], bool] | None) -> float:
        """The loop stopped at ``now``: leave the driver ready for the next call."""
        q = self.queue
        if self._due is not None:  # stopped before it: back into the heap for the next call
            q.push(self._due_t, STEP_END, self._due)
            self._due = None
        # the clock moves on to t_s when nothing is due before it (and stop() did not hold)
        end = t_s if t_s != math.inf and now < t_s and (stop is None or not stop()) else now
        if t_s != math.inf or stop is not None:
            # stopped early: the caller may read the engines, so planned leaps are recorded up
            # to the clock (the engines continue exactly from there on the next call). Up to
            # ``end``, not the last event: a leap cut at the last event would end before the
            # clock moved on, its step end then due in the past (a rollout step's
            # run_until(train_end, stop) raised "event scheduled in the past")
            for e in self._recs:
                if e.model.lazy_out is not None:
                    self._settle(e, end)
        if end != now:
            q.clock.t = end
        self.now = end
        return end

    # ------------------------------------------------------------- event handlers
    def _on_step_end(self, now: float, payload: StepEnd) -> None:
        """An engine's step (and its leap) ended: report its first tokens and finishes and step
        again; when it had none, let a leap that another event cut short go on instead."""
        e, outcome = payload
        engine = e.model
        if engine.lazy_out is outcome:  # its planned end: nothing reached it before
            self.iterations += engine.fire(outcome)
        if outcome.first_token or outcome.finished:
            self._apply_outcome(now, outcome)
            self._touched = True
            self._step(now, e)
        elif not (self._ff and self._resume(now, payload)):
            self._step(now, e)

    def _resume(self, now: float, payload: StepEnd) -> bool:
        """Continue the engine's decode run, when its leap stopped only for an event that did
        not reach it: the iterations a step and a leap would run (this event scheduled
        nothing else). False: it must step."""
        e, outcome = payload
        engine = e.model
        nxt = self.queue.peek_time_or(_NEVER)
        if nxt > self._arr_t:
            nxt = self._arr_t
        if not engine.resume(outcome, now, nxt, self._arr_t):
            return False
        self.iterations += outcome.iterations
        end = engine.lazy_end if engine.lazy_out is outcome else outcome.end_s
        e.live_t = end
        if end < nxt:  # due next: before every queued event and arrival
            self._due = payload
            self._due_t = end
        else:
            self.queue.push(end, STEP_END, payload)
        return True

    def _on_arrive(self, now: float, wf: Workflow) -> None:
        """A workflow arrives: the scheduler readies its first turns."""
        self._act(now, self.scheduler.workflow_arrived(now, wf, announce_end=self._announce))
        self._touched = True

    def _on_close(self, now: float, rec: TurnRecord) -> None:
        """The gateway's idle rule closes a session whose last turn is over (its end was not
        announced): the scheduler and its policies learn of the end only now."""
        self._act(now, self.scheduler.close_session(now, rec.workflow.id))
        self._touched = True

    def _on_tool_end(self, now: float, rec: TurnRecord) -> None:
        """A turn's tool call returned: its workflow's next turn becomes ready."""
        wf = rec.workflow
        # after a chain's last turn nothing returns to the LLM: the session ends
        self._act(now, self.scheduler.tool_finished(
            now, wf.id, rec.index,
            session_end=wf.children is None and rec.index + 1 == len(wf.turns)))
        self._touched = True

    def _on_kick(self, now: float, e: DriverEngine) -> None:
        """Same-time releases have landed on an idle engine: it steps."""
        e.kicked = False
        if not e.busy:
            self._step(now, e)

    def _on_wake(self, now: float) -> None:
        """The scheduler's wakeup (only the latest one armed counts)."""
        if now >= self._wake_at:
            self._wake_at = -1.0
            self._act(now, self.scheduler.tick(now))
        self._touched = True

    def _on_pool(self, now: float, payload: tuple[str, EngineLoad]) -> None:
        """An engine joins (``add_engines``)."""
        self._act(now, self.scheduler.add_engine(now, payload[1]))
        self._touched = True

    def _after_event(self, now: float) -> None:
        """Once an event is handled: the scheduler's next wakeup, if the event called it (the
        wakeup depends only on its state), then the step the event asked for, pushed after the
        wakeup: it never ties with a WAKE (other priority), and its leap must see every event
        this one scheduled."""
        if self._touched:
            self._touched = False
            wake = self.scheduler.next_wakeup(now)
            if wake is not None and wake > now and (
                self._wake_at < 0 or wake < self._wake_at
            ):
                self._wake_at = wake
                self.queue.push(wake, WAKE, None, priority=2)
        if self._pending is not None:
            self._start_pending(now)

    def _start_pending(self, now: float) -> None:
        """Run the pending engine's step with its leap up to the next event, and queue its
        end (or make it due, handled next without the heap)."""
        pending = self._pending
        assert pending is not None
        self._pending = None
        e, stepped = pending
        nxt = self.queue.peek_time_or(_NEVER)
        if nxt > self._arr_t:
            nxt = self._arr_t
        engine = e.model
        if stepped is None:  # a decode iteration, stepped with its leap
            outcome = engine.step_and_leap(now, nxt, True, self._arr_t)
            assert outcome is not None  # decoders run: the step is never idle
            self.iterations += outcome.iterations
        else:
            outcome = stepped
            if self._ff:
                engine.leap(outcome, nxt, self._arr_t)
                self.iterations += outcome.iterations - 1
        # a lazily planned leap's iterations are counted when recorded
        end = engine.lazy_end if engine.lazy_out is outcome else outcome.end_s
        e.live = outcome
        e.live_t = end
        if end < nxt:  # due next: before every queued event and arrival
            self._due = (e, outcome)
            self._due_t = end
        else:
            self.queue.push(end, STEP_END, (e, outcome))
