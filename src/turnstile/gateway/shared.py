"""Shared state for several gateway replicas, on Redis (redis-py's asyncio client).

Every replica runs its own scheduler over the same engines; Redis carries what must agree:

* ``{ns}:session:{id}`` — a session's row (arrival, context grown so far, engine holding its
  KV, service attained): any replica that gets the session's next turn routes it where its KV
  is, and a restarted replica finds it.
* ``{ns}:turn:{request id}`` + ``{ns}:owned:{replica}`` — every accepted turn until it is
  answered, with its owner. A replica refreshes ``{ns}:hb:{replica}`` (expiring after
  ``replica_ttl_s``); when it stops, a live replica claims its turns in one atomic script (so
  exactly one does), serves them and keeps the results.
* ``{ns}:result:{request id}`` — a turn served with no client attached, for the client's retry
  of the same ``x-request-id`` (on any replica), expiring after ``result_ttl_s``.
* ``{ns}:load:{replica}`` — per engine the replica's released turns, released tokens and paused
  context (shadow load), and its held turns; each replica adds the others' to its scheduler's
  view (:meth:`~turnstile.core.scheduler.Scheduler.peer_load`), so routing, shadow load and the
  release budget see the whole cluster.
* ``{ns}:key:{hash}`` — conversation keys → session (:mod:`.affinity`).

Writes are queued and sent in one pipeline per event-loop pass (ordered, one round trip per
batch); :meth:`RedisState.flush` waits for the queue, and an accepted turn is flushed before it
is forwarded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis

from turnstile.gateway.store import HeldTurnRow, SessionRow

__all__ = ["RedisState", "replica_name"]

log = logging.getLogger("turnstile.gateway")

#: claim every turn of replicas whose heartbeat expired: one replica wins each, atomically
_CLAIM = """
local ns, me = ARGV[1], ARGV[2]
local claimed = {}
for _, r in ipairs(redis.call('SMEMBERS', ns .. ':replicas')) do
  if r ~= me and redis.call('EXISTS', ns .. ':hb:' .. r) == 0 then
    for _, rid in ipairs(redis.call('SMEMBERS', ns .. ':owned:' .. r)) do
      if redis.call('EXISTS', ns .. ':turn:' .. rid) == 1 then
        redis.call('HSET', ns .. ':turn:' .. rid, 'owner', me)
        redis.call('SADD', ns .. ':owned:' .. me, rid)
        table.insert(claimed, rid)
      end
    end
    redis.call('DEL', ns .. ':owned:' .. r, ns .. ':load:' .. r)
    redis.call('SREM', ns .. ':replicas', r)
  end
end
return claimed
"""

_TURN_FIELDS = ("session_id", "path", "body", "stream", "ready_s", "input_tokens",
                "context_tokens", "output_tokens")


def replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisState:
    """One replica's connection to the shared state (a :class:`~.store.StateBackend`)."""

    shared = True

    def __init__(self, url: str, *, replica_id: str | None = None, namespace: str = "ts",
                 replica_ttl_s: float = 3.0, result_ttl_s: float = 600.0,
                 key_ttl_s: float = 86_400.0) -> None:
        self.url = url
        self.replica = replica_id or replica_name()
        self.ns = namespace
        self.replica_ttl_s = replica_ttl_s
        self.result_ttl_s = result_ttl_s
        self.key_ttl_s = key_ttl_s
        self.redis: aioredis.Redis = aioredis.Redis.from_url(url)
        self._queue: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._flushed: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._origin = 0.0
        self._held: list[HeldTurnRow] = []
        self._claim: Any = None
        self.write_errors = 0

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        r = self.redis
        await r.set(f"{self.ns}:clock_origin", repr(time.time()), nx=True)
        self._origin = float(await r.get(f"{self.ns}:clock_origin"))
        await self.heartbeat()
        await r.sadd(f"{self.ns}:replicas", self.replica)
        self._claim = r.register_script(_CLAIM)
        # turns this replica owned before it restarted under the same name
        self._held = await self._rows(await r.smembers(f"{self.ns}:owned:{self.replica}"))
        self._wake = asyncio.Event()
        self._writer = asyncio.ensure_future(self._write_loop())

    async def aclose(self) -> None:
        if self._writer is not None:
            await self.flush()
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        await self.redis.aclose()

    def close(self) -> None:  # the sync protocol method; the service awaits aclose
        pass

    async def heartbeat(self) -> None:
        await self.redis.set(f"{self.ns}:hb:{self.replica}", "1",
                             px=int(self.replica_ttl_s * 1000))

    # ------------------------------------------------------------------ batched writes
    def _put(self, cmd: str, *args: Any, **kw: Any) -> None:
        self._queue.append((cmd, args, kw))
        if self._wake is not None:
            self._wake.set()

    async def flush(self) -> None:
        """Wait until every write queued so far reached Redis."""
        if not self._queue and self._flushed is None:
            return
        if self._flushed is None:
            self._flushed = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._flushed)

    async def _write_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            done, self._flushed = self._flushed, None
            if batch:
                pipe = self.redis.pipeline(transaction=False)
                for cmd, args, kw in batch:
                    getattr(pipe, cmd)(*args, **kw)
                try:
                    await pipe.execute()
                except Exception:
                    self.write_errors += 1
                    log.exception("shared state write failed (%d commands)", len(batch))
            if done is not None and not done.done():
                done.set_result(None)
            if self._queue:
                self._wake.set()

    # ------------------------------------------------------------------ StateBackend
    def clock_origin(self, now_unix: float) -> float:
        return self._origin

    def put_session(self, s: SessionRow) -> None:
        key = f"{self.ns}:session:{s.id}"
        self._put("hset", key, mapping={
            "tenant": s.tenant, "arrival_s": repr(s.arrival_s), "ephemeral": int(s.ephemeral),
            "turns": s.turns, "context_tokens": s.context_tokens,
            "attained_tokens": s.attained_tokens, "last_engine": s.last_engine or "",
            "last_active_s": repr(s.last_active_s)})
        self._put("expire", key, int(self.key_ttl_s))

    def drop_session(self, session_id: str) -> None:
        # a closed session's row stays (expiring): its KV may still be on the engine, and the
        # client may come back after the idle timeout
        pass

    def sessions(self) -> list[SessionRow]:
        return []  # looked up per request (lookup_session)

    def put_held(self, t: HeldTurnRow, now_s: float) -> None:
        """Every accepted turn (not only held ones), with this replica as its owner."""
        self._put("hset", f"{self.ns}:turn:{t.request_id}", mapping={
            "owner": self.replica, "session_id": t.session_id, "path": t.path,
            "body": json.dumps(t.body), "stream": int(t.stream), "ready_s": repr(t.ready_s),
            "input_tokens": t.input_tokens, "context_tokens": t.context_tokens,
            "output_tokens": t.output_tokens})
        self._put("sadd", f"{self.ns}:owned:{self.replica}", t.request_id)

    def drop_turn(self, request_id: str) -> None:
        self._put("delete", f"{self.ns}:turn:{request_id}")
        self._put("srem", f"{self.ns}:owned:{self.replica}", request_id)

    def held(self) -> list[HeldTurnRow]:
        rows, self._held = self._held, []
        return rows

    def put_result(self, request_id: str, session_id: str, path: str, status: int,
                   result: bytes, now_s: float) -> None:
        self._put("hset", f"{self.ns}:result:{request_id}",
                  mapping={"status": status, "body": result, "path": path, "at": repr(now_s)})
        self._put("expire", f"{self.ns}:result:{request_id}", int(self.result_ttl_s))

    def results(self) -> dict[str, tuple[int, bytes, float, str]]:
        return {}  # looked up per request (lookup_result)

    def purge_results(self, before_s: float) -> None:
        pass  # results expire in Redis

    # ------------------------------------------------------------------ lookups
    async def lookup_session(self, session_id: str) -> SessionRow | None:
        h = await self.redis.hgetall(f"{self.ns}:session:{session_id}")
        if not h:
            return None
        g = {_s(k): _s(v) for k, v in h.items()}
        return SessionRow(session_id, g["tenant"], float(g["arrival_s"]), g["ephemeral"] == "1",
                          int(g["turns"]), int(g["context_tokens"]), int(g["attained_tokens"]),
                          g["last_engine"] or None, float(g["last_active_s"]))

    async def lookup_result(self, request_id: str) -> tuple[int, bytes, float, str] | None:
        h = await self.redis.hgetall(f"{self.ns}:result:{request_id}")
        if not h:
            return None
        return (int(h[b"status"]), bytes(h[b"body"]), float(h[b"at"]), _s(h[b"path"]))

    async def turn_owner(self, request_id: str) -> str | None:
        v = await self.redis.hget(f"{self.ns}:turn:{request_id}", "owner")
        return None if v is None else _s(v)

    async def _rows(self, rids: Iterable[Any]) -> list[HeldTurnRow]:
        ids = [_s(r) for r in rids]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.hmget(f"{self.ns}:turn:{rid}", *_TURN_FIELDS)
        rows = []
        for rid, v in zip(ids, await pipe.execute(), strict=True):
            if v[0] is None:
                continue
            rows.append(HeldTurnRow(rid, _s(v[0]), _s(v[1]), json.loads(v[2]), v[3] == b"1",
                                    float(v[4]), int(v[5]), int(v[6]), int(v[7])))
        rows.sort(key=lambda r: r.ready_s)
        return rows

    async def claim_orphans(self) -> list[HeldTurnRow]:
        """Take over the turns of replicas whose heartbeat expired (each turn goes to exactly
        one claimer)."""
        rids = await self._claim(args=[self.ns, self.replica])
        return await self._rows(rids)

    # ------------------------------------------------------------------ load exchange
    async def exchange_load(self, own: dict[str, tuple[int, int, int]], held: int
                            ) -> tuple[dict[str, tuple[int, int, int]], int]:
        """Publish this replica's load; returns the sum of the other live replicas'."""
        key = f"{self.ns}:load:{self.replica}"
        doc = json.dumps({"engines": own, "held": held})
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(key, doc, px=int(self.replica_ttl_s * 1000))
        pipe.set(f"{self.ns}:hb:{self.replica}", "1", px=int(self.replica_ttl_s * 1000))
        pipe.smembers(f"{self.ns}:replicas")
        _, _, members = await pipe.execute()
        others = [_s(m) for m in members if _s(m) != self.replica]
        total: dict[str, list[int]] = {}
        held_total = 0
        if others:
            docs = await self.redis.mget([f"{self.ns}:load:{r}" for r in others])
            for d in docs:
                if d is None:
                    continue
                obj = json.loads(d)
                held_total += int(obj.get("held", 0))
                for eid, v in obj.get("engines", {}).items():
                    t = total.setdefault(eid, [0, 0, 0])
                    for i in range(3):
                        t[i] += int(v[i])
        return {k: (v[0], v[1], v[2]) for k, v in total.items()}, held_total

    # ------------------------------------------------------------------ KeyStore
    async def get_many(self, keys: list[str]) -> list[str | None]:
        vals = await self.redis.mget([f"{self.ns}:key:{k}" for k in keys])
        return [None if v is None else _s(v) for v in vals]

    def put_many(self, items: Iterable[tuple[str, str]]) -> None:
        ttl = int(self.key_ttl_s)
        for k, v in items:
            self._put("set", f"{self.ns}:key:{k}", v, ex=ttl)
