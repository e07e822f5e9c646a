"""Sessions and the requests accepted for them, in the core's vocabulary.

A :class:`PendingTurn` is one accepted request across its forwarding attempts. Its ``state`` is
the core's :class:`~turnstile.core.state.TurnState` as the gateway sees it:

* ``PENDING``: accepted, not (or no longer) in the scheduler — waiting for its session, being
  estimated, or between two attempts after an engine failed;
* ``READY``: in the scheduler, held by the release policy (``waker`` fires on release);
* ``RELEASED``: the policy chose an engine; ``RUNNING``: forwarded; ``DONE``: answered.

A session runs one turn at a time: a second request of a busy session waits in
:class:`SessionTable` (gateway-side, not READY yet) until the first finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

from turnstile.core.session_idle import sweep_period_s
from turnstile.core.state import TurnRecord, TurnState
from turnstile.gateway.store import SessionRow
from turnstile.workload.model import Turn

__all__ = ["PendingTurn", "Session", "SessionTable", "sweep_period_s"]


class Session:
    __slots__ = ("active", "arrival_s", "attained_tokens", "context_tokens", "derived",
                 "ephemeral", "id", "in_scheduler", "last_active_s", "last_engine", "parent",
                 "refused", "stored", "tenant", "turns", "waiters")

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
        #: the session this one was spawned from (a sub-agent), when known
        self.parent: str | None = None
        #: its id derived from the conversation (its affinity keys carry its residency)
        self.derived = False
        #: its only request so far was refused by the engine: it never was a session
        self.refused = False
        self.in_scheduler = False
        self.stored = False  # a row in the state backend
        self.active: PendingTurn | None = None
        self.waiters: deque[tuple[PendingTurn, asyncio.Future[None]]] = deque()

    def row(self) -> SessionRow:
        return SessionRow(self.id, self.tenant, self.arrival_s, self.ephemeral, self.turns,
                          self.context_tokens, self.attained_tokens, self.last_engine,
                          self.last_active_s)

    def load(self, row: SessionRow) -> None:
        """Take over what another replica (or a previous run) learned about this session."""
        self.arrival_s = row.arrival_s
        self.turns = max(self.turns, row.turns)
        self.context_tokens = row.context_tokens
        self.attained_tokens = max(self.attained_tokens, row.attained_tokens)
        if row.last_engine is not None:
            self.last_engine = row.last_engine
        self.stored = True


class PendingTurn:
    """One accepted request, across its attempts."""

    __slots__ = ("answered", "attached", "body", "client_usage", "conversation", "detached_done",
                 "ends_session", "engine", "engine_hint", "keep_answer", "keep_result", "path",
                 "persisted", "priority", "probe", "prompt_chars", "rec", "reply_args",
                 "reply_text", "request_id", "session", "state", "stream", "turn", "waker")

    def __init__(self, request_id: str, session: Session, path: str, body: dict[str, Any],
                 stream: bool) -> None:
        self.request_id = request_id
        self.session = session
        self.path = path
        self.body = body
        self.stream = stream
        self.client_usage = False
        self.turn: Turn | None = None
        self.rec: TurnRecord | None = None
        self.state = TurnState.PENDING
        self.engine = ""
        self.engine_hint: str | None = None
        #: a probe request (``x-turnstile-probe``): served, not recorded
        self.probe = False
        #: the client said no turn follows: the session closes when this turn is over
        self.ends_session = False
        self.priority = 0.0
        self.attached = True  # a client is waiting for this turn
        self.keep_result = False  # serve and keep the result even with no client (restored)
        self.persisted = False
        #: the engine answered it (a finished turn, not a cancelled, cut or failed one)
        self.answered = False
        #: a shared backend keeps its whole answer (non-streamed): its row is marked done
        #: only once that is written (:meth:`Durability.answer`), not when the turn finishes
        self.keep_answer = False
        self.prompt_chars = 0
        #: the assistant's reply, collected only when affinity keys are derived from it
        self.reply_text: list[str] | None = None
        self.reply_args: list[str] | None = None  # its tool calls' argument fragments
        #: (the conversation's hash through the request, its root key): the reply's affinity
        #: keys extend them
        self.conversation = ("", "")
        self.waker: asyncio.Future[None] | None = None
        #: set while the turn is served with no client attached
        self.detached_done: asyncio.Event | None = None


class SessionTable:
    """Open sessions and the one-turn-at-a-time rule."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        #: turns waiting behind a running turn of their session
        self.queued = 0

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def open(self, sid: str, tenant: str, ephemeral: bool, now_s: float) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            s = Session(sid, tenant, ephemeral, now_s)
            self.sessions[sid] = s
        return s

    def drop(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def values(self) -> list[Session]:
        return list(self.sessions.values())

    async def acquire(self, p: PendingTurn) -> None:
        """Wait until ``p`` is its session's active turn."""
        s = p.session
        if s.active is None:
            s.active = p
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        s.waiters.append((p, fut))
        self.queued += 1
        try:
            await fut
        except asyncio.CancelledError:
            if s.active is p:
                self.pass_on(s)
            else:
                with contextlib.suppress(ValueError):
                    s.waiters.remove((p, fut))
            raise
        finally:
            self.queued -= 1

    @staticmethod
    def pass_on(s: Session) -> None:
        """The active turn is over: the next waiting turn of the session goes."""
        s.active = None
        while s.waiters:
            p, fut = s.waiters.popleft()
            if not fut.done():
                s.active = p
                fut.set_result(None)
                return
