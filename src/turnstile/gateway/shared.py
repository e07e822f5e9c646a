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
  budgets policies read from the view see the whole cluster.
* ``{ns}:key:{hash}`` — conversation keys → session (:mod:`.affinity`).
* ``{ns}:learn`` — a stream of what each replica observed (a session's flow time, a tool call's
  duration), capped at ``learn_max`` entries; every replica feeds the others' to its policies
  (``Scheduler.peer_observed``), so learned tool latencies and flow-time quantiles are the
  cluster's; a new replica starts from the stream's history.

Writes are queued and sent in one pipeline per event-loop pass (ordered, one round trip per
batch); :meth:`RedisState.flush` waits for the queue, and an accepted turn is flushed before it
is forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

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
      -- still that replica's and not answered: a retry served meanwhile by a live replica
      -- (which accepted it again, as its own) is that replica's turn, not run a third time
      if redis.call('HGET', ns .. ':turn:' .. rid, 'owner') == r
          and redis.call('HEXISTS', ns .. ':turn:' .. rid, 'done') == 0 then
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

#: an accepted turn: its row (hash fields in ARGV[2..]) and its owner's set, in one command
#: (a request id accepted again after its answer went unkept is a turn in flight again)
_ACCEPT = """
redis.call('HDEL', KEYS[1], 'done')
redis.call('PERSIST', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
"""

#: an answered turn: marked done (kept ARGV[1] seconds against a retry), out of its owner's set
_DONE = """
redis.call('HSET', KEYS[1], 'done', 1, 'body', '')
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[2])
"""

#: a turn over with no answer (every attempt failed, its client went away): gone, so that the
#: client's retry is served as a new request instead of being refused as answered
_GONE = """
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
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
        #: the heartbeat's and the load document's lifetime
        self._ttl_ms = int(replica_ttl_s * 1000)
        self.result_ttl_s = result_ttl_s
        self.key_ttl_s = key_ttl_s
        # a Redis that hangs (partitioned, overloaded) costs a request's lookup at most ~2 s
        # (redis-py's default: 5 s per call); the gateway answers a failed read as "unknown"
        # and counts failed writes, so a call is not retried
        self.redis: aioredis.Redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(NoBackoff(), 0))
        self._queue: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._flushed: asyncio.Future[None] | None = None  # the next batch's completion
        self._inflight: asyncio.Future[None] | None = None  # the batch being sent
        self._writer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._origin = 0.0
        self._held: list[HeldTurnRow] = []
        self._claim: Any = None
        self.learn_max = 10_000
        self._learn_from = "0-0"
        self.write_errors = 0
        self.read_errors = 0
        self._beat_stop: threading.Event | None = None

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        r = self.redis
        await r.set(f"{self.ns}:clock_origin", repr(time.time()), nx=True)
        self._origin = float(cast(bytes, await r.get(f"{self.ns}:clock_origin")))
        await self.heartbeat()
        await r.sadd(f"{self.ns}:replicas", self.replica)
        self._claim = r.register_script(_CLAIM)
        # turns this replica owned before it restarted under the same name
        self._held = await self._rows(await r.smembers(f"{self.ns}:owned:{self.replica}"))
        self._wake = asyncio.Event()
        self._writer = asyncio.ensure_future(self._write_loop())

    async def aclose(self) -> None:
        self.stop_beating()
        if self._writer is not None:
            await self.flush()
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        await self.redis.aclose()

    async def ping(self) -> None:
        await self.redis.ping()

    def close(self) -> None:  # the sync protocol method; the service awaits aclose
        pass

    def _beat(self, client: Any) -> Any:
        """Refresh this replica's heartbeat (expiring after ``replica_ttl_s``) through
        ``client``: the asyncio client (awaited) or the heartbeat thread's blocking one."""
        return client.set(f"{self.ns}:hb:{self.replica}", "1", px=self._ttl_ms)

    async def heartbeat(self) -> None:
        await self._beat(self.redis)

    def beat_in_thread(self, loop_seen: Callable[[], float], *, every_s: float,
                       grace_s: float) -> None:
        """Also refresh the heartbeat from a thread of its own (a blocking client), for as long
        as the event loop was seen (``loop_seen()``, ``time.monotonic()``) within ``grace_s``:
        an event loop slowed past ``replica_ttl_s`` (a starved host) does not make a live
        replica look dead — its turns would be claimed and run again by another — while a
        process that died stops at once, and an event loop stuck past ``grace_s`` lets the
        heartbeat lapse (its turns are taken over)."""
        import redis as sync_redis

        client = sync_redis.Redis.from_url(self.url, socket_connect_timeout=1.0,
                                           socket_timeout=1.0)
        stop = self._beat_stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every_s):
                if time.monotonic() - loop_seen() > grace_s:
                    continue
                with contextlib.suppress(Exception):  # Redis away: the load sync logs it
                    self._beat(client)
            client.close()

        threading.Thread(target=beat, name=f"heartbeat-{self.replica}", daemon=True).start()

    def stop_beating(self) -> None:
        if self._beat_stop is not None:
            self._beat_stop.set()

    # ------------------------------------------------------------------ batched writes
    def _put(self, cmd: str, *args: Any, **kw: Any) -> None:
        self._queue.append((cmd, args, kw))
        if self._wake is not None:
            self._wake.set()

    async def flush(self) -> None:
        """Wait until every write queued so far reached Redis (the batch being sent, and the
        next one when writes are queued)."""
        if self._queue:
            if self._flushed is None:
                self._flushed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._flushed)
        elif self._inflight is not None:
            await asyncio.shield(self._inflight)

    async def _write_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            done, self._flushed = self._flushed, None
            if done is None and batch:
                done = asyncio.get_running_loop().create_future()
            self._inflight = done
            if batch:
                pipe = self.redis.pipeline(transaction=False)
                for cmd, args, kw in batch:
                    if cmd == "script":  # (script text, keys, args): cached by Redis
                        pipe.eval(args[0], len(args[1]), *args[1], *args[2])
                    else:
                        getattr(pipe, cmd)(*args, **kw)
                try:
                    await pipe.execute()
                except Exception:
                    self.write_errors += 1
                    log.exception("shared state write failed (%d commands)", len(batch))
            self._inflight = None
            if done is not None and not done.done():
                done.set_result(None)
            if self._queue:
                self._wake.set()

    # ------------------------------------------------------------------ StateBackend
    def clock_origin(self, now_unix: float) -> float:
        return self._origin

    def put_session(self, s: SessionRow) -> None:
        self._put("set", f"{self.ns}:session:{s.id}", json.dumps(
            [s.tenant, s.arrival_s, s.ephemeral, s.turns, s.context_tokens, s.attained_tokens,
             s.last_engine, s.last_active_s]), ex=int(self.key_ttl_s))

    def drop_session(self, session_id: str) -> None:
        # a closed session's row stays (expiring): its KV may still be on the engine, and the
        # client may come back after the idle timeout
        pass

    def sessions(self) -> list[SessionRow]:
        return []  # looked up per request (lookup_session)

    def put_held(self, t: HeldTurnRow, now_s: float) -> None:
        """Every accepted turn (not only held ones), with this replica as its owner."""
        self._put("script", _ACCEPT,
                  [f"{self.ns}:turn:{t.request_id}", f"{self.ns}:owned:{self.replica}"],
                  [t.request_id, "owner", self.replica, "session_id", t.session_id,
                   "path", t.path, "body", json.dumps(t.body), "stream", int(t.stream),
                   "ready_s", repr(t.ready_s), "input_tokens", t.input_tokens,
                   "context_tokens", t.context_tokens, "output_tokens", t.output_tokens])

    def drop_turn(self, request_id: str, answered: bool = True) -> None:
        """The turn is over. Answered: its row stays a while, marked done, so a retry of the
        same request id on any replica is not served again (it gets the kept answer, if one
        was written before). Not answered: the row goes, and a retry is served anew."""
        keys = [f"{self.ns}:turn:{request_id}", f"{self.ns}:owned:{self.replica}"]
        if answered:
            self._put("script", _DONE, keys, [int(self.result_ttl_s), request_id])
        else:
            self._put("script", _GONE, keys, [request_id])

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
    # Redis unreachable mid-run: lookups answer "not known" (the replica serves on what it knows
    # itself) and count the failure, instead of failing the request.
    def _lookup_failed(self) -> None:
        self.read_errors += 1
        if self.read_errors == 1 or self.read_errors % 1000 == 0:
            log.exception("shared state read failed (%d so far)", self.read_errors)

    async def lookup_session(self, session_id: str) -> SessionRow | None:
        try:
            v = await self.redis.get(f"{self.ns}:session:{session_id}")
        except RedisError:
            self._lookup_failed()
            return None
        if v is None:
            return None
        return SessionRow(session_id, *json.loads(v))

    async def lookup_result(self, request_id: str) -> tuple[int, bytes, float, str] | None:
        try:
            h = await self.redis.hgetall(f"{self.ns}:result:{request_id}")
        except RedisError:
            self._lookup_failed()
            return None
        if not h:
            return None
        return (int(h[b"status"]), cast(bytes, h[b"body"]), float(h[b"at"]), _s(h[b"path"]))

    async def turn_status(self, request_id: str) -> tuple[str | None, bool]:
        """(the replica that accepted the turn, whether it was answered); (None, False) for a
        request id never seen (or expired)."""
        try:
            owner, done = await self.redis.hmget(f"{self.ns}:turn:{request_id}", "owner",
                                                 "done")
        except RedisError:
            self._lookup_failed()
            return None, False
        return (None if owner is None else _s(owner)), done is not None

    async def _rows(self, rids: Iterable[Any]) -> list[HeldTurnRow]:
        ids = [_s(r) for r in rids]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.hmget(f"{self.ns}:turn:{rid}", *_TURN_FIELDS)
        rows = []
        for rid, v in zip(ids, await pipe.execute(), strict=True):
            if v[0] is None or not v[2]:  # gone, or answered (its body dropped)
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
    async def exchange_load(self, own: Mapping[str, tuple[int, ...]], held: int
                            ) -> tuple[dict[str, tuple[int, int, int, int]], int]:
        """Publish this replica's load (per engine: released turns, released tokens, paused
        context tokens, paused sessions); returns the sum of the other live replicas'. A
        replica of an older version publishes no paused-session count: 0."""
        key = f"{self.ns}:load:{self.replica}"
        doc = json.dumps({"engines": own, "held": held})
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(key, doc, px=self._ttl_ms)
        # back in the set after a lapse (a stalled loop, a Redis restart): a replica another one
        # dropped as dead would otherwise never have its later turns taken over
        pipe.sadd(f"{self.ns}:replicas", self.replica)
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
                    t = total.setdefault(eid, [0, 0, 0, 0])
                    for i in range(min(4, len(v))):
                        t[i] += int(v[i])
        return {k: (v[0], v[1], v[2], v[3]) for k, v in total.items()}, held_total

    # ------------------------------------------------------------------ learning
    def publish_observation(self, *, flow_time_s: float | None = None,
                            tool_time_s: float | None = None) -> None:
        fields = {"r": self.replica, "f": "" if flow_time_s is None else repr(flow_time_s),
                  "t": "" if tool_time_s is None else repr(tool_time_s)}
        self._put("xadd", f"{self.ns}:learn", fields, maxlen=self.learn_max, approximate=True)

    async def read_observations(self, count: int = 1000
                                ) -> list[tuple[float | None, float | None]]:
        """The other replicas' observations since the last call: (flow time, tool time)."""
        # a list of (stream, entries) with bytes keys and values (the client does not decode)
        got = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
                   await self.redis.xread({f"{self.ns}:learn": self._learn_from}, count=count))
        out: list[tuple[float | None, float | None]] = []
        for _, entries in got:
            for entry_id, fields in entries:
                self._learn_from = _s(entry_id)
                if _s(fields.get(b"r", b"")) == self.replica:
                    continue
                f, t = _s(fields.get(b"f", b"")), _s(fields.get(b"t", b""))
                out.append((float(f) if f else None, float(t) if t else None))
        return out

    # ------------------------------------------------------------------ KeyStore
    async def get_many(self, keys: list[str]) -> list[str | None]:
        try:
            vals = await self.redis.mget([f"{self.ns}:key:{k}" for k in keys])
        except RedisError:
            self._lookup_failed()
            return [None] * len(keys)
        return [None if v is None else _s(v) for v in vals]

    def put_many(self, items: Iterable[tuple[str, str]]) -> None:
        ttl = int(self.key_ttl_s)
        for k, v in items:
            self._put("set", f"{self.ns}:key:{k}", v, ex=ttl)
