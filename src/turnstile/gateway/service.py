"""The gateway driver: OpenAI requests in, the scheduler core in the middle, engines out.

A request is a turn becoming READY. The gateway feeds the *same* :class:`Scheduler` and policy
objects as the simulator, stamping events with a wall clock, and carries out the actions:

* ``Release(turn, engine, priority)`` wakes the request held for that turn (one future per
  turn), which is then forwarded to ``engine`` (:mod:`.relay`): ``turn_started`` when forwarded,
  ``turn_first_token`` at the first streamed token, ``turn_finished`` with the engine's real
  ``usage.completion_tokens`` (a turn's state changes and their bookkeeping: :mod:`.turns`).
* ``Retain(turn, engine, decision)`` is handed to the engine's adapter (pin / offload / discard).
* Policy timers: a loop callback calls ``scheduler.tick`` at ``next_wakeup`` (:mod:`.driving`).

Sessions come from ``x-session-id`` (or the body's ``user``), else from the conversation itself
(:mod:`.affinity`); a session runs one turn at a time (:mod:`.sessions`). Idle sessions are closed
after ``session_idle_s`` (their flow time is then recorded).

Failures: an engine failing before anything was streamed to the client gets the turn re-routed
by the one retry loop (:meth:`Gateway.serve`): the failed attempt is finished with 0 tokens and
the turn made READY again, so the routing policy, which now sees the engine down, picks another.
After bytes were streamed the client gets an SSE error event. A client that goes away cancels the
upstream request; a held turn whose client went away is finished without running when it is
released. With a state backend, held turns survive a restart (:mod:`.durability`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from turnstile.core.actions import Action
from turnstile.core.scheduler import Scheduler
from turnstile.core.session_idle import idle_expired
from turnstile.core.state import TurnState, set_kv_slots
from turnstile.gateway.adapters import EngineAdapter, make_adapter
from turnstile.gateway.affinity import (
    ConversationKeys,
    KeyStore,
    LocalKeyStore,
)
from turnstile.gateway.config import GatewayConfig
from turnstile.gateway.driving import ReleaseDriver
from turnstile.gateway.durability import Durability, OffsetClock
from turnstile.gateway.engine_check import check_engines, check_kinds, max_model_lens
from turnstile.gateway.estimate import TokenEstimator
from turnstile.gateway.health import HealthMonitor
from turnstile.gateway.logs import quiet_probe_logs
from turnstile.gateway.metrics import GatewayMetrics
from turnstile.gateway.overload import shed
from turnstile.gateway.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    GatewayError,
    Outcome,
    TurnRequest,
)
from turnstile.gateway.recorder import SessionRecorder
from turnstile.gateway.recovery import Recovery
from turnstile.gateway.relay import Relay, RetryableFailure
from turnstile.gateway.replicas import ReplicaSync
from turnstile.gateway.resolve import SessionResolver, one_turn
from turnstile.gateway.sessions import PendingTurn, SessionTable, sweep_period_s
from turnstile.gateway.shared import RedisState
from turnstile.gateway.signals import engine_loads
from turnstile.gateway.store import HeldTurnRow, SessionRow, StateBackend, Store
from turnstile.gateway.turns import TurnLifecycle
from turnstile.policies import PolicySet
from turnstile.transport.retry import RetryRule

__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "Gateway", "GatewayError", "Outcome", "TurnRequest"]

log = logging.getLogger("turnstile.gateway")
#: the wait before a failed turn is made READY again (the one retry rule's backoff; its
#: number of further attempts is the config's max_attempts - 1: :meth:`Gateway.reroute_rule`)
_REROUTE_BACKOFF_S, _REROUTE_MAX_BACKOFF_S = 0.05, 0.5

PENDING, READY, RELEASED = TurnState.PENDING, TurnState.READY, TurnState.RELEASED


class Gateway(TurnLifecycle):
    """The scheduling gateway (transport-free: :mod:`.app` puts it behind ASGI)."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        adapters: list[EngineAdapter] | None = None,
        policies: PolicySet | None = None,
        backend: StateBackend | None = None,
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
        self.policies = policies or PolicySet.from_spec(config.policy, config.policy_params)
        self.scheduler = Scheduler(
            self.policies,
            engine_loads(adapters, config.engines),
            on_workflow_done=self._workflow_done,
            forget_finished=True,
        )
        self.metrics = GatewayMetrics()
        self.metrics.bind(self)
        self.clock = OffsetClock()
        self._backend = backend
        self.durable: Durability | None = None
        self.table = SessionTable()
        self.sessions = self.table.sessions
        self.by_request: dict[str, PendingTurn] = {}
        self.health = HealthMonitor(self.adapters, self.scheduler, config, self.clock.now,
                                    self.apply)
        self.driver = ReleaseDriver(self)
        self.relay = Relay(self.adapters, self, self.metrics, self.clock.now)
        self.recovery = Recovery(self)
        self.estimator = TokenEstimator(config.default_output_tokens,
                                        self._tokenize if config.tokenize else None)
        #: conversation-derived sessions (requests naming none); set up in start()
        self.keys: ConversationKeys | None = None
        #: the replica's link to the others (a shared state backend only)
        self.replicas: ReplicaSync | None = None
        self.resolver = SessionResolver(self.table, self.scheduler, self.clock.now, None, None)
        #: ``--record``: finished sessions appended to a workload file (set up in start())
        self.recorder: SessionRecorder | None = None
        self.started = False
        #: engine → feature the policies need → the warning logged, or None (see engine_check)
        self.engine_config: dict[str, dict[str, str | None]] = {}
        self.engine_max_model_len: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: requests accepted and not READY yet (counted by admission from their acceptance)
        self.admitting = 0

    # ================================================================== lifecycle
    @property
    def engine_up(self) -> dict[str, bool]:
        return {k: v.up for k, v in self.health.engines.items()}

    @property
    def models(self) -> list[str]:
        return self.health.models

    @property
    def session_queued(self) -> int:
        return self.table.queued

    @property
    def queued(self) -> int:
        """Accepted, not released: held, or being admitted (``max_held``, :mod:`.overload`)."""
        return self.scheduler.held_turns + self.admitting

    @property
    def inflight(self) -> int:
        """Accepted, not answered: ``queued`` plus turns on engines (``max_inflight``)."""
        sched = self.scheduler  # this replica's own turns on engines, not its peers'
        return self.queued + sum(sched.own_load(e)[0] for e in sched.view.ids)

    async def start(self) -> None:
        if self.started:
            return
        quiet_probe_logs()
        self.driver.bind_loop(asyncio.get_running_loop())
        await asyncio.gather(*(a.start() for a in self.adapters.values()),
                             return_exceptions=True)
        await asyncio.gather(*(a.check_config() for a in self.adapters.values()),
                             return_exceptions=True)
        self.engine_config = check_engines(self.policies, self.adapters)
        for eid, warning in (await check_kinds(self.adapters)).items():
            self.engine_config[eid]["kind"] = warning
        self.engine_max_model_len = max_model_lens(self.adapters)
        for a in self.adapters.values():
            slots = getattr(a, "slots", None)  # llama.cpp: the slots the server reported
            if slots and a.id in self.scheduler.view:
                set_kv_slots(self.scheduler.view[a.id], len(slots))
        await self.health.check_all()
        cfg = self.config
        if cfg.record:
            self.recorder = SessionRecorder(cfg.record, background=True)
            self.recorder.bind_clock(self.clock.now())
            self.recorder.create()  # there at once, with its header
        backend = self._backend
        if backend is None and cfg.state:
            backend = RedisState(cfg.state, replica_id=cfg.replica_id,
                                 replica_ttl_s=cfg.replica_ttl_s, result_ttl_s=cfg.result_ttl_s)
        elif backend is None and cfg.db:
            backend = Store(cfg.db)
        if backend is not None:
            await backend.open()
            self.durable = Durability(backend)
            self.recovery.restore()
        keys = None
        if cfg.derive_sessions:
            store: KeyStore = LocalKeyStore()
            if isinstance(backend, RedisState):
                store = backend
            keys = ConversationKeys(store, shared=store is backend)
        if isinstance(backend, RedisState):
            self.replicas = ReplicaSync(self, backend, self.clock.now, sync_s=cfg.peer_sync_s,
                                        wait_s=cfg.read_timeout_s)
            self.spawn(self.replicas.loop())
            self.spawn(self.replicas.beat_loop())
        self.keys = keys
        self.resolver = SessionResolver(self.table, self.scheduler, self.clock.now, keys,
                                        self.replicas, self.metrics)
        self.started = True
        self.spawn(self.health.health_loop(self.driver.safety_tick))
        self.spawn(self.health.stats_loop())
        if cfg.stall_probe_s > 0:
            self.spawn(self.health.stall_loop())
        self.spawn(self._sweep_loop())

    async def stop(self) -> None:
        self.started = False
        self.driver.stop()
        if self.replicas is not None:
            self.replicas.stop()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(a.aclose() for a in self.adapters.values()),
                             return_exceptions=True)
        if self.durable is not None:
            await self.durable.backend.aclose()
            self.durable = None
        if self.recorder is not None:
            self.recorder.close()  # open sessions are written as they stand
            self.recorder = None

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gateway task failed", exc_info=task.exception())

    # the service's public face to its helpers (driving, recovery, replicas, health: each
    # declares what it uses as a Protocol): apply, make_ready and the turn events
    # (:class:`.turns.TurnLifecycle`), serve, run, spawn and the rest
    def adopt(self, h: HeldTurnRow, session: SessionRow | None = None) -> None:
        self.recovery.adopt(h, session)

    def serve_detached(self, p: PendingTurn) -> None:
        self.recovery.serve_detached(p)

    async def cached_outcome(self, rid: str, req: TurnRequest) -> Outcome | None:
        return await self.recovery.cached_outcome(rid, req)

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
            out = await self.recovery.retried(rid, req)
            if out is not None:
                return out
        else:
            rid = uuid.uuid4().hex
        shed(self)  # 429 past max_held / max_inflight
        self.admitting += 1  # counted from acceptance: a burst cannot all pass the check
        try:
            session, derived = await self.resolver.session(req, rid)
        except BaseException:
            self.admitting -= 1
            raise
        body = req.body
        p = PendingTurn(rid, session, req.path, body, req.stream)
        if derived is not None:
            p.reply_text, p.reply_args = [], []
            p.conversation = (derived.chain, derived.root)
            # no tools, no earlier reply: nothing may follow. Such a turn leaves the scheduler
            # with its turn (it holds no slot, budget or paused KV past its own life); the
            # session itself stays, so a follow-up found through its keys continues it
            session.ephemeral = derived.new and one_turn(body)
        p.engine_hint = req.engine_hint
        p.probe = req.probe
        p.ends_session = req.session_end
        if req.stream:
            opts = body.get("stream_options")
            p.client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            if not p.client_usage:
                p.body = {**body, "stream_options": {**(opts if isinstance(opts, dict) else {}),
                                                     "include_usage": True}}
        self.by_request[rid] = p
        try:
            await self.table.acquire(p)
            turn, p.prompt_chars = await self.estimator.estimate(p.path, p.body,
                                                                 session.context_tokens)
            self.admitting -= 1
            self.make_ready(p, turn)
            if self.durable is not None and self.durable.backend.shared:
                # another replica serves it if this one dies (written in the next batch, not
                # waited for: until then its client's retry is what serves it elsewhere)
                self.durable.accepted(p)
            return await self.recovery.run_kept(p, keep=req.request_id is not None)
        except BaseException:
            if p.state == PENDING and p.rec is None:  # never became READY
                if p.turn is None:
                    self.admitting -= 1
                self._forget(p)
            raise

    async def _tokenize(self, text: str) -> int | None:
        for eid, a in self.adapters.items():
            if self.health.up(eid):
                return await a.tokenize(text)
        return None

    def reroute_rule(self) -> RetryRule:
        """The retry rule of :meth:`serve`: ``max_attempts`` sends in all, waiting
        ``min(0.05 s × attempt, 0.5 s)`` before each re-route."""
        return RetryRule(retries=self.config.max_attempts - 1, backoff_s=_REROUTE_BACKOFF_S,
                         max_backoff_s=_REROUTE_MAX_BACKOFF_S)

    async def serve(self, p: PendingTurn) -> Outcome:
        """The one retry loop: wait for release, forward, and on a failure before anything
        reached the client re-ready the turn (the routing policy then sees the engine down),
        up to ``max_attempts``."""
        rule = self.reroute_rule()
        attempt = 0
        while True:
            if p.state == READY:
                assert p.waker is not None
                await p.waker
            try:
                return await self.relay.forward(p)
            except RetryableFailure as r:
                self.metrics.turns_failed.labels(p.engine, "upstream").inc()
                if not rule.again(attempt):
                    self.apply(self._turn_over(p))
                    raise GatewayError(r.status, f"engine failed: {r}",
                                       type_="upstream_error", code="engine_failed") from None
                attempt += 1
                self.metrics.turns_rerouted.inc()
                await asyncio.sleep(rule.delay_s(attempt))
                assert p.turn is not None
                self.make_ready(p, p.turn)

    async def run(self, p: PendingTurn) -> Outcome:
        """:meth:`serve`, detaching the turn when its client goes away (cancellation)."""
        try:
            return await self.serve(p)
        except asyncio.CancelledError:
            self._detach(p)
            raise

    def _detach(self, p: PendingTurn) -> None:
        """The client went away while the turn was held, released or being forwarded."""
        p.attached = False
        if p.state == PENDING:
            # between attempts (or never made READY): nothing in the scheduler to drop
            self.apply(self._turn_over(p))
        elif p.state == READY and p.keep_result:
            self.metrics.turns_cancelled.labels("held").inc()  # served when released
        elif p.state == READY:
            # dropped at once: it stops counting toward max_held and, with its session's only
            # request gone, the session stops occupying the gate
            self.metrics.turns_cancelled.labels("held").inc()
            rec = p.rec
            assert rec is not None
            actions = self.scheduler.withdraw(self.clock.now(), rec.workflow_id, rec.index)
            actions.extend(self._turn_over(p))
            s = p.session
            if s.turns == 0 and s.active is None and not s.waiters and s.id in self.sessions:
                actions.extend(self._close(s))
            self.apply(actions)
        elif p.state == RELEASED:
            if p.keep_result:
                self.serve_detached(p)
            else:
                self.metrics.turns_cancelled.labels("released").inc()
                self.apply(self.drop_released(p))

    # ================================================================== housekeeping
    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(sweep_period_s(self.config.session_idle_s))
            self.sweep()

    def sweep(self) -> None:
        """Close idle sessions and drop expired results."""
        now = self.clock.now()
        idle = self.config.session_idle_s
        actions: list[Action] = []
        for s in self.table.values():
            if s.active is None and not s.waiters and idle_expired(now, s.last_active_s, idle):
                actions.extend(self._close(s))
        if actions:
            self.apply(actions)
        self.recovery.expire(now - self.config.result_ttl_s)
