"""The simulator driver: workflows → scheduler core → engine models, on a virtual clock.

The driver feeds the core the same events the gateway does (arrivals, starts, first tokens,
finishes, tool returns, engine stats) and carries out its actions (release to an engine with a
priority, retain a session's KV during a tool call). It owns the only clock.

By default the core is told the moment a workflow's last turn is over. The gateway is not: a
real session ends silently, and the gateway closes it only once it has been idle for
``session_idle_s`` (:mod:`turnstile.core.session_idle`). With ``session_idle_s`` set, the driver
does the same: a workflow's last turn, once finished, stays paused (its KV retained, counted by
the policies as any paused session) and the workflow is closed by the gateway's idle rule. The
policies then see what the gateway would; the workflow's recorded finish (flow time, makespan)
stays the moment its work really ended, as the gateway's own flow metric records it.
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
from turnstile.core.session_idle import idle_close_s
from turnstile.core.state import EngineLoad, TurnState, WorkflowRecord
from turnstile.policies import PolicySet
from turnstile.sim.engine import EngineModel, SimRequest, StepOutcome
from turnstile.sim.engine_group import EngineGroup
from turnstile.sim.event_loop import (
    ARRIVE,
    CLOSE,
    KICK,
    POOL,
    STEP_END,
    TOOL_END,
    DriverEngine,
    EventLoop,
)
from turnstile.sim.kernel import EventQueue
from turnstile.sim.perf import PerfModel
from turnstile.workload.model import Workflow


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


class ClusterSim(EventLoop):
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
        session_idle_s: float | None = None,
    ) -> None:
        """``fast_forward`` lets an engine run the decode iterations in which nothing observable
        happens as one event (:meth:`EngineModel.leap`); results are the same either way.

        ``session_idle_s``: workflow ends are not announced; a workflow is closed by the
        gateway's idle rule this long after its last turn (see the module docstring). None: the
        core learns each end at once."""
        if session_idle_s is not None and not session_idle_s > 0:
            raise ValueError(f"session_idle_s must be > 0; got {session_idle_s}")
        self._idle_s = session_idle_s
        self._announce = session_idle_s is None
        #: workflow id → when its work really ended (unannounced ends only)
        self._true_end: dict[str, float] = {}
        #: called with (workflow record, time) when a workflow's work ends — what its client
        #: knows (the closed loop's next session starts from it), announced or not
        self.on_session_over: Callable[[WorkflowRecord, float], Any] | None = None
        self.workflows = sorted(workflows, key=lambda w: w.arrival_s)
        self.policies = policies
        #: the engine models, in id order (``e0``, ``e1``...), and the driver's record of each
        self.engines: list[EngineModel] = []
        self._recs = []
        self._by_id: dict[str, DriverEngine] = {}
        loads: list[EngineLoad] = []
        self.num_gpus = 0
        self._block_size = block_size
        self._hash_block_tokens = hash_block_tokens
        # shared across engines: a session re-prefilled on another engine counts as recomputed
        self._session_marks: dict = {}
        perfs = [g.build_perf() for g in groups]
        self._contended = any(getattr(p, "host_contention", 0.0) > 0 and g.count > 1
                              for g, p in zip(groups, perfs, strict=True))
        # a leap runs many iterations at the time factor of its first: exact only while no
        # other engine's start or stop can change that factor, so contended runs step
        self._ff = fast_forward and not self._contended
        for g, perf in zip(groups, perfs, strict=True):
            for _ in range(g.count):
                loads.append(self._new_engine(g, perf))
        self.finished = []
        self.scheduler = Scheduler(
            policies, loads, on_workflow_done=self._workflow_done, forget_finished=True
        )
        self.queue = EventQueue()
        self._wake_at = -1.0
        self._on_progress = on_progress
        #: the engine stepped by the current event and its outcome (None: a decode iteration,
        #: stepped with its leap), started once the event is done (:meth:`_start_pending`)
        self._pending = None
        #: whether the current event called the scheduler (its next wakeup may have moved)
        self._touched = False
        #: a step end due strictly before every queued event and arrival: handled next, without
        #: going through the heap (it would be popped next anyway)
        self._due = None
        self._due_t = 0.0
        self.iterations = 0
        self.events = 0
        self.now = 0.0
        #: called with (engine id, TP, time) when a drained engine retires and frees its GPUs
        self.on_retire: Callable[[str, int, float], Any] | None = None
        self._done_reported = 0
        #: the run's own arrivals (sorted), read in order by run_until (see there), the next
        #: one's index and time
        self._arrivals = ()
        self._next_arrival = 0
        self._arr_t = math.inf

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
        rec = DriverEngine(engine, g.tp, id(g), float(getattr(perf, "host_contention", 0.0)))
        self._recs.append(rec)
        self._by_id[eid] = rec
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
            self.queue.push(max(wf.arrival_s, self.now), ARRIVE, wf)

    def add_engines(self, group: EngineGroup, at_s: float) -> list[str]:
        """``group.count`` engines join at ``at_s``: they take work from then on."""
        perf = group.build_perf()
        if getattr(perf, "host_contention", 0.0) > 0 and not self._contended:
            # leaps were planned without it; a contended run must step from the start
            raise ValueError("engines with host contention join only a run built with them")
        ids = []
        for _ in range(group.count):
            load = self._new_engine(group, perf)
            self.queue.push(max(at_s, self.now), POOL, ("join", load))
            ids.append(load.id)
        return ids

    def drain(self, engine_ids: Sequence[str]) -> None:
        """Route no new work to these engines; each retires once its running turns finish
        (trajectories paused on it move at their next turn)."""
        for eid in engine_ids:
            self.scheduler.drain_engine(self.now, eid)
            e = self._by_id[eid]
            if not e.busy and not e.model.has_work():
                self._retire(e, self.now)

    @property
    def tps(self) -> list[int]:
        """Each engine's TP (its GPUs), in engine order."""
        return [e.tp for e in self._recs]

    @property
    def retired_s(self) -> list[float]:
        """When each engine retired (-1: it has not), in engine order."""
        return [e.retired_s for e in self._recs]

    def gpus_in_use(self) -> int:
        """GPUs of the engines not retired (joining and draining ones included)."""
        return sum(e.tp for e in self._recs if e.retired_s < 0)

    def _retire(self, e: DriverEngine, now: float) -> None:
        if e.retired_s >= 0:
            return
        e.retired_s = now
        if self.on_retire is not None:
            self.on_retire(e.model.engine_id, e.tp, now)

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

    # ------------------------------------------------------------ internals
    def _workflow_done(self, wf: WorkflowRecord) -> None:
        """The scheduler finished a workflow (announced, or closed by the idle rule)."""
        end = self._true_end.pop(wf.id, None)
        if end is not None:
            wf.finished_s = end  # the policies saw the close; the record keeps the real end
        elif self.on_session_over is not None:
            self.on_session_over(wf, self.now)
        self.finished.append(wf)

    def _last_turn_over(self, now: float, rec: Any, end: float) -> None:
        """Unannounced ends: the workflow's last turn finished at ``now`` and its work ends at
        ``end`` (its last tool returned); the idle rule closes it later."""
        wf = rec.workflow
        self._true_end[wf.id] = end
        assert self._idle_s is not None
        self.queue.push(idle_close_s(now, self._idle_s), CLOSE, rec)
        if self.on_session_over is not None:
            self.on_session_over(wf, end)

    def _act(self, now: float, actions: list) -> None:
        for a in actions:
            e = self._by_id[a.engine]
            engine = e.model
            if engine.lazy_out is not None:
                self._settle(e, now)
            if type(a) is Release:
                rec = a.turn
                turn = rec.turn
                # positional (rid, session, prompt, output, priority, block hashes, arrival):
                # a third cheaper than keywords, once per turn
                req = SimRequest(rec, rec.workflow.id, turn.prompt_tokens, turn.output_tokens,
                                 a.priority, turn.block_hashes, now)
                engine.submit(req, now)
                if not e.busy and not e.kicked:
                    # step after every same-time release has landed (priority 1 > 0)
                    e.kicked = True
                    self.queue.push(now, KICK, e, priority=1)
            else:  # Retain
                engine.retain(a.turn.workflow.id, a.decision, now)

    def _settle(self, e: DriverEngine, now: float) -> None:
        """Engine ``e`` is reached at ``now`` inside its planned leap: record the iterations
        starting before ``now`` (what cutting the leap at ``now`` records); the leap ends at
        the end of the last of them, and the engine steps there."""
        engine = e.model
        out = engine.lazy_out
        planned = engine.lazy_end
        self.iterations += engine.materialise(now)
        if out is not None and out.end_s != planned:
            e.live = out
            e.live_t = out.end_s
            self.queue.push(out.end_s, STEP_END, (e, out))

    def _step(self, now: float, e: DriverEngine) -> None:
        engine = e.model
        if self._ff and engine.decodes_only(now):
            # nothing to tell the scheduler: the iteration runs with its leap, once the event
            # is done (see _after_event)
            e.busy = True
            self._pending = (e, None)
            return
        if self._contended:
            engine.slowdown = self._host_slowdown(e)
        outcome = engine.step(now)
        if self._contended:
            e.computing = outcome is not None and outcome.busy
        if outcome is None:
            e.busy = False
            # reported through the core's API (the view is read-only to drivers)
            self._act(now, self.scheduler.engine_stats(now, engine.engine_id, queue_len=0,
                                                        running=0))
            self._touched = True
            if not self.scheduler.view[engine.engine_id].accepting:
                self._retire(e, now)  # a drained engine ran its last turn
            return
        e.busy = True
        self.iterations += 1
        if outcome.started:
            sched = self.scheduler
            for req in outcome.started:
                rec = req.rid
                if rec.state == TurnState.RELEASED:
                    sched.turn_started(now, rec.workflow.id, rec.index)
            self._touched = True
        # at most one engine steps per event (a step end or a kick names one engine)
        self._pending = (e, outcome)

    def _host_slowdown(self, e: DriverEngine) -> float:
        """Engine ``e``'s time factor for a step starting now: ``1 + c·k`` for the ``k`` other
        engines of its group computing a step meanwhile (O(engines); only contended runs)."""
        c = e.host_c
        if not c:
            return 1.0
        host = e.host
        k = sum(1 for o in self._recs if o is not e and o.host == host and o.computing)
        return 1.0 + c * k

    def _apply_outcome(self, now: float, outcome: StepOutcome) -> None:
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
                if not self._announce and wf.remaining == 1 and wf.source is not None:
                    # its last turn, and the end is not announced
                    self._last_turn_over(now, rec, now + delay)
                    continue
                nxt = rec.index + 1
                if wf.source is not None and nxt < len(wf.turns):
                    delay += wf.turns[nxt].turn.think_s
                self.queue.push(now + delay, TOOL_END, rec)


def run_sim(
    workflows: Sequence[Workflow],
    spec: str,
    groups: Sequence[EngineGroup],
    **kw: Any,
) -> SimResult:
    """Convenience: build a fresh policy set from ``spec`` and run."""
    return ClusterSim(workflows, PolicySet.from_spec(spec), groups, **kw).run()
