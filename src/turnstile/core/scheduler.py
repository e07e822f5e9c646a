"""The scheduler core: the turn state machine, driven by events, asking policies for decisions.

    PENDING ──parents done──► READY ──release policy──► RELEASED ──engine──► RUNNING
                                                                              │
                      DONE ◄──tool returns── TOOL ◄──finished, has tools──────┤
                       ▲                                                      │
                       └──────────────finished, no tools──────────────────────┘

The core never reads a clock: every event carries its time, supplied by the driver (the
simulator's virtual clock or the gateway's wall clock). Each event method returns the actions
the driver must carry out (:class:`Release`, :class:`Retain`). Both drivers call the same
methods with the same policy objects; that is what makes "simulate, then deploy" true.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from turnstile.core.actions import Action, Release, Retain
from turnstile.core.errors import SchedulerError
from turnstile.core.interfaces import PolicyBundle
from turnstile.core.state import (
    ClusterView,
    EngineLoad,
    TurnRecord,
    TurnState,
    WorkflowRecord,
    add_engine,
    add_peer_load,
    charge,
    count_peer_released,
    count_ready,
    count_released,
    discharge,
    pause_session,
    report_stats,
    resume_session,
    set_accepting,
)
from turnstile.workload.model import ToolCall, Turn, Workflow

_NO_ACTIONS: list[Action] = []


class Scheduler:
    """Turn state machine plus policy calls. One instance per driver run.

    ``on_workflow_done`` is called once per finished workflow (for streaming metrics); with
    ``forget_finished`` the records are then dropped so memory stays bounded on long runs.
    """

    def __init__(
        self,
        policies: PolicyBundle,
        engines: Sequence[EngineLoad | str],
        *,
        on_workflow_done: Callable[[WorkflowRecord], None] | None = None,
        forget_finished: bool = False,
        prior_output_tokens: float = 256.0,
    ) -> None:
        if not engines:
            raise ValueError("a scheduler needs at least one engine")
        self.policies = policies
        self.release = policies.release
        self.routing = policies.routing
        self.admission = policies.admission
        self.retention = policies.retention
        self.view = ClusterView(
            [e if isinstance(e, EngineLoad) else EngineLoad(e) for e in engines]
        )
        self.workflows: dict[str, WorkflowRecord] = {}
        self.on_workflow_done = on_workflow_done
        self.forget_finished = forget_finished
        self.active_workflows = 0
        self.finished_workflows = 0
        self.released_total = 0
        # running mean of observed output lengths: the core's only work estimate, learned online
        self._out_sum = prior_output_tokens
        self._out_n = 1
        # load reported by other drivers on the same engines (see peer_load)
        self._peer: dict[str, tuple[int, int, int, int]] = {}
        self._peer_ready = 0
        self._peer_seq = 0
        #: turns held READY, in the order they became ready (for oldest_hold_age)
        self._ready: dict[TurnRecord, None] = {}

    # ------------------------------------------------------------------ events
    def workflow_arrived(self, now: float, workflow: Workflow, *,
                         announce_end: bool = True) -> list[Action]:
        """A workflow whose turns are known (simulator, replay): its root turns become READY.

        ``announce_end=False``: its end is learnt as a gateway learns a session's, only from
        :meth:`close_session`: its last turn, once finished, stays paused (in ``TOOL``, its KV
        retained) like any other, and the workflow finishes when the driver closes it."""
        wf = self._new_workflow(workflow.id, now, workflow.tenant, workflow)
        if not announce_end:
            wf.closed = False
        n = len(workflow.turns)
        wf.turns = [TurnRecord(wf, i, t) for i, t in enumerate(workflow.turns)]
        wf.remaining = n
        if n > 1 and not workflow.is_chain:  # one turn: a chain (and no scan of the turns)
            wf.children = [[] for _ in range(n)]
            wf.pending_parents = [0] * n
            for i in range(n):
                for p in workflow.parents_of(i):
                    wf.children[p].append(i)
                    wf.pending_parents[i] += 1
        for rec in wf.turns:
            if rec.index == 0 or (wf.children is not None and wf.pending_parents[rec.index] == 0):
                self._make_ready(rec, now)
        return self._release(now)

    def open_session(
        self,
        now: float,
        session_id: str,
        tenant: str = "default",
        *,
        arrival_s: float | None = None,
        attained_tokens: int = 0,
        last_engine: str | None = None,
    ) -> None:
        """An open-ended session (gateway): turns are added with :meth:`turn_ready`.

        A session continued from elsewhere (a restarted gateway, another replica) carries what
        the policies read: its first arrival, the service it attained, the engine holding its
        KV."""
        wf = self._new_workflow(session_id, now if arrival_s is None else arrival_s, tenant, None)
        wf.attained_tokens = attained_tokens
        if last_engine is not None and last_engine in self.view.ids:
            wf.last_engine = last_engine

    def session_moved(self, session_id: str, last_engine: str, attained_tokens: int) -> None:
        """Another driver (a gateway replica) served the session's last turn on ``last_engine``."""
        wf = self._get(session_id)
        if last_engine in self.view.ids:
            wf.last_engine = last_engine
        wf.attained_tokens = max(wf.attained_tokens, attained_tokens)

    def turn_ready(
        self,
        now: float,
        session_id: str,
        turn: Turn,
        *,
        engine_hint: str | None = None,
        ready_s: float | None = None,
        tool_returns: Sequence[ToolCall] = (),
    ) -> tuple[TurnRecord, list[Action]]:
        """The next turn of an open session arrived; the previous turn's tool call has ended.

        ``engine_hint`` (an engine id the client asked for) is set on the new record before
        any release; only routing policies that read it (``hinted``) act on it. ``ready_s``
        (default ``now``) keeps the original ready time of a turn accepted earlier (restored
        after a restart, taken over from a dead replica). ``tool_returns``: the previous turn's
        tool calls as the client reports them with this turn (name, result size, status),
        recorded on that turn (bucket routers such as ``cmlfq`` read them)."""
        wf = self._get(session_id)
        if wf.source is not None:
            raise SchedulerError(f"workflow {session_id!r} has known turns; use tool_finished")
        if wf.done:
            raise SchedulerError(f"session {session_id!r} is closed")
        if wf.turns:
            prev = wf.turns[-1]
            if prev.state == TurnState.TOOL:
                if tool_returns:
                    prev.turn = dataclasses.replace(prev.turn, tools=tuple(tool_returns))
                self.retention.on_tool_end(prev, now)
                self._turn_done(prev, now)
            elif prev.state != TurnState.DONE:
                raise SchedulerError(f"{prev!r}: a session runs one turn at a time")
        rec = TurnRecord(wf, len(wf.turns), turn)
        rec.engine_hint = engine_hint
        wf.turns.append(rec)
        wf.remaining += 1
        self._make_ready(rec, now if ready_s is None else ready_s, now)
        return rec, self._release(now)

    def close_session(self, now: float, session_id: str) -> list[Action]:
        """An open session will send no more turns; it finishes when its last turn does."""
        wf = self._get(session_id)
        wf.closed = True
        if wf.turns and wf.turns[-1].state == TurnState.TOOL:
            # the last turn's tool result never came back as a new turn
            return self.tool_finished(now, session_id, wf.turns[-1].index, session_end=True)
        if wf.remaining == 0 and not wf.done:
            self._workflow_done(wf, now)
        return _NO_ACTIONS

    def withdraw(self, now: float, workflow_id: str, index: int) -> list[Action]:
        """A held (READY) turn nobody waits for any more (its client went away): it stops
        counting as held at once and its workflow goes on as if it had never come; the
        release policy skips it when it next meets it."""
        rec = self._turn(workflow_id, index)
        if rec.state != TurnState.READY:
            raise SchedulerError(f"{rec!r} is not held")
        del self._ready[rec]
        count_ready(self.view, -1)
        rec.state = TurnState.DONE  # done and never released: withdrawn
        wf = rec.workflow
        wf.remaining -= 1
        if wf.remaining == 0 and wf.closed:
            self._workflow_done(wf, now)
        return self._release(now)

    def turn_started(self, now: float, workflow_id: str, index: int) -> None:
        rec = self._turn(workflow_id, index)
        if rec.state != TurnState.RELEASED:
            raise SchedulerError(f"{rec!r} started but was not released")
        rec.state = TurnState.RUNNING
        rec.started_s = now

    def turn_first_token(self, now: float, workflow_id: str, index: int) -> None:
        rec = self._turn(workflow_id, index)
        if rec.state not in (TurnState.RELEASED, TurnState.RUNNING):
            raise SchedulerError(f"{rec!r} produced a token but is not running")
        if rec.first_token_s < 0:
            rec.first_token_s = now

    def turn_finished(
        self,
        now: float,
        workflow_id: str,
        index: int,
        output_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> list[Action]:
        """The engine finished the turn (the driver passes the real output length and the
        prompt tokens served from the prefix cache when the engine reports them)."""
        rec = self._turn(workflow_id, index)
        if rec.state == TurnState.RELEASED:  # a driver that does not report starts
            rec.state = TurnState.RUNNING
            rec.started_s = now
        if rec.state != TurnState.RUNNING:
            raise SchedulerError(f"{rec!r} finished but was not running")
        if output_tokens is not None:
            rec.output_tokens = output_tokens
        if cached_tokens is not None:
            rec.cached_tokens = cached_tokens
        rec.finished_s = now
        if rec.first_token_s < 0:
            rec.first_token_s = now
        engine = self.view[rec.engine]  # type: ignore[index]
        charged = rec.charged_tokens
        discharge(engine, charged)
        count_released(self.view, -1, -charged)
        wf = rec.workflow
        wf.attained_tokens += rec.prompt_tokens + rec.output_tokens
        wf.last_engine = engine.id
        self._out_sum += rec.output_tokens
        self._out_n += 1
        self.release.on_finished(rec, now)
        actions: list[Action] = []
        if rec.turn.tools or wf.source is None or (wf.remaining == 1 and not wf.closed):
            # open sessions (and a last turn whose end is unannounced): the client may be
            # running a tool; the next request tells
            rec.state = TurnState.TOOL
            if wf.paused_engine is not None:  # a DAG with several turns in tool calls
                self._resume(wf)
            wf.paused_engine = engine.id
            wf.paused_tokens = rec.prompt_tokens + rec.output_tokens
            pause_session(engine, wf.id, wf.paused_tokens)
            decision = self.retention.on_tool_start(rec, engine, now)
            actions.append(Retain(rec, engine.id, decision))
        else:
            self._turn_done(rec, now)
        actions.extend(self._release(now))
        return actions

    def tool_finished(self, now: float, workflow_id: str, index: int,
                      session_end: bool = False) -> list[Action]:
        """The tool calls after turn ``index`` returned: dependent turns may become READY.

        ``session_end``: no turn follows; the session ended (a gateway closes an idle one). The
        pause is then not a tool latency (the gateway never sees when the last tool returns, only
        when it gives up waiting), so the retention policy does not learn from it."""
        rec = self._turn(workflow_id, index)
        if rec.state != TurnState.TOOL:
            raise SchedulerError(f"{rec!r} is not in a tool call")
        if not session_end:
            self.retention.on_tool_end(rec, now)
        self._turn_done(rec, now)
        return self._release(now)

    def engine_stats(
        self,
        now: float,
        engine_id: str,
        *,
        queue_len: int | None = None,
        running: int | None = None,
        kv_used_frac: float | None = None,
        healthy: bool | None = None,
    ) -> list[Action]:
        """Stats reported by an engine; a recovered engine may unblock held turns."""
        report_stats(self.view[engine_id], queue_len=queue_len, running=running,
                     kv_used_frac=kv_used_frac, healthy=healthy)
        return self._release(now)

    def peer_load(
        self, now: float, engines: Mapping[str, Sequence[int]], ready_turns: int = 0
    ) -> list[Action]:
        """Work other drivers sharing these engines hold (other gateway replicas), per engine
        ``(released turns, released tokens, paused context tokens, paused sessions)`` (the last
        may be left out: 0), plus the turns they hold READY. Counted in the view the policies
        read (so routing, shadow load, free slots and any released work a policy reads from the
        view are global), replacing the previous report; this scheduler's own accounting is
        unchanged underneath."""
        view = self.view
        for engine_id, load in engines.items():
            if engine_id not in view:
                continue
            turns, tokens, paused = int(load[0]), int(load[1]), int(load[2])
            sessions = int(load[3]) if len(load) > 3 else 0
            e = view[engine_id]
            old_turns, old_tokens, old_paused, old_sessions = self._peer.get(engine_id,
                                                                             (0, 0, 0, 0))
            add_peer_load(e, turns - old_turns, tokens - old_tokens, paused - old_paused,
                          sessions - old_sessions)
            count_peer_released(view, turns - old_turns, tokens - old_tokens)
            self._peer[engine_id] = (turns, tokens, paused, sessions)
        count_ready(view, ready_turns - self._peer_ready)
        self._peer_ready = ready_turns
        return self._release(now)

    def peer_observed(
        self,
        now: float,
        *,
        flow_time_s: float | None = None,
        tool_time_s: float | None = None,
        tools: tuple[ToolCall, ...] = (),
    ) -> None:
        """What another driver sharing these engines observed (another gateway replica): a
        workflow's flow time, a tool call's duration. The policies learn from it through their
        declared hooks (``on_workflow_done``, ``on_tool_end``), handed a stand-in record of the
        peer's workflow that this scheduler does not track."""
        self._peer_seq += 1
        wf_id = f"peer-{self._peer_seq}"
        if flow_time_s is not None:
            wf = WorkflowRecord(wf_id, now - flow_time_s, "default", None)
            wf.finished_s = now
            self.release.on_workflow_done(wf, now)
        if tool_time_s is not None:
            wf = WorkflowRecord(wf_id, now - tool_time_s, "default", None)
            rec = TurnRecord(wf, 0, Turn(0, 0, tools=tuple(tools)))
            rec.finished_s = now - tool_time_s
            self.retention.on_tool_end(rec, now)

    def own_load(self, engine_id: str) -> tuple[int, int, int, int]:
        """This scheduler's own ``(released turns, released tokens, paused context tokens,
        paused sessions)`` on an engine, without what :meth:`peer_load` reported."""
        e = self.view[engine_id]
        turns, tokens, paused, _sessions = self._peer.get(engine_id, (0, 0, 0, 0))
        return (e.outstanding_turns - turns, e.outstanding_tokens - tokens,
                e.paused_context_tokens - paused, len(e.cached_sessions))

    def add_engine(self, now: float, engine: EngineLoad) -> list[Action]:
        """An engine joined the cluster (an elastic pool growing); held turns may go there."""
        add_engine(self.view, engine)
        return self._release(now)

    def drain_engine(self, now: float, engine_id: str) -> None:
        """Route no new work to ``engine_id``; what runs there finishes there."""
        set_accepting(self.view[engine_id], False)

    def tick(self, now: float) -> list[Action]:
        """No event, but a policy timer (see :meth:`next_wakeup`) expired."""
        return self._release(now)

    def next_wakeup(self, now: float) -> float | None:
        return self.release.next_wakeup(now)

    # ---------------------------------------------------------------- queries
    @property
    def held_turns(self) -> int:
        return len(self._ready)

    def oldest_hold_age(self, now: float) -> float:
        """Seconds the oldest turn held READY (ready, not yet released) has waited; 0 when
        none is held. Compare with :meth:`hold_bound_s` (``/ready``, the
        ``turnstile_oldest_hold_seconds`` gauge)."""
        for rec in self._ready:  # the first entry is the oldest (amortized O(1))
            return max(0.0, now - rec.ready_s)
        return 0.0

    def hold_bound_s(self, now: float) -> float:
        """The release policy's bound on a hold as of ``now`` (0: it never holds)."""
        return self.release.hold_bound_s(now)

    # --------------------------------------------------------------- internals
    def _new_workflow(
        self, wf_id: str, now: float, tenant: str, source: Workflow | None
    ) -> WorkflowRecord:
        if wf_id in self.workflows:
            raise SchedulerError(f"workflow {wf_id!r} arrived twice")
        wf = WorkflowRecord(wf_id, now, tenant, source)
        self.workflows[wf_id] = wf
        self.active_workflows += 1
        return wf

    def _get(self, wf_id: str) -> WorkflowRecord:
        try:
            return self.workflows[wf_id]
        except KeyError:
            raise SchedulerError(f"unknown workflow {wf_id!r}") from None

    def _turn(self, wf_id: str, index: int) -> TurnRecord:
        wf = self.workflows.get(wf_id)  # three calls per turn: one lookup, no _get
        if wf is None:
            raise SchedulerError(f"unknown workflow {wf_id!r}")
        turns = wf.turns
        if not 0 <= index < len(turns):
            raise SchedulerError(f"workflow {wf_id!r} has no turn {index}")
        return turns[index]

    def _make_ready(self, rec: TurnRecord, ready_s: float, now: float | None = None) -> None:
        rec.state = TurnState.READY
        rec.ready_s = ready_s
        now = ready_s if now is None else now
        count_ready(self.view, 1)
        self._ready[rec] = None
        self.release.add(rec, now)

    def _release(self, now: float) -> list[Action]:
        if not len(self.release):
            return _NO_ACTIONS
        view = self.view
        if not view.any_accepting():
            # no engine takes work (all down, or an elastic pool between engines): hold; an
            # engine that recovers or joins releases them
            return _NO_ACTIONS
        out: list[Action] = []
        for rec in self.release.select(view, now):
            if rec.state == TurnState.DONE and rec.released_s < 0:
                continue  # withdrawn: a policy without lazy deletion hands it back
            if rec.state != TurnState.READY:
                raise SchedulerError(f"release policy returned {rec!r}, which is not READY")
            engine_id = self.routing.route(rec, view, now)
            engine = view[engine_id]
            wf = rec.workflow
            if wf.paused_engine is not None:
                self._resume(wf)  # the paused session stops counting as shadow load
            work = rec.prompt_tokens + int(self._out_sum / self._out_n)
            rec.charged_tokens = work
            rec.state = TurnState.RELEASED
            rec.released_s = now
            rec.engine = engine_id
            rec.priority = self.admission.priority(rec, engine, now)
            charge(engine, work)
            count_ready(view, -1)
            del self._ready[rec]
            count_released(view, 1, work)
            self.released_total += 1
            out.append(Release(rec, engine_id, rec.priority))
        return out

    def _resume(self, wf: WorkflowRecord) -> None:
        engine = self.view[wf.paused_engine]  # type: ignore[index]
        resume_session(engine, wf.id, wf.paused_tokens)
        wf.paused_engine = None
        wf.paused_tokens = 0

    def _turn_done(self, rec: TurnRecord, now: float) -> None:
        rec.state = TurnState.DONE
        wf = rec.workflow
        wf.remaining -= 1
        if wf.children is not None:
            for c in wf.children[rec.index]:
                wf.pending_parents[c] -= 1
                if wf.pending_parents[c] == 0:
                    self._make_ready(wf.turns[c], now)
        elif rec.index + 1 < len(wf.turns) and wf.source is not None:
            self._make_ready(wf.turns[rec.index + 1], now)
        if wf.remaining == 0 and wf.closed:
            self._workflow_done(wf, now)

    def _workflow_done(self, wf: WorkflowRecord, now: float) -> None:
        wf.finished_s = now
        if wf.paused_engine is not None:
            self._resume(wf)
        self.active_workflows -= 1
        self.finished_workflows += 1
        self.release.on_workflow_done(wf, now)
        self.routing.on_workflow_done(wf, now)
        if self.on_workflow_done is not None:
            self.on_workflow_done(wf)
        if self.forget_finished:
            del self.workflows[wf.id]
