"""One gateway replica among several sharing a :class:`~.shared.RedisState`.

* Every ``peer_sync_s`` the replica publishes its own load on each engine (released turns and
  tokens, paused context and sessions) and its held turns, and hands the other replicas' sum
  to its scheduler (``Scheduler.peer_load``): routing, shadow load, free slots and the budgets
  policies read from the view are decided on the cluster's load, not one replica's share of it.
  Its heartbeat is refreshed on the same period by a loop of its own and by a thread
  (:meth:`ReplicaSync.beat_loop`).
* It feeds the other replicas' observations (flow times, tool-call durations) to its policies,
  so what they learn is learned from the whole cluster's traffic.
* Every few syncs it claims the accepted turns of replicas whose heartbeat expired and serves
  them with no client attached, keeping the results for the clients' retries.
* A request id another live replica is serving is not served again: the retry waits for that
  replica's result (:meth:`ReplicaSync.answered_elsewhere`).
* A session named by its client has its row read before each of its turns, so the turn goes
  where the session's KV is whichever replica served the previous turn (a session derived from
  the conversation gets the same from its affinity key, in the same round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from turnstile.core.actions import Action
from turnstile.core.scheduler import Scheduler
from turnstile.gateway.protocol import GatewayError, Outcome, TurnRequest
from turnstile.gateway.sessions import Session
from turnstile.gateway.shared import RedisState
from turnstile.gateway.store import HeldTurnRow, SessionRow

__all__ = ["ReplicaHost", "ReplicaSync", "TakenOver"]

log = logging.getLogger("turnstile.gateway")

#: claim dead replicas' turns every this many load syncs
_CLAIM_EVERY = 5
#: the heartbeat thread goes on while the event loop was seen within this many replica_ttl_s
_LOOP_GRACE = 5


class TakenOver(Exception):
    """The request id's turn was just taken over by this replica (claimed from a dead one while
    its retry was being looked up): the retry is attached to it here."""


class ReplicaHost(Protocol):
    scheduler: Scheduler

    def adopt(self, row: HeldTurnRow, session: SessionRow | None = None) -> None: ...

    async def cached_outcome(self, rid: str, req: TurnRequest) -> Outcome | None: ...

    def apply(self, actions: list[Action]) -> None: ...


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
        #: held from the claim in Redis until its turns are adopted here: a retry that sees
        #: this replica own its turn meanwhile waits for it instead of serving it a second time
        self._claiming = asyncio.Lock()
        #: load syncs done (each also reads the others' observations)
        self.learned = 0
        #: syncs that failed (Redis away): logged the first time and every 100th
        self.failures = 0
        #: set by :meth:`stop`: the loops end even if a cancellation was lost on the way (a
        #: client library turning it into a timeout or connection error, caught as a failure)
        self.stopped = False
        #: when the event loop last ran the heartbeat loop (``time.monotonic()``)
        self.loop_seen = 0.0

    def stop(self) -> None:
        self.stopped = True
        self.state.stop_beating()

    async def loop(self) -> None:
        n = 0
        while not self.stopped:
            try:
                await self.sync_load()
                if n % _CLAIM_EVERY == 0:
                    await self.claim()
            except Exception:
                self.failures += 1
                if self.failures % 100 == 1:
                    log.exception("replica sync failed (%d so far)", self.failures)
            n += 1
            await asyncio.sleep(self.sync_s)

    async def beat_loop(self) -> None:
        """The heartbeat alone, every ``sync_s``, apart from the load sync and the claims (a
        claim adopting many turns, or a slow load exchange on a loaded host, must not leave the
        heartbeat to lapse: a live replica whose heartbeat lapses has its turns claimed and run
        a second time by another); and from a thread while this loop was seen within
        ``_LOOP_GRACE`` x ``replica_ttl_s`` (:meth:`RedisState.beat_in_thread`)."""
        self.loop_seen = time.monotonic()
        self.state.beat_in_thread(lambda: self.loop_seen, every_s=self.sync_s,
                                  grace_s=_LOOP_GRACE * self.state.replica_ttl_s)
        while not self.stopped:
            self.loop_seen = time.monotonic()
            # a failure is counted and logged by the load sync, which fails the same way
            with contextlib.suppress(Exception):
                await self.state.heartbeat()
            await asyncio.sleep(self.sync_s)

    async def sync_load(self) -> None:
        sched = self.host.scheduler
        own = {eid: sched.own_load(eid) for eid in sched.view.ids}
        peers, held = await self.state.exchange_load(own, sched.held_turns)
        for eid in sched.view.ids:
            peers.setdefault(eid, (0, 0, 0, 0))
        self.host.apply(sched.peer_load(self.now(), peers, held))
        now = self.now()
        for flow_s, tool_s in await self.state.read_observations():
            sched.peer_observed(now, flow_time_s=flow_s, tool_time_s=tool_s)
        self.learned += 1

    async def claim(self) -> None:
        async with self._claiming:
            rows = await self.state.claim_orphans()
            if rows:
                log.warning("replica %s took over %d turns of a dead replica",
                            self.state.replica, len(rows))
                self.claimed += len(rows)
            for row in rows:
                self.host.adopt(row, await self.state.lookup_session(row.session_id))

    async def refresh(self, s: Session) -> None:
        """Before a turn of a session named by its client: what another replica learned about
        it (the engine holding its KV, the context it grew to)."""
        row = await self.state.lookup_session(s.id)
        if row is None or row.turns < s.turns:
            return
        s.load(row)
        if s.in_scheduler and row.last_engine is not None:
            self.host.scheduler.session_moved(s.id, row.last_engine, row.attained_tokens)

    async def answered_elsewhere(self, rid: str, req: TurnRequest) -> Outcome | None:
        """A request id this replica does not hold: if another replica accepted it (its client
        retried here), wait for that replica's answer instead of serving it twice; if it was
        answered already, give the kept answer. None: serve it — never seen, over with no
        answer, or answered in full with no answer kept (a stream: run again, see
        docs/reliability.md). Raises :class:`TakenOver` when this replica has just claimed it."""
        owner, done = await self.state.turn_status(rid)
        if owner == self.state.replica and not done:
            # claimed here, maybe while this lookup ran (the caller found no turn for it just
            # before): attached to the adopted turn once the claim is through; none adopted
            # (a turn of this replica's own, just over), the caller serves it
            async with self._claiming:
                pass
            raise TakenOver(rid)
        if owner is None:
            return None
        # Waiting, a read that fails (Redis slow to answer on a loaded host) is not an answer:
        # taken as "no such turn" it served the request here while its owner ran it too (a
        # third generation of a turn cut at a replica's death); the wait goes on instead
        deadline = self.now() + self.wait_s
        while True:
            if self.now() > deadline:
                raise GatewayError(504, f"request {rid!r} is still being served by replica "
                                   f"{owner}", type_="upstream_error", code="timeout")
            if done:
                failed = self.state.read_errors
                out = await self.host.cached_outcome(rid, req)
                if out is not None or self.state.read_errors == failed:
                    return out  # None: answered in full, no answer kept (a stream)
            await asyncio.sleep(0.05)
            failed = self.state.read_errors
            seen, done = await self.state.turn_status(rid)
            if self.state.read_errors != failed:
                continue  # unknown, not gone
            if seen is None:
                return None  # over with no answer (or expired) meanwhile
            owner = seen
