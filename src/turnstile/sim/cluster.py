"""The simulator driver: workflows → scheduler core → engine models, on a virtual clock.

The driver feeds the core the same events the gateway does (arrivals, starts, first tokens,
finishes, tool returns, engine stats) and carries out its actions (release to an engine with a
priority, retain a session's KV during a tool call). It owns the only clock.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnstile.core.actions import Release
from turnstile.core.scheduler import Scheduler
from turnstile.core.state import EngineLoad, TurnRecord, TurnState, WorkflowRecord
from turnstile.policies import PolicySet
from turnstile.sim.engine import EngineModel, SimRequest
from turnstile.sim.engine_group import EngineGroup
from turnstile.sim.kernel import EventQueue
from turnstile.sim.perf import PerfModel
from turnstile.workload.model import Workflow

# event kinds (ints: cheap to compare)
_ARRIVE, _STEP_END, _TOOL_END, _KICK, _WAKE, _POOL = range(6)
_NEVER = float("inf")


@dataclass
class SimResult:
    """What one simulated run produced (the bench room turns it into metrics)."""

    policy: str
    workflows: list[WorkflowRecord]
    engine_stats: dict[str, dict[str, Any]]
    makespan_s: float
    wall_s: float
    iterations: int
    events: int
    num_gpus: int
    extra: dict[str, Any] = field(default_factory=dict)


class ClusterSim:
    """Runs one policy configuration over one workload on a simulated cluster."""

    def __init__(
        self,
        workflows: Sequence[Workflow],
        policies: PolicySet,
        groups: Sequence[EngineGroup],
        *,
        block_size: int = 16,
        hash_block_tokens: int = 0,
        on_progress: Callable[[int], None] | None = None,
        fast_forward: bool = True,
    ) -> None:
        """``fast_forward`` lets an engine run the decode iterations in which nothing observable
        happens as one event (:meth:`EngineModel.leap`); results are the same either way."""
        self.workflows = sorted(workflows, key=lambda w: w.arrival_s)
        self.policies = policies
        self.engines: list[EngineModel] = []
        loads: list[EngineLoad] = []
        self.num_gpus = 0
        self._block_size = block_size
        self._hash_block_tokens = hash_block_tokens
        # shared across engines: a session re-prefilled on another engine counts as recomputed
        self._session_marks: dict = {}
        self._by_id: dict[str, int] = {}
        #: per engine, the outcome and time of its one valid step end: a lazily planned leap
        #: that was recorded early ends sooner, and its planned event left in the heap is stale
        #: (compared by outcome and time, not by the event's tuple: compiled, tuples are
        #: values without identity)
        self._live: list[Any] = []
        self._live_t: list[float] = []
        #: host contention (engines of one group share a host: FittedPerf.host_contention):
        #: per engine its group, its factor per co-running engine, and whether it computes now
        self._host: list[int] = []
        self._host_c: list[float] = []
        self._computing: list[bool] = []
        perfs = [g.build_perf() for g in groups]
        self._contended = any(getattr(p, "host_contention", 0.0) > 0 and g.count > 1
                              for g, p in zip(groups, perfs, strict=True))
        # a leap runs many iterations at the time factor of its first: exact only while no
        # other engine's start or stop can change that factor, so contended runs step
        self._ff = fast_forward and not self._contended
        for g, perf in zip(groups, perfs, strict=True):
            for _ in range(g.count):
                loads.append(self._new_engine(g, perf))
        self.finished: list[WorkflowRecord] = []
        self.scheduler = Scheduler(
            policies, loads, on_workflow_done=self.finished.append, forget_finished=True
        )
        self.queue = EventQueue()
        self._busy = [False] * len(self.engines)
        self._kicked = [False] * len(self.engines)
        self._wake_at = -1.0
        self._on_progress = on_progress
        #: (engine, outcome) stepped by the current event, pushed once the event is done
        self._pending: tuple[int, Any] | None = None
        #: whether the current event called the scheduler (its next wakeup may have moved)
        self._touched = False
        self.iterations = 0
        self.events = 0
        self.now = 0.0
        #: elastic pool: per engine, its TP and when it retired (-1: has not)
        self._tps = [int(ld.tp) for ld in loads]
        self.retired_s = [-1.0] * len(self.engines)
        #: called with (engine id, TP, time) when a drained engine retires and frees its GPUs
        self.on_retire: Callable[[str, int, float], Any] | None = None
        self._done_reported = 0
        #: the run's own arrivals (sorted), read in order by run_until; see _run
        self._arrivals: Sequence[Workflow] = ()
        self._next_arrival = 0

    def _new_engine(self, g: EngineGroup, perf: PerfModel) -> EngineLoad:
        eid = f"e{len(self.engines)}"
        cfg = g.build_config(self._block_size, self._hash_block_tokens)
        engine = EngineModel(eid, cfg, perf, session_marks=self._session_marks)
        self.engines.append(engine)
        if len(self.engines) == 2:
            # lazy leaps pay off only where other engines' events would cut a leap: with one
            # engine every arrival reaches it, and planning ahead only adds a recording call
            for e in self.engines:
                e.lazy = self._ff
        elif len(self.engines) > 2:
            engine.lazy = self._ff
        self._live.append(None)
        self._live_t.append(-1.0)
        self._host.append(id(g))
        self._host_c.append(float(getattr(perf, "host_contention", 0.0)))
        self._computing.append(False)
        self._by_id[eid] = len(self.engines) - 1
        self.num_gpus += g.tp
        # relative speed: decode throughput scales with TP (heterogeneous routing); per-token
        # times at batch 1 for bucket routers
        tpot = perf.step_time(0, 1, 8192)
        prefill = perf.step_time(8192, 0, 0, 8192 * 8193 / 2) / 8192
        return EngineLoad(eid, g.scheduler_kv_tokens(cfg), weight=float(g.tp),
                          tp=g.tp, tpot_s=tpot, prefill_s_per_token=prefill,
                          kv_slots=cfg.kv_slots)

    # ------------------------------------------------------------- elastic pool
    def submit(self, workflows: Sequence[Workflow]) -> None:
        """More workflows, arriving at their ``arrival_s`` (not before the clock)."""
        for wf in workflows:
            self.queue.push(max(wf.arrival_s, self.now), _ARRIVE, wf)

    def add_engines(self, group: EngineGroup, at_s: float) -> list[str]:
        """``group.count`` engines join at ``at_s``: they take work from then on."""
        perf = group.build_perf()
        if getattr(perf, "host_contention", 0.0) > 0 and not self._contended:
            # leaps were planned without it; a contended run must step from the start
            raise ValueError("engines with host contention join only a run built with them")
        ids = []
        for _ in range(group.count):
            load = self._new_engine(group, perf)
            self._tps.append(group.tp)
            self._busy.append(False)
            self._kicked.append(False)
            self.retired_s.append(-1.0)
            self.queue.push(max(at_s, self.now), _POOL, ("join", load))
            ids.append(load.id)
        return ids

    def drain(self, engine_ids: Sequence[str]) -> None:
        """Route no new work to these engines; each retires once its running turns finish
        (trajectories paused on it move at their next turn)."""
        for eid in engine_ids:
            self.scheduler.drain_engine(self.now, eid)
            i = self._by_id[eid]
            if not self._busy[i] and not self.engines[i].has_work():
                self._retire(i, self.now)

    def gpus_in_use(self) -> int:
        """GPUs of the engines not retired (joining and draining ones included)."""
        return sum(tp for tp, r in zip(self._tps, self.retired_s, strict=True) if r < 0)

    def _retire(self, i: int, now: float) -> None:
        if self.retired_s[i] >= 0:
            return
        self.retired_s[i] = now
        if self.on_retire is not None:
            self.on_retire(self.engines[i].engine_id, self._tps[i], now)

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        # the loop allocates records, requests and outcomes by the million, almost none of them
        # in reference cycles: the cyclic collector's passes over the growing set of finished
        # records cost up to a fifth of the run and free next to nothing, so it pauses meanwhile
        gc_on = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if gc_on:
                gc.enable()

    def _run(self) -> SimResult:
        t0 = time.perf_counter()
        self._arrivals = self.workflows
        self._next_arrival = 0
        now = self.run_until()
        sched = self.scheduler
        lost = sched.active_workflows
        if lost:
            raise RuntimeError(
                f"simulation ended with {lost} unfinished workflows "
                f"({sched.held_turns} turns still held by the release policy)"
            )
        stats = {e.engine_id: e.stats() for e in self.engines}
        # the run ends at its last completion: a policy timer still pending after it (a
        # release policy's wakeup, PLAS's period) moves the clock but serves nobody, and every
        # rate (throughput, GPU-hours, $, J) divides by this
        last = max((w.finished_s for w in self.finished), default=-1.0)
        return SimResult(
            policy=self.policies.spec,
            workflows=self.finished,
            engine_stats=stats,
            makespan_s=last if last >= 0 else now,
            wall_s=time.perf_counter() - t0,
            iterations=self.iterations,
            events=self.events,
            num_gpus=self.num_gpus,
            extra={"clock_end_s": now},
        )

    def run_until(self, t_s: float = math.inf, stop: Callable[[], bool] | None = None) -> float:
        """Process events up to time ``t_s`` (or until ``stop()`` holds after an event);
        returns the clock."""
        q = self.queue
        # the run's arrivals are read from the sorted workflow list instead of the heap: pushed
        # first, an arrival would win every tie with a later event (priority 0, lowest sequence
        # number), so taking it whenever it is not later than the heap's top keeps the same
        # order (workflows given later through ``submit`` go through the heap)
        arrivals = self._arrivals
        n_arr = len(arrivals)
        a = self._next_arrival
        arr_t = arrivals[a].arrival_s if a < n_arr else _NEVER
        sched = self.scheduler
        engines = self.engines
        busy = self._busy
        progress = self._on_progress
        done_reported = self._done_reported
        now = self.now
        ff = self._ff
        clock = q.clock
        #: a step end due strictly before every queued event and arrival: handled next, without
        #: going through the heap (it would be popped next anyway)
        due: tuple[int, Any] | None = None
        due_t = 0.0
        live = self._live
        live_t = self._live_t
        payload: Any = None
        events = 0
        while True:
            if due is not None:
                if due_t > t_s:
                    break
                payload = due
                due = None
                now = due_t
                clock.t = now
                kind = _STEP_END
            elif q.peek_time_or(_NEVER) < arr_t:
                if q.peek_time_or(_NEVER) > t_s:
                    break
                t_pop, kind, payload = q.pop()
                if kind == _STEP_END and (
                    payload[1] is not live[payload[0]] or t_pop != live_t[payload[0]]
                ):
                    continue  # a planned leap's end, the leap recorded earlier (_settle)
                now = t_pop
            elif a < n_arr:
                if arr_t > t_s:
                    break
                now = arr_t
                clock.t = now
                kind = _ARRIVE
                payload = arrivals[a]
                a += 1
                arr_t = arrivals[a].arrival_s if a < n_arr else _NEVER
            else:
                break
            events += 1
            self.now = now  # callbacks (finished workflows, retiring engines) read the clock
            if kind == _STEP_END:
                i, outcome = payload
                engine = engines[i]
                if engine.lazy_out is outcome:  # its planned end: nothing reached it before
                    self.iterations += engine.fire(outcome)
                if outcome.first_token or outcome.finished:
                    self._apply_outcome(now, i, outcome)
                    self._touched = True
                    self._step(now, i)
                else:
                    nxt = q.peek_time_or(_NEVER)
                    if nxt > arr_t:
                        nxt = arr_t
                    if ff and engine.resume(outcome, now, nxt, arr_t):
                        # a leap cut short by an event that did not reach this engine goes on:
                        # the iterations a step and a leap would run (this event scheduled
                        # nothing else)
                        self.iterations += outcome.iterations
                        end = engine.lazy_end if engine.lazy_out is outcome else outcome.end_s
                        live_t[i] = end
                        if end < nxt:
                            due = payload
                            due_t = end
                        else:
                            q.push(end, _STEP_END, payload)
                    else:
                        self._step(now, i)
            elif kind == _ARRIVE:
                self._act(now, sched.workflow_arrived(now, payload))
                self._touched = True
            elif kind == _TOOL_END:
                rec: TurnRecord = payload
                wf = rec.workflow
                # after a chain's last turn nothing returns to the LLM: the session ends
                self._act(now, sched.tool_finished(
                    now, wf.id, rec.index,
                    session_end=wf.children is None and rec.index + 1 == len(wf.turns)))
                self._touched = True
            elif kind == _KICK:
                self._kicked[payload] = False
                if not busy[payload]:
                    self._step(now, payload)
            elif kind == _WAKE:
                if now >= self._wake_at:
                    self._wake_at = -1.0
                    self._act(now, sched.tick(now))
                self._touched = True
            else:  # _POOL: an engine joins
                self._act(now, sched.add_engine(now, payload[1]))
                self._touched = True
            if self._touched:
                # the wakeup depends only on the scheduler's state: unchanged unless called
                self._touched = False
                wake = sched.next_wakeup(now)
                if wake is not None and wake > now and (
                    self._wake_at < 0 or wake < self._wake_at
                ):
                    self._wake_at = wake
                    q.push(wake, _WAKE, None, priority=2)
            pending = self._pending
            if pending is not None:
                # pushed after the wakeup: it never ties with a _WAKE (other priority), and the
                # leap must see every event this one scheduled
                self._pending = None
                i, outcome = pending
                nxt = q.peek_time_or(_NEVER)
                if nxt > arr_t:
                    nxt = arr_t
                engine = engines[i]
                if outcome is None:  # a decode iteration, stepped with its leap
                    outcome = engine.step_and_leap(now, nxt, True, arr_t)
                    assert outcome is not None  # decoders run: the step is never idle
                    self.iterations += outcome.iterations
                    pending = (i, outcome)
                elif ff:
                    engine.leap(outcome, nxt, arr_t)
                    self.iterations += outcome.iterations - 1
                # a lazily planned leap's iterations are counted when recorded
                end = engine.lazy_end if engine.lazy_out is outcome else outcome.end_s
                live[i] = outcome
                live_t[i] = end
                if end < nxt:
                    due = pending
                    due_t = end
                else:
                    q.push(end, _STEP_END, pending)
            if progress is not None and len(self.finished) != done_reported:
                done_reported = len(self.finished)
                progress(done_reported)
            if stop is not None and stop():
                break
        if due is not None:  # stopped before it: back into the heap for the next call
            q.push(due_t, _STEP_END, due)
        if t_s != math.inf or stop is not None:
            # stopped early: the caller may read the engines, so planned leaps are recorded up
            # to the clock (the engines continue exactly from there on the next call)
            for i, engine in enumerate(engines):
                if engine.lazy_out is not None:
                    self._settle(i, now)
        self.events += events
        self._next_arrival = a
        self._done_reported = done_reported
        self.now = now
        if t_s != math.inf and now < t_s and (stop is None or not stop()):
            self.now = now = t_s
            clock.t = now
        return now

    # ------------------------------------------------------------ internals
    def _act(self, now: float, actions: list) -> None:
        for a in actions:
            i = self._by_id[a.engine]
            if self.engines[i].lazy_out is not None:
                self._settle(i, now)
            if type(a) is Release:
                rec = a.turn
                turn = rec.turn
                # positional (rid, session, prompt, output, priority, block hashes, arrival):
                # a third cheaper than keywords, once per turn
                req = SimRequest(rec, rec.workflow.id, turn.prompt_tokens, turn.output_tokens,
                                 a.priority, turn.block_hashes, now)
                self.engines[i].submit(req, now)
                if not self._busy[i] and not self._kicked[i]:
                    # step after every same-time release has landed (priority 1 > 0)
                    self._kicked[i] = True
                    self.queue.push(now, _KICK, i, priority=1)
            else:  # Retain
                self.engines[i].retain(a.turn.workflow.id, a.decision, now)

    def _settle(self, i: int, now: float) -> None:
        """Engine ``i`` is reached at ``now`` inside its planned leap: record the iterations
        starting before ``now`` (what cutting the leap at ``now`` records); the leap ends at
        the end of the last of them, and the engine steps there."""
        engine = self.engines[i]
        out = engine.lazy_out
        planned = engine.lazy_end
        self.iterations += engine.materialise(now)
        if out is not None and out.end_s != planned:
            payload = (i, out)
            self._live[i] = out
            self._live_t[i] = out.end_s
            self.queue.push(out.end_s, _STEP_END, payload)

    def _step(self, now: float, i: int) -> None:
        engine = self.engines[i]
        if self._ff and engine.decodes_only(now):
            # nothing to tell the scheduler: the iteration runs with its leap, once the event
            # is done (see run)
            self._busy[i] = True
            self._pending = (i, None)
            return
        if self._contended:
            engine.slowdown = self._host_slowdown(i)
        outcome = engine.step(now)
        if self._contended:
            self._computing[i] = outcome is not None and outcome.busy
        if outcome is None:
            self._busy[i] = False
            # reported through the core's API (the view is read-only to drivers)
            self._act(now, self.scheduler.engine_stats(now, engine.engine_id, queue_len=0,
                                                        running=0))
            self._touched = True
            if not self.scheduler.view[engine.engine_id].accepting:
                self._retire(i, now)  # a drained engine ran its last turn
            return
        self._busy[i] = True
        self.iterations += 1
        if outcome.started:
            sched = self.scheduler
            for req in outcome.started:
                rec = req.rid
                if rec.state == TurnState.RELEASED:
                    sched.turn_started(now, rec.workflow.id, rec.index)
            self._touched = True
        # at most one engine steps per event (a step end or a kick names one engine)
        self._pending = (i, outcome)

    def _host_slowdown(self, i: int) -> float:
        """Engine ``i``'s time factor for a step starting now: ``1 + c·k`` for the ``k`` other
        engines of its group computing a step meanwhile (O(engines); only contended runs)."""
        c = self._host_c[i]
        if not c:
            return 1.0
        host = self._host[i]
        k = sum(1 for j, h in enumerate(self._host)
                if j != i and h == host and self._computing[j])
        return 1.0 + c * k

    def _apply_outcome(self, now: float, i: int, outcome: Any) -> None:
        sched = self.scheduler
        for req in outcome.first_token:
            rec = req.rid
            sched.turn_first_token(now, rec.workflow.id, rec.index)
        for req in outcome.finished:
            rec = req.rid
            wf = rec.workflow
            self._act(now, sched.turn_finished(now, wf.id, rec.index, req.output_tokens,
                                                req.cached_tokens))
            if rec.state == TurnState.TOOL:
                delay = rec.turn.tool_duration_s
                nxt = rec.index + 1
                if wf.source is not None and nxt < len(wf.turns):
                    delay += wf.turns[nxt].turn.think_s
                self.queue.push(now + delay, _TOOL_END, rec)


def run_sim(
    workflows: Sequence[Workflow],
    spec: str,
    groups: Sequence[EngineGroup],
    **kw: Any,
) -> SimResult:
    """Convenience: build a fresh policy set from ``spec`` and run."""
    return ClusterSim(workflows, PolicySet.from_spec(spec), groups, **kw).run()
