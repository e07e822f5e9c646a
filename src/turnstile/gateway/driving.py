"""Carrying out the scheduler's actions in wall-clock time, and its policy timers.

``Release`` wakes the request held for the turn (or serves / drops it when no client waits);
``Retain`` goes to the engine's adapter. ``next_wakeup`` becomes one loop timer.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from typing import Any, Protocol

from turnstile.core.actions import Action, Release
from turnstile.core.scheduler import Scheduler
from turnstile.core.state import TurnRecord, TurnState
from turnstile.gateway.adapters import EngineAdapter
from turnstile.gateway.durability import Durability, OffsetClock
from turnstile.gateway.health import HealthMonitor
from turnstile.gateway.metrics import GatewayMetrics
from turnstile.gateway.sessions import PendingTurn

__all__ = ["ReleaseDriver", "ReleaseHost"]

log = logging.getLogger("turnstile.gateway")


class ReleaseHost(Protocol):
    """What the driver needs from the service."""

    scheduler: Scheduler
    adapters: dict[str, EngineAdapter]
    metrics: GatewayMetrics
    health: HealthMonitor
    clock: OffsetClock
    durable: Durability | None

    def serve_detached(self, p: PendingTurn) -> None: ...

    def drop_released(self, p: PendingTurn) -> list[Action]: ...

    def spawn(self, coro: Any) -> asyncio.Task[Any]: ...


class ReleaseDriver:
    def __init__(self, host: ReleaseHost) -> None:
        self.host = host
        self.by_rec: dict[TurnRecord, PendingTurn] = {}
        #: engines whose adapter acts on retention decisions (others would only spawn no-ops)
        self._retainers: set[str] = set()
        for a in host.adapters.values():
            self.engine_added(a)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at = math.inf

    def engine_added(self, adapter: EngineAdapter) -> None:
        """An engine joined (at start, or later: the endpoint picker's pool): its retention
        decisions go to its adapter where the adapter acts on them."""
        if type(adapter).retain is not EngineAdapter.retain:
            self._retainers.add(adapter.id)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None

    def track(self, rec: TurnRecord, p: PendingTurn) -> None:
        self.by_rec[rec] = p

    def untrack(self, rec: TurnRecord) -> None:
        self.by_rec.pop(rec, None)

    def apply(self, actions: list[Action]) -> None:
        if not actions:
            self._schedule_wakeup()
            return
        host = self.host
        queue = deque(actions)
        while queue:
            a = queue.popleft()
            if isinstance(a, Release):
                p = self.by_rec.get(a.turn)
                if p is None:  # not ours (cannot happen)
                    log.error("release of an unknown turn %r", a.turn)
                    continue
                p.state = TurnState.RELEASED
                p.engine = a.engine
                p.priority = a.priority
                rec = a.turn
                host.metrics.released.labels(a.engine).inc()
                host.metrics.hold.observe(max(rec.released_s - rec.ready_s, 0.0))
                # the session's KV goes to this engine (written now in a shared state, so a
                # replica restarted before the turn finishes still knows it)
                moved = p.session.last_engine != a.engine
                p.session.last_engine = a.engine
                if host.durable is not None:
                    host.durable.released(p, moved)
                if p.attached:
                    if p.waker is not None and not p.waker.done():
                        p.waker.set_result(None)
                    # else its waiting task is being cancelled right now: _detach finishes it
                elif p.keep_result:
                    host.serve_detached(p)
                else:
                    host.metrics.turns_cancelled.labels("held").inc()
                    queue.extend(host.drop_released(p))
            else:  # Retain
                if (a.decision.action != "lru" and host.health.up(a.engine)
                        and a.engine in self._retainers):
                    host.spawn(host.adapters[a.engine].retain(
                        a.turn.workflow.id, a.decision, host.clock.now()))
        self._schedule_wakeup()

    def _schedule_wakeup(self) -> None:
        now = self.host.clock.now()
        at = self.host.scheduler.next_wakeup(now)
        if at is None or self._loop is None:
            return
        if self._wakeup is not None and at >= self._wakeup_at - 1e-3:
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        self._wakeup_at = at
        self._wakeup = self._loop.call_later(max(at - now, 0.0), self.tick)

    def tick(self) -> None:
        self._wakeup = None
        self._wakeup_at = math.inf
        self.apply(self.host.scheduler.tick(self.host.clock.now()))

    def safety_tick(self) -> None:
        """Policy timers are exact; this periodic tick is a safety net while turns are held."""
        if self.host.scheduler.held_turns:
            self.tick()
