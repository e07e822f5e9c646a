"""The gateway's durable state in SQLite (standard library, WAL): what a restart must not lose.

* ``meta``: the gateway clock's origin (Unix time), so turn times stay continuous across
  restarts.
* ``sessions``: per session, what the scheduler needs to continue it (arrival time, the context
  grown so far, the engine holding its KV, service attained).
* ``turns``: accepted turns the release policy is *holding* (not yet forwarded), with the
  request body, so a restarted gateway serves them; and results of turns served while no client
  was attached (after a restart), so a retried ``x-request-id`` gets the answer once.

A turn is written when it is held and deleted when it is released; a turn released on arrival
costs no write. Commits are not fsynced (``synchronous=NORMAL``): a gateway process crash loses
nothing committed, a power loss may lose the last moments.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["HeldTurnRow", "SessionRow", "StateBackend", "Store"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    arrival_s REAL NOT NULL,
    ephemeral INTEGER NOT NULL,
    turns INTEGER NOT NULL,
    context_tokens INTEGER NOT NULL,
    attained_tokens INTEGER NOT NULL,
    last_engine TEXT,
    last_active_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    request_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    state TEXT NOT NULL,              -- held | done
    path TEXT NOT NULL,
    body TEXT NOT NULL,
    stream INTEGER NOT NULL,
    ready_s REAL NOT NULL,
    input_tokens INTEGER NOT NULL,
    context_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    status INTEGER,
    result BLOB,
    updated_s REAL NOT NULL
);
"""


@dataclass(slots=True)
class SessionRow:
    id: str
    tenant: str
    arrival_s: float
    ephemeral: bool
    turns: int
    context_tokens: int
    attained_tokens: int
    last_engine: str | None
    last_active_s: float


@dataclass(slots=True)
class HeldTurnRow:
    request_id: str
    session_id: str
    path: str
    body: dict[str, Any]
    stream: bool
    ready_s: float
    input_tokens: int
    context_tokens: int
    output_tokens: int


class StateBackend(Protocol):
    """Where the gateway keeps what a restart must not lose (:class:`Store`: SQLite, one
    process; :class:`~turnstile.gateway.shared.RedisState`: shared by replicas).

    Writes are fire-and-forget from the event loop thread (a backend may batch them; ``flush``
    waits for them). Reads of the whole state happen at start-up; a shared backend answers the
    per-request ``lookup_*`` instead (a local one: what it kept since start-up)."""

    #: several replicas share this state (every accepted turn is written, owners, load)
    shared: bool

    async def open(self) -> None: ...

    async def aclose(self) -> None: ...

    async def flush(self) -> None: ...

    async def ping(self) -> None:
        """Raise when the backend cannot be reached (``/ready``)."""

    def clock_origin(self, now_unix: float) -> float: ...

    def put_session(self, s: SessionRow) -> None: ...

    def drop_session(self, session_id: str) -> None: ...

    def sessions(self) -> list[SessionRow]: ...

    def put_held(self, t: HeldTurnRow, now_s: float) -> None: ...

    def drop_turn(self, request_id: str, answered: bool = True) -> None: ...

    def held(self) -> list[HeldTurnRow]: ...

    def put_result(self, request_id: str, session_id: str, path: str, status: int,
                   result: bytes, now_s: float) -> None: ...

    def results(self) -> dict[str, tuple[int, bytes, float, str]]: ...

    def purge_results(self, before_s: float) -> None: ...

    async def lookup_session(self, session_id: str) -> SessionRow | None: ...

    async def lookup_result(self, request_id: str) -> tuple[int, bytes, float, str] | None: ...



class Store:
    """One SQLite file (the single-process default backend); used from the gateway's event loop
    thread only."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    shared = False

    def close(self) -> None:
        self.db.close()

    async def open(self) -> None:
        pass

    async def aclose(self) -> None:
        self.close()

    async def flush(self) -> None:
        pass  # every write is committed when made

    async def ping(self) -> None:
        self.db.execute("SELECT 1").fetchone()

    # one process: everything was loaded at start-up, but answers kept since (whole answers
    # kept on their way out) are read here
    async def lookup_session(self, session_id: str) -> SessionRow | None:
        return None

    async def lookup_result(self, request_id: str) -> tuple[int, bytes, float, str] | None:
        r = self.db.execute("SELECT status, result, updated_s, path FROM turns "
                            "WHERE request_id=? AND state='done'", (request_id,)).fetchone()
        return None if r is None else (int(r[0]), bytes(r[1]), float(r[2]), r[3])

    # ------------------------------------------------------------------ clock
    def clock_origin(self, now_unix: float) -> float:
        """The stored clock origin (Unix seconds), set to ``now_unix`` on first use."""
        row = self.db.execute("SELECT value FROM meta WHERE key='clock_origin'").fetchone()
        if row is not None:
            return float(row[0])
        self.db.execute("INSERT INTO meta VALUES ('clock_origin', ?)", (repr(now_unix),))
        return now_unix

    # ------------------------------------------------------------------ sessions
    def put_session(self, s: SessionRow) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO sessions VALUES (?,?,?,?,?,?,?,?,?)",
            (s.id, s.tenant, s.arrival_s, int(s.ephemeral), s.turns, s.context_tokens,
             s.attained_tokens, s.last_engine, s.last_active_s),
        )

    def drop_session(self, session_id: str) -> None:
        self.db.execute("DELETE FROM sessions WHERE id=?", (session_id,))

    def sessions(self) -> list[SessionRow]:
        rows = self.db.execute("SELECT * FROM sessions").fetchall()
        return [SessionRow(r[0], r[1], r[2], bool(r[3]), r[4], r[5], r[6], r[7], r[8])
                for r in rows]

    # ------------------------------------------------------------------ turns
    def put_held(self, t: HeldTurnRow, now_s: float) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO turns VALUES (?,?,'held',?,?,?,?,?,?,?,NULL,NULL,?)",
            (t.request_id, t.session_id, t.path, json.dumps(t.body), int(t.stream), t.ready_s,
             t.input_tokens, t.context_tokens, t.output_tokens, now_s),
        )

    def drop_turn(self, request_id: str, answered: bool = True) -> None:
        """The turn is over: its held row goes (a result kept for it stays, for a retry)."""
        self.db.execute("DELETE FROM turns WHERE request_id=? AND state='held'", (request_id,))

    def held(self) -> list[HeldTurnRow]:
        rows = self.db.execute(
            "SELECT request_id, session_id, path, body, stream, ready_s, input_tokens, "
            "context_tokens, output_tokens FROM turns WHERE state='held' ORDER BY ready_s"
        ).fetchall()
        return [HeldTurnRow(r[0], r[1], r[2], json.loads(r[3]), bool(r[4]), r[5], r[6], r[7],
                            r[8]) for r in rows]

    def put_result(self, request_id: str, session_id: str, path: str, status: int,
                   result: bytes, now_s: float) -> None:
        """Keep the result of a turn served with no client attached (for a retry)."""
        self.db.execute(
            "INSERT OR REPLACE INTO turns VALUES (?,?,'done',?,'{}',0,?,0,0,0,?,?,?)",
            (request_id, session_id, path, now_s, status, result, now_s),
        )

    def results(self) -> dict[str, tuple[int, bytes, float, str]]:
        """request id → (status, body, stored at, path) of results kept for retries."""
        rows = self.db.execute(
            "SELECT request_id, status, result, updated_s, path FROM turns WHERE state='done'"
        ).fetchall()
        return {r[0]: (int(r[1]), bytes(r[2]), float(r[3]), r[4]) for r in rows}

    def purge_results(self, before_s: float) -> None:
        self.db.execute("DELETE FROM turns WHERE state='done' AND updated_s < ?", (before_s,))
