"""One gateway replica among several sharing a :class:`~.shared.RedisState`.

* Every ``peer_sync_s`` the replica publishes its own load on each engine (released turns and
  tokens, paused context) and its held turns, refreshes its heartbeat, and hands the other
  replicas' sum to its scheduler (``Scheduler.peer_load``): routing, shadow load and the
  released-work budget are decided on the cluster's load, not one replica's share of it.
* Every few syncs it claims the accepted turns of replicas whose heartbeat expired and serves
  them with no client attached, keeping the results for the clients' retries.
* A request id another live replica is serving is not served again: the retry waits for that
  replica's result (:meth:`ReplicaSync.answered_elsewhere`).
* A session's row is read before each of its turns, so the turn goes where the session's KV is
  whichever replica served the previous turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from turnstile.core.scheduler import Action, Scheduler
from turnstile.gateway.protocol import GatewayError, Outcome, TurnRequest
from turnstile.gateway.sessions import Session
from turnstile.gateway.shared import RedisState
from turnstile.gateway.store import HeldTurnRow

__all__ = ["ReplicaHost", "ReplicaSync"]

log = logging.getLogger("turnstile.gateway")

#: claim dead replicas' turns every this many load syncs
_CLAIM_EVERY = 5


class ReplicaHost(Protocol):
    scheduler: Scheduler

    def adopt(self, row: HeldTurnRow) -> None: ...

    async def cached_outcome(self, rid: str, req: TurnRequest) -> Outcome | None: ...

    def _apply(self, actions: list[Action]) -> None: ...


class ReplicaSync:
    def __init__(self, host: ReplicaHost, state: RedisState, now: Callable[[], float], *,
                 sync_s: float, wait_s: float) -> None:
        self.host = host
        self.state = state
        self.now = now
        self.sync_s = sync_s
        #: how long a retry waits for the replica serving its turn
        self.wait_s = wait_s
        self.claimed = 0

    async def loop(self) -> None:
        n = 0
        while True:
            try:
                await self.sync_load()
                if n % _CLAIM_EVERY == 0:
                    await self.claim()
            except Exception:
                log.exception("replica sync failed")
            n += 1
            await asyncio.sleep(self.sync_s)

    async def sync_load(self) -> None:
        sched = self.host.scheduler
        own = {eid: sched.own_load(eid) for eid in sched.view.ids}
        peers, held = await self.state.exchange_load(own, sched.held_turns)
        for eid in sched.view.ids:
            peers.setdefault(eid, (0, 0, 0))
        self.host._apply(sched.peer_load(self.now(), peers, held))

    async def claim(self) -> None:
        rows = await self.state.claim_orphans()
        if rows:
            log.warning("replica %s took over %d turns of a dead replica", self.state.replica,
                        len(rows))
            self.claimed += len(rows)
        for row in rows:
            self.host.adopt(row)

    async def refresh(self, s: Session, near: str | None) -> None:
        """Before a turn of ``s``: what another replica learned about it, or for a new session
        the engine of the session it should start near."""
        if s.turns == 0 and near is not None:
            row = await self.state.lookup_session(near)
            if row is not None and row.last_engine is not None and s.last_engine is None:
                s.last_engine = row.last_engine
            return
        row = await self.state.lookup_session(s.id)
        if row is None or row.turns < s.turns:
            return
        s.load(row)
        if s.in_scheduler and row.last_engine is not None:
            self.host.scheduler.session_moved(s.id, row.last_engine, row.attained_tokens)

    async def answered_elsewhere(self, rid: str, req: TurnRequest) -> Outcome | None:
        """The turn ``rid`` is another replica's (its client retried here): wait for its
        result instead of serving it twice. None when no other replica has it."""
        owner = await self.state.turn_owner(rid)
        if owner is None or owner == self.state.replica:
            return None
        deadline = self.now() + self.wait_s
        while self.now() < deadline:
            out = await self.host.cached_outcome(rid, req)
            if out is not None:
                return out
            if await self.state.turn_owner(rid) is None:
                # answered to its own client (no result kept) or failed: nothing to give
                out = await self.host.cached_outcome(rid, req)
                if out is not None:
                    return out
                raise GatewayError(409, f"request {rid!r} was answered by another replica",
                                   code="duplicate_request")
            await asyncio.sleep(0.05)
        raise GatewayError(504, f"request {rid!r} is still being served by replica {owner}",
                           type_="upstream_error", code="timeout")
