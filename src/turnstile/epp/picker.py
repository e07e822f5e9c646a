"""The scheduler core as an endpoint picker: the gateway's service, with Envoy as the byte path.

:class:`Picker` is :class:`~turnstile.gateway.service.Gateway` — the same session resolution,
one-turn-at-a-time rule, holding queue, policies, health checks and ``/metrics`` scraping —
with its relay swapped for a :class:`RouteRelay`. Where ``serve`` forwards a released turn over
HTTP itself, the picker answers the data plane with the destination and then *watches* the
response the data plane streams back through ext_proc:

1. :meth:`Picker.submit` turns one request into an :class:`Exchange` and starts the gateway's
   ``handle`` on it (session, estimate, READY; the release policy may hold it);
2. on release, :meth:`RouteRelay.forward` runs the adapter's ``begin``/``prepare`` (llama.cpp:
   the session's slot, ``id_slot`` and ``cache_prompt`` in the body) and resolves
   ``Exchange.route``: the ext_proc server answers Envoy with ``x-gateway-destination-endpoint``
   (plus fallbacks), and the body when the adapter changed it;
3. the response's status, events and end come back as :meth:`Exchange.response_headers` /
   :meth:`Exchange.response_body`; the relay reports first token and finish (with the engine's
   ``usage``, and the reply for conversation-derived sessions) to the scheduler as ``serve``
   does.

Failures are the data plane's to retry (its retry policy walks the fallback list); the picker
learns what happened from the response: a 5xx marks the picked engine down (the health loop
brings it back), an answer served by another endpoint than the one picked (the
``x-gateway-destination-endpoint-served`` response header) marks the picked one down and moves
the session's KV to the one that served. An engine's own 4xx (bad request, context overflow)
finishes the turn with no tokens, and a session opened by that request is closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from turnstile.core.state import TurnState, set_kv_slots
from turnstile.gateway.adapters import EngineAdapter, ForwardHints, make_adapter, split_sse
from turnstile.gateway.config import GatewayConfig
from turnstile.gateway.health import EngineState
from turnstile.gateway.identity import Identity
from turnstile.gateway.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    GatewayError,
    Outcome,
    TurnRequest,
    collect_delta,
    collect_message,
    completion_tokens,
    has_token,
)
from turnstile.gateway.service import Gateway
from turnstile.gateway.sessions import PendingTurn
from turnstile.gateway.signals import engine_loads
from turnstile.policies import PolicySet
from turnstile.workload.model import Turn

__all__ = ["SERVED_HEADER", "Exchange", "Picker", "Route", "RouteRelay", "SubsetRouting",
           "endpoint_of"]

log = logging.getLogger("turnstile.epp")

SERVED_HEADER = "x-gateway-destination-endpoint-served"


def endpoint_of(adapter: EngineAdapter) -> str:
    """The ``ip:port`` the data plane connects to for this engine."""
    return httpx.URL(adapter.base_url).netloc.decode()


@dataclass(slots=True)
class Route:
    engine: str
    endpoint: str
    #: other ready endpoints, in the order the data plane should try them after a failure
    fallbacks: list[str]
    #: the request body to send instead of the client's (None: unchanged)
    body: bytes | None


@dataclass
class Exchange:
    """One request between the data plane and the picker."""

    request_id: str
    path: str
    stream: bool
    #: endpoints the data plane allows for this request (``…-endpoint-subset``); None: all
    subset: set[str] | None = None
    route: asyncio.Future[Route] = field(default_factory=lambda: asyncio.get_running_loop()
                                         .create_future())
    #: set when the response is over (or the data plane went away): True = complete
    done: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop()
                                       .create_future())
    task: asyncio.Task[Outcome] | None = None
    pending: PendingTurn | None = None
    #: the relay's end of the turn, run synchronously when the response is over
    on_over: Callable[[bool], None] | None = None
    #: an observing filter reports this request's response (``watch=observe``)
    watched: bool = False
    status: int = 0
    served: str | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0
    got_token: bool = False
    _buf: bytearray = field(default_factory=bytearray)
    _whole: bytearray = field(default_factory=bytearray)

    # ---------------------------------------------------------------- data plane events
    def response_headers(self, status: int, served: str | None) -> None:
        self.status = status
        self.served = served

    def response_body(self, chunk: bytes, end: bool, picker: Picker) -> None:
        p = self.pending
        if p is not None and self.status == 200:
            if self.stream:
                self._buf += chunk
                for ev in split_sse(self._buf):
                    self._event(ev, p, picker)
            else:
                self._whole += chunk
        if end:
            if self._buf and p is not None and self.status == 200:
                self._buf += b"\n\n"
                for ev in split_sse(self._buf):
                    self._event(ev, p, picker)
            if self._whole and p is not None:
                self._whole_body(p)
            self.finish(True)

    def finish(self, complete: bool) -> None:
        if self.done.done():
            return
        over, self.on_over = self.on_over, None
        try:
            if over is not None:
                over(complete)
        except Exception:  # never into the data plane's stream
            log.exception("finishing request %s failed", self.request_id)
        self.done.set_result(complete)

    def _event(self, ev: bytes, p: PendingTurn, picker: Picker) -> None:
        if not ev.startswith(b"data: {"):
            return
        reply = p.reply_text
        if self.got_token and reply is None and b'"usage"' not in ev:
            self.chunks += 1
            return
        try:
            obj = json.loads(ev[6:])
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        choices = obj.get("choices")
        if choices:
            self.chunks += 1
            if not self.got_token and has_token(choices):
                self.got_token = True
                if p.state == TurnState.RUNNING:
                    picker.turn_first_token(p)
            if reply is not None:
                collect_delta(choices, reply, p.reply_args if p.reply_args is not None else [])
        u = obj.get("usage")
        if isinstance(u, dict):
            self.usage = u

    def _whole_body(self, p: PendingTurn) -> None:
        try:
            obj = json.loads(bytes(self._whole))
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        u = obj.get("usage")
        self.usage = u if isinstance(u, dict) else None
        if p.reply_text is not None and p.reply_args is not None:
            with contextlib.suppress(KeyError, IndexError, TypeError, AttributeError):
                collect_message(obj, p.reply_text, p.reply_args)


class SubsetRouting:
    """The policy's routing, kept inside the data plane's endpoint subset: a choice outside it
    becomes the allowed engine with the least outstanding work."""

    def __init__(self, inner: Any, allowed: dict[str, set[str]]) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", "routing")
        self.allowed = allowed

    def __getattr__(self, item: str) -> Any:  # the policy's hooks pass through
        return getattr(self.inner, item)

    def route(self, turn: Any, view: Any, now: float) -> str:
        engine = self.inner.route(turn, view, now)
        allowed = self.allowed.get(turn.workflow.id)
        if not allowed or engine in allowed:
            return engine
        ok = [e for e in allowed if e in view and view[e].healthy]
        if not ok:
            return engine
        return min(ok, key=lambda e: (view[e].outstanding_tokens, e))


class RouteRelay:
    """The gateway's relay for a picker: a released turn is answered to the data plane with its
    destination, then followed through the response the data plane reports."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.exchanges: dict[str, Exchange] = {}

    async def forward(self, p: PendingTurn) -> Outcome:
        pk = self.picker
        ex = self.exchanges.get(p.request_id)
        if ex is None or ex.route.done():  # not a data plane request: nothing can carry it
            raise GatewayError(503, "no data plane request to route", type_="upstream_error")
        ex.pending = p
        pk.allowed.pop(p.session.id, None)
        adapter = pk.adapters[p.engine]
        hints = pk.turn_started(p)
        try:
            await adapter.begin(hints)
        except BaseException:
            self._end(adapter, hints)
            pk.turn_finished(p, 0, None, cancelled=True)
            raise
        body = adapter.prepare(p.body, hints)
        raw = None if body is p.body or body == p.body else json.dumps(body).encode()
        ex.route.set_result(Route(p.engine, pk.endpoint[p.engine],
                                  pk.fallbacks(p.engine, ex.subset), raw))
        outcome: list[Outcome] = []

        def over(complete: bool) -> None:
            # run inside the data plane's last event, before the picker answers it: the turn is
            # booked (and the session free) before the client has the response's last byte
            self._end(adapter, hints)
            outcome.append(self._over(p, ex, complete))

        ex.on_over = over
        try:
            await ex.done
        except BaseException:
            if not outcome:
                ex.on_over = None
                self._end(adapter, hints)
                pk.turn_finished(p, 0, None, cancelled=True)
            raise
        return outcome[0]

    def _end(self, adapter: EngineAdapter, hints: ForwardHints) -> None:
        hints.now_s = self.picker.clock.now()
        adapter.end(hints)

    def _over(self, p: PendingTurn, ex: Exchange, complete: bool) -> Outcome:
        pk = self.picker
        picked = p.engine
        served = pk.engine_at(ex.served) if ex.served else None
        if served is not None and served != picked:
            # the data plane's retry went down the fallback list: the picked engine failed
            pk.metrics.turns_failed.labels(picked, "fallback").inc()
            pk.engine_failed(picked)
            p.engine = served
        status = ex.status
        if not complete:
            pk.turn_finished(p, completion_tokens(ex.usage), ex.usage, cancelled=True)
        elif status >= 500 or status == 0:
            pk.metrics.turns_failed.labels(picked, f"http_{status}").inc()
            if served is None or served == picked:
                pk.engine_failed(picked)
            pk.turn_finished(p, 0, None, cancelled=True)
        elif status >= 400:
            # the engine refused the request itself: nothing ran, and a session this request
            # opened is not a session
            pk.refused(p)
            pk.turn_finished(p, 0, None, cancelled=True)
        else:
            out = completion_tokens(ex.usage)
            pk.turn_finished(p, out if out is not None else ex.chunks, ex.usage)
            if served is not None and served != picked:
                pk.session_served_on(p, served)
        return Outcome(status or 502, [], body=b"")


class Picker(Gateway):
    """The gateway's scheduling service driven by a data plane (see the module docstring)."""

    def __init__(self, config: GatewayConfig, *, adapters: list[EngineAdapter] | None = None,
                 policies: PolicySet | None = None, max_fallbacks: int = 0) -> None:
        super().__init__(config, adapters=adapters, policies=policies)
        #: fallback endpoints listed after the picked one (0 for an ORIGINAL_DST cluster,
        #: which reads one address)
        self.max_fallbacks = max_fallbacks
        self.routes = RouteRelay(self)
        self.relay = self.routes  # type: ignore[assignment]
        #: engines a session's READY turn may go to (the data plane's endpoint subset)
        self.allowed: dict[str, set[str]] = {}
        self.scheduler.routing = SubsetRouting(self.scheduler.routing, self.allowed)
        self._rr = 0
        #: engine id → its ``ip:port`` (parsed once: this is on every request's path)
        self.endpoint = {a.id: endpoint_of(a) for a in self.adapters.values()}
        self.by_endpoint = {ep: eid for eid, ep in self.endpoint.items()}
        self.removed: set[str] = set()

    # ---------------------------------------------------------------- endpoints
    def engine_at(self, endpoint: str) -> str | None:
        return self.by_endpoint.get(endpoint.strip())

    def ready_endpoints(self, subset: set[str] | None = None) -> list[str]:
        up = self.health.engines
        return [ep for eid, ep in self.endpoint.items()
                if up[eid].up and eid not in self.removed and (subset is None or ep in subset)]

    def fallbacks(self, engine: str, subset: set[str] | None) -> list[str]:
        if self.max_fallbacks <= 0:
            return []
        primary = self.endpoint[engine]
        return [ep for ep in self.ready_endpoints(subset) if ep != primary][:self.max_fallbacks]

    def any_endpoint(self, subset: set[str] | None) -> str | None:
        """A ready endpoint for a request the scheduler does not see (``/v1/models``, …)."""
        eps = self.ready_endpoints(subset)
        if not eps:
            return None
        self._rr += 1
        return eps[self._rr % len(eps)]

    async def set_endpoints(self, endpoints: Iterable[str], kind: str = "llama.cpp") -> None:
        """The pool's endpoints now (an InferencePool's pods): new ones join the scheduler,
        missing ones are drained (what runs there finishes; nothing new goes there)."""
        want = list(dict.fromkeys(e.strip() for e in endpoints if e.strip()))
        now = self.clock.now()
        for ep in want:
            eid = self.by_endpoint.get(ep)
            if eid is not None:
                if eid in self.removed:
                    self.removed.discard(eid)
                    self.apply(self.scheduler.engine_stats(now, eid, healthy=True))
                    self.scheduler.view[eid].accepting = True
                continue
            a = make_adapter(f"http://{ep}", kind, connect_timeout_s=self.config.connect_timeout_s,
                             read_timeout_s=self.config.read_timeout_s)
            await self.add_engine(a)
        for ep, eid in list(self.by_endpoint.items()):
            if ep not in want and eid not in self.removed:
                self.removed.add(eid)
                self.scheduler.drain_engine(now, eid)
                log.warning("endpoint %s left the pool", ep)

    async def add_engine(self, a: EngineAdapter) -> None:
        """A new endpoint joins: its adapter, health state and the scheduler's view."""
        self.adapters[a.id] = a
        self.endpoint[a.id] = endpoint_of(a)
        self.by_endpoint[self.endpoint[a.id]] = a.id
        self.health.engines[a.id] = EngineState(up=False)
        self.driver.engine_added(a)
        await a.start()
        (load,) = engine_loads([a], [])
        self.apply(self.scheduler.add_engine(self.clock.now(), load))
        slots = getattr(a, "slots", None)
        if slots:
            set_kv_slots(self.scheduler.view[a.id], len(slots))
        self.health.set_health(a.id, bool(await a.health()))
        log.warning("endpoint %s joined the pool", self.endpoint[a.id])

    # ---------------------------------------------------------------- requests
    def submit(self, ident: Identity, path: str, body: dict[str, Any],
               subset: set[str] | None) -> Exchange:
        """Start scheduling one request; its route (or GatewayError) comes on the exchange."""
        rid = uuid.uuid4().hex
        stream = body.get("stream", False) is True
        ex = Exchange(rid, path, stream, subset)
        if not self.ready_endpoints(subset):
            where = "" if subset is None else " in the requested subset"
            raise GatewayError(503, f"no ready endpoint{where}", type_="upstream_error",
                               code="no_endpoint")
        self.check_model(body)
        recorder = self.recorder
        if recorder is not None and ident.session_id:
            if ident.parent_session:
                recorder.note_parent(ident.session_id, ident.parent_session)
            if ident.session_end:
                recorder.note_end(ident.session_id)
        req = TurnRequest(path, body, stream, ident.session_id, rid, ident.tenant,
                          ident.engine_hint)
        self.routes.exchanges[rid] = ex
        ex.task = asyncio.ensure_future(self._handle(req, ex))
        return ex

    async def _handle(self, req: TurnRequest, ex: Exchange) -> Outcome:
        try:
            return await self.handle(req)
        finally:
            self.routes.exchanges.pop(ex.request_id, None)

    def make_ready(self, p: PendingTurn, turn: Turn, ready_s: float | None = None) -> None:
        ex = self.routes.exchanges.get(p.request_id)
        if ex is not None and ex.subset is not None:
            self.allowed[p.session.id] = {e for ep, e in self.by_endpoint.items()
                                          if ep in ex.subset}
        super().make_ready(p, turn, ready_s)

    def refused(self, p: PendingTurn) -> None:
        """The engine refused the session's first request: the session never existed."""
        s = p.session
        if s.turns == 0 and not s.waiters:
            s.ephemeral = s.refused = True  # closed once the turn is over (no flow time kept)

    def session_served_on(self, p: PendingTurn, engine: str) -> None:
        s = p.session
        s.last_engine = engine
        if s.in_scheduler and engine in self.scheduler.view:
            self.scheduler.session_moved(s.id, engine, s.attained_tokens)


def is_scheduled(method: str, path: str) -> bool:
    """Requests the scheduler sees: completions POSTs (others are routed to any endpoint)."""
    return method == "POST" and path.split("?", 1)[0] in (CHAT_PATH, COMPLETIONS_PATH)
