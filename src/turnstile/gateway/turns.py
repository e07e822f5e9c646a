"""A turn's life in the gateway after it was accepted: READY, released, running, over.

:class:`TurnLifecycle` is the part of :class:`~turnstile.gateway.service.Gateway` that moves a
turn through the scheduler's states and keeps the session, the metrics, the recorder and the
durable rows in step with it:

* :meth:`~TurnLifecycle.make_ready` — the turn becomes READY (at acceptance, again after a failed
  attempt, or adopted from a dead replica / a restart); :meth:`~TurnLifecycle.apply` carries out
  the scheduler's actions (releases wake held turns, retains go to the engines).
* the relay's events (:class:`~turnstile.gateway.relay.TurnEvents`): ``turn_started`` when
  forwarded, ``turn_first_token`` at the first streamed token, ``turn_finished`` with the
  engine's real ``usage``, ``turn_failed`` (finished with 0 tokens; the retry loop re-readies
  it), ``engine_failed``.
* a turn over: its session is passed on to its next waiting turn, a one-turn session closed;
  :meth:`~TurnLifecycle.drop_released` finishes a released turn nobody wants without running it.

The retry/serve loop, admission and start/stop stay in :mod:`.service`, which subclasses this.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from turnstile.core.actions import Action
from turnstile.core.scheduler import Scheduler
from turnstile.core.state import TurnState, WorkflowRecord
from turnstile.gateway.adapters import ForwardHints
from turnstile.gateway.affinity import ConversationKeys, last_user_text
from turnstile.gateway.driving import ReleaseDriver
from turnstile.gateway.durability import Durability, OffsetClock
from turnstile.gateway.estimate import TokenEstimator
from turnstile.gateway.health import HealthMonitor
from turnstile.gateway.metrics import GatewayMetrics
from turnstile.gateway.protocol import cached_tokens
from turnstile.gateway.recorder import SessionRecorder
from turnstile.gateway.replicas import ReplicaSync
from turnstile.gateway.sessions import PendingTurn, Session, SessionTable
from turnstile.gateway.signals import tool_returns
from turnstile.workload.model import Turn

__all__ = ["TurnLifecycle"]

log = logging.getLogger("turnstile.gateway")

PENDING, READY, RUNNING, DONE = (TurnState.PENDING, TurnState.READY, TurnState.RUNNING,
                                 TurnState.DONE)


class TurnLifecycle:
    """A turn's state changes and their bookkeeping (see the module docstring); the gateway
    service sets up what is declared here."""

    scheduler: Scheduler
    clock: OffsetClock
    metrics: GatewayMetrics
    health: HealthMonitor
    driver: ReleaseDriver
    table: SessionTable
    by_request: dict[str, PendingTurn]
    estimator: TokenEstimator
    durable: Durability | None
    recorder: SessionRecorder | None
    keys: ConversationKeys | None
    replicas: ReplicaSync | None

    # ================================================================== READY
    def apply(self, actions: list[Action]) -> None:
        """Carry out the scheduler's actions (releases wake held turns; retains go to the
        engines)."""
        self.driver.apply(actions)

    def make_ready(self, p: PendingTurn, turn: Turn, ready_s: float | None = None) -> None:
        """The turn becomes READY in the scheduler (again, after a failed attempt)."""
        p.turn = turn
        s = p.session
        now = self.clock.now()
        if not s.in_scheduler:
            # a session continued from a restart carries what the policies read
            self.scheduler.open_session(
                now, s.id, s.tenant, arrival_s=s.arrival_s if s.turns else None,
                attained_tokens=s.attained_tokens, last_engine=s.last_engine)
            s.in_scheduler = True
        elif s.turns and p.rec is None and self.replicas is not None:
            # the gap since its last turn is the client's tool call: the others learn it too
            self.replicas.state.publish_observation(tool_time_s=max(now - s.last_active_s, 0.0))
        p.state = READY
        p.waker = asyncio.get_running_loop().create_future()
        rec, actions = self.scheduler.turn_ready(now, s.id, turn, engine_hint=p.engine_hint,
                                                 ready_s=ready_s, tool_returns=tool_returns(p.body))
        p.rec = rec
        self.driver.track(rec, p)
        self.apply(actions)
        if p.state == READY and self.durable is not None:
            self.durable.held(p, now)

    # ================================================================== dropped, done
    def drop_released(self, p: PendingTurn) -> list[Action]:
        """A released turn nobody wants any more: finish it without running it."""
        rec = p.rec
        assert rec is not None
        now = self.clock.now()
        self.scheduler.turn_started(now, rec.workflow_id, rec.index)
        actions = list(self.scheduler.turn_finished(now, rec.workflow_id, rec.index, 0))
        actions.extend(self._turn_over(p))
        return actions

    def _workflow_done(self, wf: WorkflowRecord) -> None:
        last = max((t.finished_s for t in wf.turns), default=-1.0)
        if last >= 0:
            self.metrics.flow.observe(max(last - wf.arrival_s, 0.0))
            if self.replicas is not None:  # the other replicas' policies learn from it too
                self.replicas.state.publish_observation(flow_time_s=last - wf.arrival_s)

    # ================================================================== turn events (relay)
    def turn_started(self, p: PendingTurn) -> ForwardHints:
        rec = p.rec
        assert rec is not None
        now = self.clock.now()
        self.scheduler.turn_started(now, rec.workflow_id, rec.index)
        p.state = RUNNING
        return ForwardHints(p.session.id, p.request_id, p.priority, now_s=now)

    def turn_first_token(self, p: PendingTurn) -> None:
        rec = p.rec
        assert rec is not None
        self.scheduler.turn_first_token(self.clock.now(), rec.workflow_id, rec.index)

    def engine_failed(self, engine_id: str, *, dead: bool = True) -> None:
        """The engine failed a turn: down until its next health check says otherwise;
        ``dead``: its requests in flight are dropped too (see health.py)."""
        self.health.set_health(engine_id, False, dead=dead)

    def turn_failed(self, p: PendingTurn, engine_down: bool, reason: str) -> None:
        """Finish a failed attempt with 0 tokens; the retry loop re-readies the turn."""
        log.warning("turn %s on %s failed: %s", p.request_id, p.engine, reason)
        if engine_down:
            self.health.set_health(p.engine, False, dead=True)
        rec = p.rec
        assert rec is not None
        self.driver.untrack(rec)
        p.state = PENDING
        p.waker = None
        self.apply(self.scheduler.turn_finished(self.clock.now(), rec.workflow_id, rec.index, 0))

    def turn_finished(self, p: PendingTurn, output_tokens: int | None, usage: dict[str, Any] | None,
                 *, cancelled: bool = False) -> None:
        if p.state != RUNNING:  # a stream's clean-up after the turn was already finished
            return
        p.answered = not cancelled
        rec = p.rec
        assert rec is not None
        now = self.clock.now()
        out = output_tokens if output_tokens is not None else 0
        actions = list(self.scheduler.turn_finished(now, rec.workflow_id, rec.index, out,
                                                    cached_tokens(usage)))
        self.metrics.turns_finished.labels(p.engine).inc()
        self.metrics.output_tokens.labels(p.engine).inc(out)
        self.metrics.e2e.observe(max(now - rec.ready_s, 0.0))
        if p.stream and rec.first_token_s >= 0 and not cancelled:
            self.metrics.ttft.observe(max(rec.first_token_s - rec.ready_s, 0.0))
        if cancelled:
            self.metrics.turns_cancelled.labels("running").inc()
        s = p.session
        s.turns += 1
        s.last_engine = p.engine
        prompt_real = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(prompt_real, int) and prompt_real > 0:
            s.context_tokens = prompt_real + out
            self.estimator.learn(prompt_real, p.prompt_chars)
        else:
            s.context_tokens = rec.prompt_tokens + out
        s.attained_tokens += rec.prompt_tokens + out
        if self.recorder is not None and not cancelled and not p.probe:
            self.recorder.turn_finished(s.id, s.tenant, p.body, rec.ready_s, now, usage, out)
        if p.reply_text is not None and self.keys is not None and not cancelled:
            self.keys.reply(s.id, p.conversation[0], p.conversation[1], "".join(p.reply_text),
                            "".join(p.reply_args or ()), last_user_text(p.body), p.engine,
                            s.context_tokens)
        actions.extend(self._turn_over(p))
        self.apply(actions)

    # ================================================================== turn over
    def _turn_over(self, p: PendingTurn) -> list[Action]:
        """The request is over: free its session for the next turn; returns actions."""
        p.state = DONE
        if p.rec is not None:
            self.driver.untrack(p.rec)
        self._forget(p)
        s = p.session
        s.last_active_s = self.clock.now()
        actions: list[Action] = []
        if s.active is p:
            self.table.pass_on(s)
        if p.ends_session and s.active is None and s.in_scheduler:
            actions.extend(self._close(s))  # the client said so: its slot and gate place go
        elif s.ephemeral and s.active is None:
            # a derived one-turn session stays findable for a follow-up (it holds nothing)
            keep = s.derived and not s.refused
            actions.extend(self._leave_scheduler(s) if keep else self._close(s))
        elif self.durable is not None and not (s.derived and self.durable.backend.shared):
            self.durable.session(s)
        return actions

    def _forget(self, p: PendingTurn) -> None:
        if self.by_request.get(p.request_id) is p:
            del self.by_request[p.request_id]
        # a detached turn's row goes once its result is kept; one whose answer is kept on its
        # way out, once that is written (Recovery.run_kept)
        if (self.durable is not None and not p.keep_answer
                and (p.detached_done is None or p.detached_done.is_set())):
            self.durable.forget(p)
        s = p.session
        if s.active is p and p.rec is None:
            self.table.pass_on(s)
        if (s.ephemeral and s.active is None and not s.in_scheduler
                and (s.refused or not s.derived)):
            self.table.drop(s.id)

    def _close(self, s: Session) -> list[Action]:
        self.table.drop(s.id)
        if self.recorder is not None:
            self.recorder.session_closed(s.id)
        if self.durable is not None:
            self.durable.session_closed(s)
        return self._leave_scheduler(s)

    def _leave_scheduler(self, s: Session) -> list[Action]:
        """The policies stop counting the session (its workflow finishes); a later turn of it
        opens it there again."""
        if not s.in_scheduler:
            return []
        s.in_scheduler = False
        return list(self.scheduler.close_session(self.clock.now(), s.id))
