"""What a restart must not lose, on top of a state backend (:mod:`.store`: SQLite by default,
:mod:`.shared`: Redis for several replicas).

The service calls these at the moments that matter: a turn is written when it is held and
deleted when it is released (a turn released on arrival costs no write); a session's row after
each finished turn; a result when a turn was served with no client attached (so a retried
``x-request-id`` gets the answer once). The gateway's clock continues across restarts from the
origin the backend keeps.
"""

from __future__ import annotations

import time

from turnstile.core.clock import WallClock
from turnstile.gateway.sessions import PendingTurn, Session, SessionTable
from turnstile.gateway.store import HeldTurnRow, StateBackend

__all__ = ["Durability", "OffsetClock"]


class OffsetClock:
    """The wall clock, continued across restarts from the origin kept in the backend."""

    __slots__ = ("_wall", "offset_s")

    def __init__(self, offset_s: float = 0.0) -> None:
        self._wall = WallClock()
        self.offset_s = offset_s

    def now(self) -> float:
        return self._wall.now() + self.offset_s

    def continue_from(self, backend: StateBackend) -> None:
        unix = time.time()
        self.offset_s = max(unix - backend.clock_origin(unix), 0.0)


class Durability:
    def __init__(self, backend: StateBackend) -> None:
        self.backend = backend


    def restore(self, table: SessionTable, now_s: float
                ) -> tuple[dict[str, tuple[int, bytes, float, str]], list[HeldTurnRow]]:
        """Reload sessions into ``table``; returns the kept results and the held turns (oldest
        first) for the service to make READY again."""
        for row in self.backend.sessions():
            s = table.open(row.id, row.tenant, row.ephemeral, row.arrival_s)
            s.load(row)
            s.last_active_s = now_s
        return self.backend.results(), self.backend.held()

    def held(self, p: PendingTurn, now_s: float) -> None:
        """``p`` is READY and held: write it (with its session) unless already written."""
        if p.persisted:
            return
        rec, turn, s = p.rec, p.turn, p.session
        assert rec is not None and turn is not None
        self.backend.put_held(HeldTurnRow(
            p.request_id, s.id, p.path, p.body, p.stream, rec.ready_s, turn.input_tokens,
            turn.context_tokens, turn.output_tokens), now_s)
        p.persisted = True
        if not self.backend.shared:  # restarts continue the session from its row
            self.session(s)

    def accepted(self, p: PendingTurn) -> None:
        """A shared backend keeps every accepted turn until it is answered (another replica
        serves it if this one dies)."""
        if not p.persisted:
            self.held(p, p.rec.ready_s if p.rec is not None else 0.0)

    def released(self, p: PendingTurn, moved: bool) -> None:
        """``p`` left the holding queue (restored turns, and every turn in a shared backend,
        stay written until answered); ``moved``: its session's KV goes to another engine."""
        if self.backend.shared:
            if moved and not p.session.ephemeral and not p.session.derived:
                self.session(p.session)
        elif p.persisted and not p.keep_result:
            self.forget(p)

    def forget(self, p: PendingTurn) -> None:
        """``p`` is over: its row goes (a shared backend keeps an answered turn's a while,
        marked done, against a retry; one with no answer goes at once: its retry is served)."""
        if p.persisted:
            self.backend.drop_turn(p.request_id, p.answered)
            p.persisted = False

    def answer(self, p: PendingTurn, status: int, body: bytes, now_s: float) -> None:
        """``p``'s whole answer is about to go to its client: kept first, then the turn marked
        done (in this order, in one batch), so a retry from a client that never got it — its
        replica died as it went out — gets it from any replica."""
        self.result(p, status, body, now_s)
        p.answered = True
        self.forget(p)

    def session(self, s: Session) -> None:
        self.backend.put_session(s.row())
        s.stored = True

    def session_closed(self, s: Session) -> None:
        if s.stored:
            self.backend.drop_session(s.id)
            s.stored = False

    def result(self, p: PendingTurn, status: int, body: bytes, now_s: float) -> None:
        self.backend.put_result(p.request_id, p.session.id, p.path, status, body, now_s)

    def purge_results(self, before_s: float) -> None:
        self.backend.purge_results(before_s)
