"""The gateway driver: OpenAI requests in, the scheduler core in the middle, engines out.

A request is a turn becoming READY. The gateway feeds the *same* :class:`Scheduler` and policy
objects as the simulator, stamping events with a wall clock, and carries out the actions:

* ``Release(turn, engine, priority)`` wakes the request held for that turn (one future per
  turn), which is then forwarded to ``engine`` through its adapter: ``turn_started`` when
  forwarded, ``turn_first_token`` at the first streamed token, ``turn_finished`` with the
  engine's real ``usage.completion_tokens``.
* ``Retain(turn, engine, decision)`` is handed to the engine's adapter (pin / offload / discard).
* Policy timers: a loop callback calls ``scheduler.tick`` at ``next_wakeup``.

Sessions come from ``x-session-id`` (or the body's ``user``); a request without one is a fresh
one-turn session. A session runs one turn at a time: a second request of a busy session waits
(gateway-side, not READY yet) until the first finishes. Idle sessions are closed after
``session_idle_s`` (their flow time is then recorded).

Failures: an engine failing before anything was streamed to the client gets the turn
re-routed (the failed attempt is finished with 0 tokens and the turn made READY again, so the
routing policy, which now sees the engine down, picks another); after bytes were streamed the
client gets an SSE error event (the HTTP status was already sent). A client that goes away
cancels the upstream request; a held turn whose client went away is finished without running
when it is released. With a database, held turns survive a restart (see :mod:`.store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Any

from turnstile.core.clock import WallClock
from turnstile.core.scheduler import Action, Release, Scheduler
from turnstile.core.state import EngineLoad, TurnRecord, WorkflowRecord
from turnstile.gateway.adapters import (
    EngineAdapter,
    ForwardHints,
    UpstreamError,
    UpstreamHTTPError,
    make_adapter,
)
from turnstile.gateway.config import GatewayConfig, build_policies
from turnstile.gateway.metrics import GatewayMetrics
from turnstile.gateway.store import HeldTurnRow, SessionRow, Store
from turnstile.policies import PolicySet
from turnstile.workload.model import Turn

__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "Gateway", "GatewayError", "Outcome", "TurnRequest"]

log = logging.getLogger("turnstile.gateway")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_CT = (b"content-type", b"application/json")


class GatewayError(Exception):
    """An error answered to the client as an OpenAI-style JSON error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = list(headers)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type_: str, code: str | int | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode()


@dataclass(slots=True)
class TurnRequest:
    path: str
    body: dict[str, Any]
    stream: bool
    session_id: str | None = None
    request_id: str | None = None
    tenant: str = "default"
    #: ``x-turnstile-engine``: the engine the client asks for (only the ``hinted`` routing
    #: policy acts on it)
    engine_hint: str | None = None


@dataclass(slots=True)
class Outcome:
    """What to answer: a whole body, or a stream of SSE events (status already decided).

    A stream's generator is already started (its first event is ``first``), so closing it
    always runs its clean-up: whoever receives an Outcome with ``events`` must ``aclose`` it.
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes | None = None
    events: AsyncGenerator[bytes, None] | None = None
    first: bytes = b""


class _Session:
    __slots__ = ("active", "arrival_s", "attained_tokens", "context_tokens", "ephemeral", "id",
                 "in_scheduler", "last_active_s", "last_engine", "stored", "tenant", "turns",
                 "waiters")

    def __init__(self, sid: str, tenant: str, ephemeral: bool, now_s: float) -> None:
        self.id = sid
        self.tenant = tenant
        self.ephemeral = ephemeral
        self.arrival_s = now_s
        self.turns = 0  # finished turns
        self.context_tokens = 0  # prompt + output tokens of the last finished turn
        self.attained_tokens = 0
        self.last_engine: str | None = None
        self.last_active_s = now_s
        self.in_scheduler = False
        self.stored = False  # a row in the database
        self.active: _Pending | None = None
        self.waiters: deque[tuple[_Pending, asyncio.Future[None]]] = deque()

    def row(self) -> SessionRow:
        return SessionRow(self.id, self.tenant, self.arrival_s, self.ephemeral, self.turns,
                          self.context_tokens, self.attained_tokens, self.last_engine,
                          self.last_active_s)


# pending states
HELD, RELEASED, RUNNING, DONE = "held", "released", "running", "done"


class _Pending:
    """One accepted request, across its attempts."""

    __slots__ = ("attached", "body", "client_usage", "detached_done", "engine", "engine_hint",
                 "keep_result", "path", "persisted", "priority", "prompt_chars", "rec",
                 "request_id", "session", "state", "stream", "turn", "waker")

    def __init__(self, request_id: str, session: _Session, path: str, body: dict[str, Any],
                 stream: bool) -> None:
        self.request_id = request_id
        self.session = session
        self.path = path
        self.body = body
        self.stream = stream
        self.client_usage = False
        self.turn: Turn | None = None
        self.rec: TurnRecord | None = None
        self.state = HELD
        self.engine = ""
        self.engine_hint: str | None = None
        self.priority = 0.0
        self.attached = True  # a client is waiting for this turn
        self.keep_result = False  # serve and keep the result even with no client (restored)
        self.persisted = False
        self.prompt_chars = 0
        self.waker: asyncio.Future[None] | None = None
        #: set while the turn is served with no client attached (see Gateway._serve_detached)
        self.detached_done: asyncio.Event | None = None


class _Retry(Exception):
    """A forwarding attempt failed before anything reached the client."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _EngineState:
    up: bool = True
    next_check_s: float = 0.0
    failures: int = 0
    stats_counters: dict[str, float] = field(default_factory=dict)


class _OffsetClock:
    """The wall clock, continued across restarts from the origin kept in the database."""

    __slots__ = ("_wall", "offset_s")

    def __init__(self, offset_s: float = 0.0) -> None:
        self._wall = WallClock()
        self.offset_s = offset_s

    def now(self) -> float:
        return self._wall.now() + self.offset_s


def _prompt_chars(path: str, body: dict[str, Any]) -> int:
    if path == CHAT_PATH:
        n = 0
        for m in body.get("messages") or ():
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        n += len(part["text"])
            n += 16  # role and template tokens
        return n
    p = body.get("prompt")
    if isinstance(p, str):
        return len(p)
    if isinstance(p, list):
        return sum(len(x) if isinstance(x, str) else 4 for x in p)
    return 0


def _prompt_text(path: str, body: dict[str, Any]) -> str:
    if path == CHAT_PATH:
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                parts.append(m["content"])
        return "\n".join(parts)
    p = body.get("prompt")
    return p if isinstance(p, str) else ""


class Gateway:
    """The scheduling gateway (transport-free: :mod:`.app` puts it behind ASGI)."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        adapters: list[EngineAdapter] | None = None,
        policies: PolicySet | None = None,
    ) -> None:
        if adapters is None:
            config.validate()
            adapters = [
                make_adapter(e.url, e.kind, engine_id=e.name, api_key=e.api_key, weight=e.weight,
                             connect_timeout_s=config.connect_timeout_s,
                             read_timeout_s=config.read_timeout_s, options=e.options)
                for e in config.engines
            ]
        if not adapters:
            raise ValueError("the gateway needs at least one engine")
        self.config = config
        self.adapters: dict[str, EngineAdapter] = {a.id: a for a in adapters}
        if len(self.adapters) != len(adapters):
            raise ValueError(f"engine ids must be unique: {[a.id for a in adapters]}")
        self.policies = policies or build_policies(config.policy, config.policy_params)
        self.scheduler = Scheduler(
            self.policies,
            # ``kv_tokens`` (engine option): the KV capacity the release policy's KV gate needs
            [EngineLoad(a.id, int(a.options.get("kv_tokens", 0) or 0), weight=a.weight)
             for a in adapters],
            on_workflow_done=self._workflow_done,
            forget_finished=True,
        )
        self.metrics = GatewayMetrics()
        self.metrics.bind(self)
        self.clock = _OffsetClock()
        self.store: Store | None = None
        self.sessions: dict[str, _Session] = {}
        self.by_request: dict[str, _Pending] = {}
        self.by_rec: dict[TurnRecord, _Pending] = {}
        #: results of turns served with no client attached: request id → (status, body, at, path)
        self.results: dict[str, tuple[int, bytes, float, str]] = {}
        self.engines: dict[str, _EngineState] = {a: _EngineState() for a in self.adapters}
        self.session_queued = 0
        self.models: list[str] = list(config.models)
        #: engines whose adapter acts on retention decisions (others would only spawn no-ops)
        self._retainers = {a.id for a in adapters
                           if type(a).retain is not EngineAdapter.retain}
        self.started = False
        self._tokens_per_char = 0.25
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None

    # ================================================================== lifecycle
    @property
    def engine_up(self) -> dict[str, bool]:
        return {k: v.up for k, v in self.engines.items()}

    @property
    def queued(self) -> int:
        return self.scheduler.held_turns + self.session_queued

    async def start(self) -> None:
        if self.started:
            return
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(a.start() for a in self.adapters.values()),
                             return_exceptions=True)
        health = await asyncio.gather(*(a.health() for a in self.adapters.values()))
        for (eid, _), up in zip(self.adapters.items(), health, strict=True):
            self._set_health(eid, bool(up))
        if not self.models:
            found = await asyncio.gather(*(a.models() for a in self.adapters.values()))
            self.models = list(dict.fromkeys(m for ms in found for m in ms))
        if self.config.db:
            self.store = Store(self.config.db)
            self._restore()
        self.started = True
        for coro in (self._health_loop(), self._stats_loop(), self._sweep_loop()):
            self._spawn(coro)

    async def stop(self) -> None:
        self.started = False
        if self._wakeup is not None:
            self._wakeup.cancel()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(a.aclose() for a in self.adapters.values()),
                             return_exceptions=True)
        if self.store is not None:
            self.store.close()
            self.store = None

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gateway task failed", exc_info=task.exception())

    # ================================================================== requests
    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "'model' is required (a string)", code="missing_model")
        if self.models and model not in self.models:
            raise GatewayError(404, f"model {model!r} not found; available: "
                               f"{', '.join(self.models)}", code="model_not_found")

    async def handle(self, req: TurnRequest) -> Outcome:
        """Serve one chat/completions request (raises GatewayError for 4xx/5xx answers)."""
        rid = req.request_id
        if rid is not None:
            out = await self.cached_outcome(rid, req)
            if out is not None:
                return out
            p = self.by_request.get(rid)
            if p is not None:
                if p.attached:
                    raise GatewayError(409, f"request {rid!r} is already in progress",
                                       code="duplicate_request")
                return await self._reattach(p, req)
        else:
            rid = uuid.uuid4().hex
        if self.queued >= self.config.max_held:
            self.metrics.rejected.inc()
            raise GatewayError(429, f"the gateway holds {self.queued} turns (max_held="
                               f"{self.config.max_held}); retry later", type_="rate_limit_error",
                               code="queue_full", headers=[(b"retry-after", b"1")])
        now = self.clock.now()
        session = self._session(req, rid, now)
        body = req.body
        p = _Pending(rid, session, req.path, body, req.stream)
        p.engine_hint = req.engine_hint
        if req.stream:
            opts = body.get("stream_options")
            p.client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            if not p.client_usage:
                p.body = {**body, "stream_options": {**(opts if isinstance(opts, dict) else {}),
                                                     "include_usage": True}}
        self.by_request[rid] = p
        try:
            await self._acquire_session(p)
            turn = await self._estimate(p)
            self._ready(p, turn)
            return await self._run(p)
        except BaseException:
            if p.state == HELD and p.rec is None:  # never became READY
                self._forget(p)
            raise

    async def _reattach(self, p: _Pending, req: TurnRequest) -> Outcome:
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
        if p.state == HELD and (p.waker is None or p.waker.done()):
            p.waker = asyncio.get_running_loop().create_future()
        return await self._run(p)

    def _session(self, req: TurnRequest, rid: str, now: float) -> _Session:
        sid = req.session_id
        if sid is None:
            s = _Session("req-" + rid, req.tenant, True, now)
        else:
            s = self.sessions.get(sid)
            if s is not None:
                return s
            s = _Session(sid, req.tenant, False, now)
        self.sessions[s.id] = s
        return s

    async def _acquire_session(self, p: _Pending) -> None:
        s = p.session
        if s.active is None:
            s.active = p
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        s.waiters.append((p, fut))
        self.session_queued += 1
        try:
            await fut
        except asyncio.CancelledError:
            if s.active is p:
                self._pass_session(s)
            else:
                with contextlib.suppress(ValueError):
                    s.waiters.remove((p, fut))
            raise
        finally:
            self.session_queued -= 1

    def _pass_session(self, s: _Session) -> None:
        s.active = None
        while s.waiters:
            p, fut = s.waiters.popleft()
            if not fut.done():
                s.active = p
                fut.set_result(None)
                return

    async def _estimate(self, p: _Pending) -> Turn:
        s = p.session
        p.prompt_chars = _prompt_chars(p.path, p.body)
        prompt = max(1, math.ceil(p.prompt_chars * self._tokens_per_char))
        if self.config.tokenize:
            counted = await self._tokenize(_prompt_text(p.path, p.body))
            if counted is not None:
                prompt = max(1, counted)
        context = min(s.context_tokens, max(prompt - 1, 0))
        out = p.body.get("max_completion_tokens") or p.body.get("max_tokens")
        out = out if isinstance(out, int) and out > 0 else self.config.default_output_tokens
        return Turn(input_tokens=prompt - context, output_tokens=out, context_tokens=context)

    async def _tokenize(self, text: str) -> int | None:
        for eid, a in self.adapters.items():
            if self.engines[eid].up:
                return await a.tokenize(text)
        return None

    def _ready(self, p: _Pending, turn: Turn, ready_s: float | None = None) -> None:
        """The turn becomes READY in the scheduler (again, after a failed attempt)."""
        p.turn = turn
        s = p.session
        now = self.clock.now()
        if not s.in_scheduler:
            self.scheduler.open_session(now, s.id, s.tenant)
            s.in_scheduler = True
            wf = self.scheduler.workflows[s.id]
            if s.turns:  # restored after a restart: carry what the policies read
                wf.arrival_s = s.arrival_s
                wf.attained_tokens = s.attained_tokens
                if s.last_engine in self.adapters:
                    wf.last_engine = s.last_engine
        p.state = HELD
        p.waker = asyncio.get_running_loop().create_future()
        rec, actions = self.scheduler.turn_ready(now, s.id, turn, engine_hint=p.engine_hint)
        if ready_s is not None:
            rec.ready_s = ready_s
        p.rec = rec
        self.by_rec[rec] = p
        self._apply(actions)
        if p.state == HELD and self.store is not None and not p.persisted:
            self.store.put_held(HeldTurnRow(
                p.request_id, s.id, p.path, p.body, p.stream, rec.ready_s, turn.input_tokens,
                turn.context_tokens, turn.output_tokens), now)
            p.persisted = True
            self.store.put_session(s.row())
            s.stored = True

    async def _run(self, p: _Pending) -> Outcome:
        attempt = 0
        try:
            while True:
                if p.state == HELD:
                    assert p.waker is not None
                    await p.waker
                attempt += 1
                try:
                    return await self._forward(p)
                except _Retry as r:
                    self.metrics.turns_failed.labels(p.engine, "upstream").inc()
                    if attempt >= self.config.max_attempts:
                        self._apply(self._turn_over(p))
                        raise GatewayError(r.status, f"engine failed: {r}",
                                           type_="upstream_error", code="engine_failed") from None
                    self.metrics.turns_rerouted.inc()
                    await asyncio.sleep(min(0.05 * attempt, 0.5))
                    assert p.turn is not None
                    self._ready(p, p.turn)
        except asyncio.CancelledError:
            self._detach(p)
            raise

    def _detach(self, p: _Pending) -> None:
        """The client went away while the turn was held, released or being forwarded."""
        p.attached = False
        if p.state == HELD and (p.rec is None or p.rec not in self.by_rec):
            # between attempts (or never made READY): nothing in the scheduler to drop
            self._apply(self._turn_over(p))
        elif p.state == HELD:
            self.metrics.turns_cancelled.labels("held").inc()
            if not p.keep_result and p.persisted and self.store is not None:
                self.store.drop_turn(p.request_id)
                p.persisted = False
        elif p.state == RELEASED:
            if p.keep_result:
                self._serve_detached(p)
            else:
                self.metrics.turns_cancelled.labels("released").inc()
                self._apply(self._drop_released(p))

    # ================================================================== scheduler actions
    def _apply(self, actions: list[Action]) -> None:
        if not actions:
            self._schedule_wakeup()
            return
        queue = deque(actions)
        while queue:
            a = queue.popleft()
            if type(a) is Release:
                p = self.by_rec.get(a.turn)
                if p is None:  # not ours (cannot happen): finish it so nothing leaks
                    log.error("release of an unknown turn %r", a.turn)
                    continue
                p.state = RELEASED
                p.engine = a.engine
                p.priority = a.priority
                rec = a.turn
                self.metrics.released.labels(a.engine).inc()
                self.metrics.hold.observe(max(rec.released_s - rec.ready_s, 0.0))
                if p.persisted and self.store is not None and not p.keep_result:
                    self.store.drop_turn(p.request_id)
                    p.persisted = False
                if p.attached:
                    if p.waker is not None and not p.waker.done():
                        p.waker.set_result(None)
                    elif p.waker is None or p.waker.cancelled():
                        # its waiting task is being cancelled right now: _detach finishes it
                        pass
                elif p.keep_result:
                    self._serve_detached(p)
                else:
                    self.metrics.turns_cancelled.labels("held").inc()
                    queue.extend(self._drop_released(p))
            else:  # Retain
                adapter = self.adapters[a.engine]
                if (a.decision.action != "lru" and self.engines[a.engine].up
                        and a.engine in self._retainers):
                    self._spawn(adapter.retain(a.turn.workflow.id, a.decision, self.clock.now()))
        self._schedule_wakeup()

    def _drop_released(self, p: _Pending) -> list[Action]:
        """A released turn nobody wants any more: finish it without running it."""
        rec = p.rec
        assert rec is not None
        now = self.clock.now()
        self.scheduler.turn_started(now, rec.workflow_id, rec.index)
        actions = list(self.scheduler.turn_finished(now, rec.workflow_id, rec.index, 0))
        actions.extend(self._turn_over(p))
        return actions

    def _schedule_wakeup(self) -> None:
        now = self.clock.now()
        at = self.scheduler.next_wakeup(now)
        if at is None or self._loop is None:
            return
        if self._wakeup is not None and at >= self._wakeup_at - 1e-3:
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        self._wakeup_at = at
        self._wakeup = self._loop.call_later(max(at - now, 0.0), self._tick)

    def _tick(self) -> None:
        self._wakeup = None
        self._wakeup_at = math.inf
        self._apply(self.scheduler.tick(self.clock.now()))

    def _workflow_done(self, wf: WorkflowRecord) -> None:
        last = max((t.finished_s for t in wf.turns), default=-1.0)
        if last >= 0:
            self.metrics.flow.observe(max(last - wf.arrival_s, 0.0))

    # ================================================================== forwarding
    def _start_turn(self, p: _Pending) -> ForwardHints:
        rec = p.rec
        assert rec is not None
        self.scheduler.turn_started(self.clock.now(), rec.workflow_id, rec.index)
        p.state = RUNNING
        return ForwardHints(p.session.id, p.request_id, p.priority)

    def _headers(self, p: _Pending) -> list[tuple[bytes, bytes]]:
        rec = p.rec
        hold_ms = 0.0 if rec is None else max(rec.released_s - rec.ready_s, 0.0) * 1e3
        return [(b"x-request-id", p.request_id.encode()),
                (b"x-session-id", p.session.id.encode()),
                (b"x-turnstile-engine", p.engine.encode()),
                (b"x-turnstile-hold-ms", f"{hold_ms:.3f}".encode())]

    async def _forward(self, p: _Pending) -> Outcome:
        adapter = self.adapters[p.engine]
        hints = self._start_turn(p)
        try:
            await adapter.begin(hints)
        except BaseException:  # cancelled while restoring offloaded KV
            adapter.end(hints)
            self._finish(p, 0, None, cancelled=True)
            raise
        if p.stream:
            return await self._forward_stream(p, adapter, hints)
        try:
            resp = await adapter.complete(p.path, p.body, hints)
        except UpstreamHTTPError as e:
            adapter.end(hints)
            return self._http_error(p, e)
        except UpstreamError as e:
            adapter.end(hints)
            self._attempt_failed(p, e.engine_down, str(e))
            raise _Retry(str(e), 502 if e.engine_down else 504) from None
        except BaseException:
            adapter.end(hints)
            self._finish(p, 0, None, cancelled=True)
            raise
        adapter.end(hints)
        usage = None
        with contextlib.suppress(ValueError, AttributeError):
            usage = resp.json().get("usage")
        self._finish(p, _completion_tokens(usage), usage)
        return Outcome(resp.status, [(b"content-type", resp.content_type.encode()),
                                     *self._headers(p)], body=resp.body)

    def _http_error(self, p: _Pending, e: UpstreamHTTPError) -> Outcome:
        if e.status >= 500:
            self._attempt_failed(p, False, f"HTTP {e.status}")
            raise _Retry(f"engine {p.engine} answered HTTP {e.status}", e.status)
        # the engine refused the request itself (bad parameters, context overflow): pass it on
        self._finish(p, 0, None)
        return Outcome(e.status, [(b"content-type", e.content_type.encode()),
                                  *self._headers(p)], body=e.body)

    async def _forward_stream(self, p: _Pending, adapter: EngineAdapter,
                              hints: ForwardHints) -> Outcome:
        gen = adapter.stream_batches(p.path, p.body, hints)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            adapter.end(hints)
            self._attempt_failed(p, False, "empty stream")
            raise _Retry(f"engine {p.engine} closed the stream without data") from None
        except UpstreamHTTPError as e:
            adapter.end(hints)
            return self._http_error(p, e)
        except UpstreamError as e:
            adapter.end(hints)
            self._attempt_failed(p, e.engine_down, str(e))
            raise _Retry(str(e), 502 if e.engine_down else 504) from None
        except BaseException:
            await gen.aclose()
            adapter.end(hints)
            self._finish(p, 0, None, cancelled=True)
            raise
        return await _started(Outcome(200, [*SSE_HEADERS, *self._headers(p)],
                                      events=self._relay(p, adapter, hints, gen, first)))

    async def _relay(self, p: _Pending, adapter: EngineAdapter, hints: ForwardHints,
                     gen: AsyncGenerator[list[bytes], None], first: list[bytes]
                     ) -> AsyncGenerator[bytes, None]:
        """Pass the engine's events on (each burst in one write), watching for the first
        token and the usage; finishes the turn in the scheduler however the stream ends."""
        rec = p.rec
        assert rec is not None
        chunks = 0
        usage: dict[str, Any] | None = None
        got_token = False
        completed = False
        batch = first
        try:
            while True:
                out: list[bytes] = []
                for ev in batch:
                    forward = True
                    if ev.startswith(b"data: {"):
                        if not got_token or b'"usage"' in ev:
                            try:
                                obj = json.loads(ev[6:])
                            except ValueError:
                                obj = None
                            if isinstance(obj, dict):
                                choices = obj.get("choices")
                                if choices:
                                    chunks += 1
                                    if not got_token and _has_token(choices):
                                        got_token = True
                                        self.scheduler.turn_first_token(
                                            self.clock.now(), rec.workflow_id, rec.index)
                                u = obj.get("usage")
                                if isinstance(u, dict):
                                    usage = u
                                    if not choices and not p.client_usage:
                                        forward = False  # the usage chunk only we asked for
                        else:
                            chunks += 1
                    if forward:
                        out.append(ev)
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
                try:
                    batch = await gen.__anext__()
                except StopAsyncIteration:
                    completed = True
                    return
        except UpstreamError as e:
            self.metrics.turns_failed.labels(p.engine, "mid_stream").inc()
            if e.engine_down:
                self._set_health(p.engine, False)
            msg = f"engine {p.engine} failed mid-stream: {e}"
            yield b"data: " + error_body(msg, "upstream_error", 502) + b"\n\n"
        finally:
            await gen.aclose()
            adapter.end(hints)
            if p.state == RUNNING:
                out_tokens = _completion_tokens(usage)
                self._finish(p, out_tokens if out_tokens is not None else chunks, usage,
                             cancelled=not completed)

    def _attempt_failed(self, p: _Pending, engine_down: bool, reason: str) -> None:
        """Finish a failed attempt with 0 tokens; the caller re-readies the turn."""
        log.warning("turn %s on %s failed: %s", p.request_id, p.engine, reason)
        if engine_down:
            self._set_health(p.engine, False)
        rec = p.rec
        assert rec is not None
        self.by_rec.pop(rec, None)
        now = self.clock.now()
        p.state = HELD
        p.waker = None
        actions = self.scheduler.turn_finished(now, rec.workflow_id, rec.index, 0)
        self._apply(actions)

    def _finish(self, p: _Pending, output_tokens: int | None, usage: dict[str, Any] | None,
                *, cancelled: bool = False) -> None:
        rec = p.rec
        assert rec is not None
        now = self.clock.now()
        out = output_tokens if output_tokens is not None else 0
        actions = list(self.scheduler.turn_finished(now, rec.workflow_id, rec.index, out,
                                                    _cached_tokens(usage)))
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
            if p.prompt_chars > 0:
                ratio = prompt_real / p.prompt_chars
                self._tokens_per_char += 0.1 * (ratio - self._tokens_per_char)
        else:
            s.context_tokens = rec.prompt_tokens + out
        s.attained_tokens += rec.prompt_tokens + out
        actions.extend(self._turn_over(p))
        self._apply(actions)

    def _turn_over(self, p: _Pending) -> list[Action]:
        """The request is over: free its session for the next turn; returns actions."""
        p.state = DONE
        if p.rec is not None:
            self.by_rec.pop(p.rec, None)
        self._forget(p)
        s = p.session
        s.last_active_s = self.clock.now()
        actions: list[Action] = []
        if s.active is p:
            self._pass_session(s)
        if s.ephemeral and s.active is None:
            actions.extend(self._close(s))
        elif self.store is not None:
            self.store.put_session(s.row())
            s.stored = True
        return actions

    def _forget(self, p: _Pending) -> None:
        if self.by_request.get(p.request_id) is p:
            del self.by_request[p.request_id]
        if p.persisted and self.store is not None:
            self.store.drop_turn(p.request_id)
            p.persisted = False
        s = p.session
        if s.active is p and p.rec is None:
            self._pass_session(s)
        if s.ephemeral and s.active is None and not s.in_scheduler:
            self.sessions.pop(s.id, None)

    def _close(self, s: _Session) -> list[Action]:
        self.sessions.pop(s.id, None)
        if self.store is not None and s.stored:
            self.store.drop_session(s.id)
            s.stored = False
        if not s.in_scheduler:
            return []
        s.in_scheduler = False
        return list(self.scheduler.close_session(self.clock.now(), s.id))

    def _serve_detached(self, p: _Pending) -> None:
        if p.detached_done is None:
            p.detached_done = asyncio.Event()
            self._spawn(self._detached(p))

    async def _detached(self, p: _Pending) -> None:
        """Serve a restored turn nobody is waiting for; keep the result for a retry."""
        assert p.detached_done is not None
        body = {k: v for k, v in p.body.items() if k != "stream_options"}
        body["stream"] = False
        p.body = body
        p.stream = False
        attempt = 0
        try:
            while True:
                if p.state == HELD:
                    assert p.waker is not None
                    await p.waker
                attempt += 1
                try:
                    out = await self._forward(p)
                    break
                except _Retry as r:
                    if attempt >= self.config.max_attempts:
                        self._apply(self._turn_over(p))
                        out = Outcome(r.status, [JSON_CT],
                                      body=error_body(str(r), "upstream_error"))
                        break
                    await asyncio.sleep(0.05 * attempt)
                    assert p.turn is not None
                    self._ready(p, p.turn)
            assert out.body is not None
            now = self.clock.now()
            self.results[p.request_id] = (out.status, out.body, now, p.path)
            if self.store is not None:
                self.store.put_result(p.request_id, p.session.id, p.path, out.status, out.body,
                                      now)
        finally:
            p.detached_done.set()

    def _cached_outcome(self, rid: str, cached: tuple[int, bytes, float, str],
                        req: TurnRequest) -> Outcome:
        status, body, _, path = cached
        headers = [(b"x-request-id", rid.encode()), (b"x-turnstile-cached", b"1")]
        if not req.stream or status != 200:
            return Outcome(status, [JSON_CT, *headers], body=body)
        return Outcome(200, [*SSE_HEADERS, *headers],
                       events=_sse_from_response(path, json.loads(body)))

    async def cached_outcome(self, rid: str, req: TurnRequest) -> Outcome | None:
        cached = self.results.get(rid)
        if cached is None:
            return None
        out = self._cached_outcome(rid, cached, req)
        return out if out.events is None else await _started(out)

    # ================================================================== engines
    def _set_health(self, eid: str, up: bool) -> None:
        st = self.engines[eid]
        if st.up != up:
            log.warning("engine %s is %s", eid, "up" if up else "DOWN")
        st.up = up
        st.failures = 0 if up else st.failures + 1
        now = self.clock.now()
        st.next_check_s = now + (self.config.health_interval_s if up
                                 else self.config.recheck_interval_s)
        self._sync_health()

    def _sync_health(self) -> None:
        """Tell the scheduler which engines are up, never marking all of them down (routing
        needs one; a turn sent to a dead engine fails fast and is retried)."""
        view = self.scheduler.view
        now = self.clock.now()
        for eid, st in self.engines.items():
            if st.up and not view[eid].healthy:
                self._apply(self.scheduler.engine_stats(now, eid, healthy=True))
        for eid, st in self.engines.items():
            if not st.up and view[eid].healthy:
                if sum(1 for e in view.ids if view[e].healthy) <= 1:
                    continue
                self._apply(self.scheduler.engine_stats(now, eid, healthy=False))

    async def _check(self, eid: str) -> None:
        up = await self.adapters[eid].health()
        self._set_health(eid, up)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.recheck_interval_s, 0.5))
            now = self.clock.now()
            due = [eid for eid, st in self.engines.items() if st.next_check_s <= now]
            if due:
                await asyncio.gather(*(self._check(e) for e in due), return_exceptions=True)
                if not self.models and not self.config.models:
                    # no engine answered at start-up: learn the model names once one is up
                    for eid, st in self.engines.items():
                        if st.up and (names := await self.adapters[eid].models()):
                            self.models = names
                            break
            if self.scheduler.held_turns:  # policy timers are exact; this is a safety net
                self._tick()

    async def _stats_loop(self) -> None:
        interval = self.config.stats_interval_s
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            ids = [e for e, st in self.engines.items() if st.up]
            results = await asyncio.gather(*(self.adapters[e].stats() for e in ids),
                                           return_exceptions=True)
            now = self.clock.now()
            for eid, stats in zip(ids, results, strict=True):
                if stats is None or isinstance(stats, BaseException):
                    continue
                self.engines[eid].stats_counters = dict(stats.counters)
                self._apply(self.scheduler.engine_stats(
                    now, eid, queue_len=stats.queue_len, running=stats.running,
                    kv_used_frac=stats.kv_used_frac))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, max(self.config.session_idle_s / 4, 0.05)))
            self.sweep()

    def sweep(self) -> None:
        """Close idle sessions and drop expired results."""
        now = self.clock.now()
        idle = self.config.session_idle_s
        actions: list[Action] = []
        for s in list(self.sessions.values()):
            if s.active is None and not s.waiters and now - s.last_active_s > idle:
                actions.extend(self._close(s))
        if actions:
            self._apply(actions)
        ttl = self.config.result_ttl_s
        expired = [k for k, v in self.results.items() if now - v[2] > ttl]
        for k in expired:
            del self.results[k]
        if expired and self.store is not None:
            self.store.purge_results(now - ttl)

    # ================================================================== restart
    def _restore(self) -> None:
        store = self.store
        assert store is not None
        unix = time.time()
        origin = store.clock_origin(unix)
        self.clock = _OffsetClock(max(unix - origin, 0.0))
        for row in store.sessions():
            s = _Session(row.id, row.tenant, row.ephemeral, row.arrival_s)
            s.turns = row.turns
            s.context_tokens = row.context_tokens
            s.attained_tokens = row.attained_tokens
            s.last_engine = row.last_engine
            s.last_active_s = self.clock.now()
            s.stored = True
            self.sessions[s.id] = s
        self.results = store.results()
        for h in store.held():
            s = self.sessions.get(h.session_id)
            if s is None:
                s = _Session(h.session_id, "default", h.session_id.startswith("req-"), h.ready_s)
                self.sessions[s.id] = s
            if s.active is not None:
                store.drop_turn(h.request_id)
                continue
            p = _Pending(h.request_id, s, h.path, h.body, h.stream)
            p.attached = False
            p.keep_result = True
            p.persisted = True
            if h.stream:
                opts = h.body.get("stream_options")
                p.client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            s.active = p
            self.by_request[p.request_id] = p
            self._ready(p, Turn(h.input_tokens, h.output_tokens, h.context_tokens), h.ready_s)
        if self.sessions or self.results:
            log.warning("restored %d sessions, %d held turns, %d kept results",
                        len(self.sessions), len(self.by_request), len(self.results))


def _completion_tokens(usage: Any) -> int | None:
    if isinstance(usage, dict):
        n = usage.get("completion_tokens")
        if isinstance(n, int):
            return n
    return None


def _cached_tokens(usage: Any) -> int | None:
    """Prompt tokens the engine served from its prefix cache (OpenAI ``prompt_tokens_details``),
    which the release policy's KV-miss feedback (``cvar``) reads."""
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
    return None


def _has_token(choices: Any) -> bool:
    for c in choices:
        if not isinstance(c, dict):
            continue
        if c.get("text"):
            return True
        d = c.get("delta")
        if isinstance(d, dict) and (d.get("content") or d.get("tool_calls")
                                    or d.get("reasoning_content")):
            return True
    return False


async def _started(out: Outcome) -> Outcome:
    """Start a stream outcome's generator (see :class:`Outcome`)."""
    assert out.events is not None
    try:
        out.first = await out.events.__anext__()
    except StopAsyncIteration:
        out.first = b""
    return out


async def _sse_from_response(path: str, resp: dict[str, Any]) -> AsyncGenerator[bytes, None]:
    """A complete (non-streamed) response replayed as an OpenAI SSE stream."""
    base = {k: resp.get(k) for k in ("id", "created", "model") if k in resp}
    chat = path == CHAT_PATH
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    for ch in resp.get("choices") or ():
        idx = ch.get("index", 0)
        if chat:
            msg = ch.get("message") or {}
            delta = {"role": msg.get("role", "assistant"), "content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = msg["tool_calls"]
            first = {"index": idx, "delta": delta, "finish_reason": None}
            last = {"index": idx, "delta": {}, "finish_reason": ch.get("finish_reason")}
        else:
            first = {"index": idx, "text": ch.get("text", ""), "finish_reason": None}
            last = {"index": idx, "text": "", "finish_reason": ch.get("finish_reason")}
        for c in (first, last):
            yield b"data: " + json.dumps({**base, "choices": [c]}).encode() + b"\n\n"
    if resp.get("usage") is not None:
        yield (b"data: " + json.dumps({**base, "choices": [], "usage": resp["usage"]}).encode()
               + b"\n\n")
    yield b"data: [DONE]\n\n"
