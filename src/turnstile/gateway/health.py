"""Engine health and load: periodic health checks, engine stats fed to the scheduler.

The scheduler hears about health only through ``engine_stats(healthy=...)``; an engine is never
marked down when it is the last one up (routing needs one; a turn sent to a dead engine fails
fast and is retried). When every engine is down, the one kept routable is the likeliest to
serve: an engine down only for unanswered checks (a front end starved of CPU) may still serve,
one that refuses connections will not.

An engine found dead — its health check refused or reset (no server listens there any more), a
turn refused a connection before any reply, or three failed health checks in a row (unanswered
or not 200: a hung or broken server) — has every request in flight to it dropped at once
(:meth:`EngineAdapter.abort_inflight`): a turn that has streamed no token is re-routed by the
service's retry loop, a streaming one ends with an error event. Without that, a process that
stops serving but keeps its connections open (vLLM after SIGTERM, at times) holds its turns
until the read timeout.

A health check left unanswered while the engine kept sending reply bytes (a busy engine whose
HTTP front end is starved of CPU: vLLM on a loaded host answered ``/health`` in over 2 s while it
streamed) is not a failure: the engine is alive, and marking it down would send its sessions
elsewhere and, three checks on, drop its turns. Envoy's outlier detection reads traffic the same
way (passive health); a hung engine sends nothing and still fails its checks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from turnstile.core.actions import Action
from turnstile.core.scheduler import Scheduler
from turnstile.gateway.adapters import EngineAdapter
from turnstile.gateway.config import GatewayConfig

__all__ = ["EngineState", "HealthMonitor"]

log = logging.getLogger("turnstile.gateway")


@dataclass
class EngineState:
    up: bool = True
    next_check_s: float = 0.0
    failures: int = 0
    #: its last health check went unanswered while it streamed replies (alive, only busy)
    busy: bool = False
    #: declared dead (its requests in flight dropped) and not up since
    dead: bool = False
    #: its last check went unanswered (neither refused nor answered: hung, or only starved)
    silent: bool = False
    stats_counters: dict[str, float] = field(default_factory=dict)


class HealthMonitor:
    """``apply`` carries out the actions an engine event returns (held turns may go)."""

    def __init__(self, adapters: dict[str, EngineAdapter], scheduler: Scheduler,
                 config: GatewayConfig, now: Callable[[], float],
                 apply: Callable[[list[Action]], None]) -> None:
        self.adapters = adapters
        self.scheduler = scheduler
        self.config = config
        self.now = now
        self.apply = apply
        self.engines: dict[str, EngineState] = {a: EngineState() for a in adapters}
        #: model names learned from the engines (when none were configured)
        self.models: list[str] = list(config.models)

    def up(self, eid: str) -> bool:
        return self.engines[eid].up

    def set_health(self, eid: str, up: bool, *, dead: bool = False,
                   silent: bool = False) -> None:
        """Record a health verdict; ``dead``: the engine is known not to serve (its in-flight
        requests are dropped, see the module docstring); ``silent``: the verdict is an
        unanswered check (not a refused connection or a failed turn)."""
        st = self.engines[eid]
        if st.up != up:
            log.warning("engine %s is %s", eid, "up" if up else "DOWN")
        st.up = up
        st.dead = not up and (dead or st.dead)
        st.silent = not up and silent
        st.failures = 0 if up else st.failures + 1
        st.next_check_s = self.now() + (self.config.health_interval_s if up
                                        else self.config.recheck_interval_s)
        self._sync()
        if not up and dead:
            dropped = self.adapters[eid].abort_inflight()
            if dropped:
                log.warning("engine %s is dead: dropped its %d requests in flight (re-routed "
                            "where nothing was streamed)", eid, dropped)

    def _sync(self) -> None:
        """Give the scheduler the verdicts. Routing needs one engine: when every engine is
        down, the one kept routable is the likeliest to serve — one not declared dead, else one
        whose checks only went unanswered (a starved front end may still serve), before one
        that refused a connection or failed a turn."""
        view = self.scheduler.view
        now = self.now()
        routable = {eid for eid, st in self.engines.items() if st.up}
        if not routable:
            routable = {max(self.engines, key=lambda eid: (
                not self.engines[eid].dead, self.engines[eid].silent, view[eid].healthy))}
        for eid in self.engines:
            if eid in routable and not view[eid].healthy:
                self.apply(self.scheduler.engine_stats(now, eid, healthy=True))
        for eid in self.engines:
            if eid not in routable and view[eid].healthy:
                self.apply(self.scheduler.engine_stats(now, eid, healthy=False))

    async def check_all(self) -> None:
        """One health check of every engine (at start-up), and the model names."""
        health = await asyncio.gather(*(a.health() for a in self.adapters.values()))
        for eid, up in zip(self.adapters, health, strict=True):
            self.set_health(eid, bool(up))
        if not self.models:
            found = await asyncio.gather(*(a.models() for a in self.adapters.values()))
            self.models = list(dict.fromkeys(m for ms in found for m in ms))

    async def _check(self, eid: str) -> None:
        adapter, st = self.adapters[eid], self.engines[eid]
        asked = time.monotonic()
        state = await adapter.health_state()
        busy = state == "silent" and adapter.replied_since(
            asked - self.config.health_interval_s)
        if busy != st.busy:
            st.busy = busy
            if busy:
                log.info("engine %s: health check unanswered, but it is streaming replies: "
                         "busy, not down", eid)
        if busy:
            self.set_health(eid, True)
            return
        # a server that still answers (503 while it drains) or is only slow may yet finish
        # its requests: they are dropped once it has failed three checks in a row
        persistent = self.engines[eid].failures >= 2
        self.set_health(eid, state == "up",
                        dead=state == "gone" or (state != "up" and persistent),
                        silent=state == "silent")

    async def stall_loop(self) -> None:
        """The stall probe (``stall_probe_s``): an engine with requests in flight and no reply
        byte for that long gets a short health check at once; a hung one (no answer, still no
        byte) is dead now, so its streams end and its waiting turns move within about
        1.5 x ``stall_probe_s`` instead of three failed checks."""
        probe_s = self.config.stall_probe_s
        last: dict[str, float] = {}
        while True:
            await asyncio.sleep(min(probe_s / 4, 0.25))
            mono = time.monotonic()
            due = [eid for eid, a in self.adapters.items()
                   if self.engines[eid].up and a.in_flight() > 0
                   and not a.replied_since(mono - probe_s)
                   and mono - last.get(eid, -math.inf) >= probe_s]
            for eid in due:
                last[eid] = mono
            await asyncio.gather(*(self._probe(eid, probe_s) for eid in due),
                                 return_exceptions=True)

    async def _probe(self, eid: str, probe_s: float) -> None:
        adapter = self.adapters[eid]
        asked = time.monotonic()
        state = await adapter.health_state(timeout_s=probe_s / 2)
        if (state in ("silent", "gone") and self.engines[eid].up
                and not adapter.replied_since(asked)):
            log.warning("engine %s sent nothing for %.1f s with requests in flight and did "
                        "not answer a health check: hung", eid, probe_s)
            self.set_health(eid, False, dead=True)

    async def health_loop(self, on_round: Callable[[], None]) -> None:
        """Re-check engines when due; ``on_round`` runs after each round (a safety-net tick)."""
        while True:
            await asyncio.sleep(min(self.config.recheck_interval_s,
                                    self.config.health_interval_s, 0.25))
            now = self.now()
            due = [eid for eid, st in self.engines.items() if st.next_check_s <= now]
            if due:
                await asyncio.gather(*(self._check(e) for e in due), return_exceptions=True)
                if not self.models:
                    # no engine answered at start-up: learn the model names once one is up
                    for eid, st in self.engines.items():
                        if st.up and (names := await self.adapters[eid].models()):
                            self.models = names
                            break
            on_round()

    async def stats_loop(self) -> None:
        interval = self.config.stats_interval_s
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            ids = [e for e, st in self.engines.items() if st.up]
            results = await asyncio.gather(*(self.adapters[e].stats() for e in ids),
                                           return_exceptions=True)
            now = self.now()
            for eid, stats in zip(ids, results, strict=True):
                if stats is None or isinstance(stats, BaseException):
                    continue
                self.engines[eid].stats_counters = dict(stats.counters)
                self.apply(self.scheduler.engine_stats(
                    now, eid, queue_len=stats.queue_len, running=stats.running,
                    kv_used_frac=stats.kv_used_frac))
