"""Which session a request belongs to: the one its client names (``x-session-id`` or another
stack's key, :mod:`.identity`), one derived from its conversation (:mod:`.affinity`), or a
one-turn session of its own — and where that session's KV is when another replica (or a run
before a restart) served it last. Derived sessions are counted by how they were found
(``turnstile_gateway_derived_sessions_total{how=new|continued|forked|subagent}``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turnstile.core.scheduler import Scheduler
from turnstile.gateway.affinity import ConversationKeys, Resolution
from turnstile.gateway.metrics import GatewayMetrics
from turnstile.gateway.protocol import CHAT_PATH, TurnRequest
from turnstile.gateway.replicas import ReplicaSync
from turnstile.gateway.sessions import Session, SessionTable

__all__ = ["SessionResolver", "one_turn"]


def one_turn(body: dict[str, Any]) -> bool:
    """A request nothing will follow: no tools offered and no earlier reply (assistant or tool
    message) in its conversation. Its session closes with its turn, so it holds no slot, session
    budget or paused KV past its own life (an agent's next turn carries tools or a reply)."""
    if body.get("tools") or body.get("functions"):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    return not any(isinstance(m, dict) and m.get("role") in ("assistant", "tool", "function")
                   for m in messages)


class SessionResolver:
    def __init__(self, table: SessionTable, scheduler: Scheduler, now: Callable[[], float],
                 keys: ConversationKeys | None, replicas: ReplicaSync | None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.metrics = metrics
        self.table = table
        self.scheduler = scheduler
        self.now = now
        self.keys = keys
        self.replicas = replicas

    async def session(self, req: TurnRequest, rid: str) -> tuple[Session, Resolution | None]:
        sid = req.session_id
        res = None
        if sid is None and self.keys is not None and req.path == CHAT_PATH:
            res = await self.keys.resolve(req.body, rid)
            if res is not None:
                if res.candidates:
                    self._pick(res)
                sid = res.session_id
                self.keys.remember(res)
                if self.metrics is not None:
                    self.metrics.derived_sessions.labels(res.how).inc()
        s = self.table.open(sid if sid is not None else "req-" + rid, req.tenant, sid is None,
                            self.now())
        if res is None:
            if self.replicas is not None and not s.ephemeral:
                await self.replicas.refresh(s)  # what other replicas learned about it
            return s, None
        s.derived = True
        if res.new:
            # a sub-agent (or the same prefix again) starts on the engine its relative used
            s.parent = res.parent
            s.last_engine = res.engine
        elif res.engine is not None and res.engine != s.last_engine and not s.active:
            # its last turn ran through another replica (or before a restart)
            s.last_engine = res.engine
            s.context_tokens = max(s.context_tokens, res.context_tokens)
            if s.in_scheduler and res.engine in self.scheduler.view:
                self.scheduler.session_moved(s.id, res.engine, s.attained_tokens)
        return s, res

    def _pick(self, res: Resolution) -> None:
        """Which of the sessions the conversation may continue gets this request: an idle one;
        else a busy one whose running turn's request this one extends (its client already has
        that reply: the turn is being booked); else none — a fork near the first."""
        busy = None
        for cand in res.candidates:
            s = self.table.get(cand[0])
            if s is None or (s.active is None and not s.waiters):
                res.choose(cand)
                return
            run = s.active
            if busy is None and run is not None and run.conversation[0] in res.prefixes:
                busy = cand
        if busy is not None:
            res.choose(busy)
        else:
            res.fork()
