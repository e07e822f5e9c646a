"""Turns served with no client attached, and their results.

A turn is *adopted* when nobody waits for it here: restored from the state backend after a
restart, or taken over from a dead replica. It is served like any other (the same retry loop),
non-streamed, and its result is kept (in memory and in the backend, for ``result_ttl_s``) so the
client's retry of the same ``x-request-id`` gets the answer once, from any replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from turnstile.core.state import TurnState
from turnstile.gateway.durability import Durability, OffsetClock
from turnstile.gateway.protocol import (
    JSON_CT,
    GatewayError,
    Outcome,
    TurnRequest,
    cached_outcome,
    started,
)
from turnstile.gateway.replicas import TakenOver
from turnstile.gateway.sessions import PendingTurn, SessionTable
from turnstile.gateway.store import HeldTurnRow, SessionRow
from turnstile.workload.model import Turn

if TYPE_CHECKING:
    from turnstile.gateway.replicas import ReplicaSync

__all__ = ["Recovery", "RecoveryHost"]

log = logging.getLogger("turnstile.gateway")


class RecoveryHost(Protocol):
    table: SessionTable
    by_request: dict[str, PendingTurn]
    clock: OffsetClock
    durable: Durability | None
    replicas: ReplicaSync | None

    def make_ready(self, p: PendingTurn, turn: Turn, ready_s: float | None = None) -> None: ...

    async def serve(self, p: PendingTurn) -> Outcome: ...

    async def run(self, p: PendingTurn) -> Outcome: ...

    def spawn(self, coro: Any) -> asyncio.Task[Any]: ...


class Recovery:
    def __init__(self, host: RecoveryHost) -> None:
        self.host = host
        #: results of turns served with no client attached: request id → (status, body, at, path)
        self.results: dict[str, tuple[int, bytes, float, str]] = {}

    def restore(self) -> None:
        """Start-up with a state backend: the clock, sessions, kept results, held turns."""
        host = self.host
        durable = host.durable
        assert durable is not None
        host.clock.continue_from(durable.backend)
        self.results, held = durable.restore(host.table, host.clock.now())
        for h in held:
            self.adopt(h)
        if len(host.table) or self.results:
            log.warning("restored %d sessions, %d held turns, %d kept results",
                        len(host.table), len(host.by_request), len(self.results))

    def adopt(self, h: HeldTurnRow, session: SessionRow | None = None) -> None:
        """Serve an accepted turn nobody waits for here, keeping its result; ``session``: its
        session's row when another replica served it (residency, context)."""
        host = self.host
        durable = host.durable
        assert durable is not None
        s = host.table.open(h.session_id, "default", h.session_id.startswith("req-"),
                            h.ready_s)
        if session is not None and not s.in_scheduler:
            s.load(session)
        mine = host.by_request.get(h.request_id)
        if mine is not None:
            # its client's retry is served here already: that turn is the claimed one now
            mine.persisted = True
            return
        if s.active is not None:
            durable.backend.drop_turn(h.request_id, answered=False)  # its retry is served
            return
        p = PendingTurn(h.request_id, s, h.path, h.body, h.stream)
        p.attached = False
        p.keep_result = True
        p.persisted = True
        if h.stream:
            opts = h.body.get("stream_options")
            p.client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        s.active = p
        host.by_request[p.request_id] = p
        host.make_ready(p, Turn(h.input_tokens, h.output_tokens, h.context_tokens), h.ready_s)

    def serve_detached(self, p: PendingTurn) -> None:
        if p.detached_done is None:
            p.detached_done = asyncio.Event()
            self.host.spawn(self._detached(p))

    async def _detached(self, p: PendingTurn) -> None:
        assert p.detached_done is not None
        body = {k: v for k, v in p.body.items() if k != "stream_options"}
        body["stream"] = False
        p.body = body
        p.stream = False
        host = self.host
        try:
            try:
                out = await host.serve(p)
            except GatewayError as e:
                out = Outcome(e.status, [JSON_CT], body=e.body())
            assert out.body is not None
            now = host.clock.now()
            self.results[p.request_id] = (out.status, out.body, now, p.path)
            if host.durable is not None:
                # the result is written before the turn's row goes: a retry always finds one
                host.durable.result(p, out.status, out.body, now)
                host.durable.forget(p)
        finally:
            p.detached_done.set()

    async def retried(self, rid: str, req: TurnRequest) -> Outcome | None:
        """A request id seen before gets its kept result, takes over its held turn, or (with
        replicas) gets another replica's answer; ``None``: a request id not seen before."""
        out = await self.cached_outcome(rid, req)
        if out is not None:
            return out
        host = self.host
        p = host.by_request.get(rid)
        if p is None and host.replicas is not None:
            try:
                return await host.replicas.answered_elsewhere(rid, req)
            except TakenOver:
                p = host.by_request.get(rid)
        if p is None:
            return None
        if p.attached:
            raise GatewayError(409, f"request {rid!r} is already in progress",
                               code="duplicate_request")
        return await self._reattach(p, req)

    async def _reattach(self, p: PendingTurn, req: TurnRequest) -> Outcome:
        """A retried request id whose turn is held (restored after a restart, or its first
        client went away): this client takes it over, or waits for the result if the turn is
        already being served with no client."""
        if p.detached_done is not None:
            await p.detached_done.wait()
            out = await self.cached_outcome(p.request_id, req)
            if out is None:
                raise GatewayError(502, f"request {p.request_id!r} failed", type_="upstream_error")
            return out
        p.attached = True
        if req.stream != p.stream:
            p.stream = req.stream
            if req.stream:
                p.body = {**p.body, "stream": True, "stream_options": {"include_usage": True}}
                p.client_usage = False
            else:
                p.body = {k: v for k, v in p.body.items() if k != "stream_options"}
                p.body["stream"] = False
        if p.state == TurnState.READY and (p.waker is None or p.waker.done()):
            p.waker = asyncio.get_running_loop().create_future()
        return await self.run_kept(p)

    async def run_kept(self, p: PendingTurn, keep: bool = True) -> Outcome:
        """``host.run(p)`` with a state backend: a whole (non-streamed) answer is kept (and,
        with replicas, the turn marked done) before the answer goes out, so a gateway or
        replica that dies as it goes out leaves the answer, not a second run or a refusal, to
        the client's retry (on any replica, or after a restart); a turn over with no answer
        leaves no done mark (its retry is served). ``keep=False``: the client named no
        request id (it cannot retry by one): no answer is kept."""
        host = self.host
        durable = host.durable
        if durable is None:
            return await host.run(p)
        p.keep_answer = keep and not p.stream
        try:
            out = await host.run(p)
        except BaseException:
            if p.keep_answer:
                p.keep_answer = False
                if p.state == TurnState.DONE:  # not when it goes on with no client (adopted)
                    durable.forget(p)
            raise
        if p.keep_answer:
            p.keep_answer = False
            if out.events is None and out.body is not None:
                durable.answer(p, out.status, out.body, host.clock.now())
            else:
                durable.forget(p)
        if out.events is None and durable.backend.shared:
            # marked answered (and kept) before the answer goes out: a replica that dies now
            # leaves nothing for another to run again
            await durable.backend.flush()
        return out

    async def cached_outcome(self, rid: str, req: TurnRequest) -> Outcome | None:
        cached = self.results.get(rid)
        if cached is None and self.host.durable is not None:
            cached = await self.host.durable.backend.lookup_result(rid)
        if cached is None:
            return None
        status, body, _, path = cached
        out = cached_outcome(rid, status, body, path, req.stream)
        return out if out.events is None else await started(out)

    def expire(self, before_s: float) -> None:
        expired = [k for k, v in self.results.items() if v[2] < before_s]
        for k in expired:
            del self.results[k]
        if self.host.durable is not None:  # answers kept on their way out live there only
            self.host.durable.purge_results(before_s)
