"""Overload: shedding new requests (429) and ``/ready``.

**Admission** (:func:`shed`): a request counts from the moment it is accepted — while its
session is looked up, its prompt tokenized, it waits behind its session's running turn, or is
held by the release policy (``Gateway.admitting`` + held turns = ``Gateway.queued``) — so a
burst cannot pass the check all at once before any of it is held. Past ``max_held`` such turns
(or ``max_inflight`` accepted, unanswered requests, turns on engines included) a new request
gets 429 with ``Retry-After: 1``, before anything is read from the state or an engine.

**Readiness** (:func:`readiness`): whether this gateway should be sent new traffic, with the
reason when not.

Liveness (``/health``) says the process answers and some engine is up; readiness also turns
unhealthy (503 with the reasons as JSON) when

* the oldest turn the release policy holds has waited longer than ``ready_max_hold_s`` (new
  sessions would wait as long: a load balancer should send them elsewhere), or more than 1 s
  past the policy's own hold bound (``Scheduler.hold_bound_s``: a hold that should be over);
* no engine passed its last health check;
* the state backend (SQLite or Redis) does not answer a ping within ``ready_state_timeout_s``
  (accepted turns would not survive a restart).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from turnstile.core.scheduler import Scheduler
from turnstile.gateway.config import GatewayConfig
from turnstile.gateway.driving import ReleaseDriver
from turnstile.gateway.durability import Durability, OffsetClock
from turnstile.gateway.metrics import GatewayMetrics
from turnstile.gateway.protocol import GatewayError

__all__ = ["OverloadHost", "oldest_hold_s", "readiness", "shed"]

#: a hold may outlive the policy's bound by this much before ``/ready`` says so (the bound's
#: timer fires on the event loop, and a bound that moved down is acted on at the next event)
_BOUND_SLACK_S = 1.0


class OverloadHost(Protocol):
    """What shedding and readiness read from the service."""

    config: GatewayConfig
    scheduler: Scheduler
    metrics: GatewayMetrics
    driver: ReleaseDriver
    clock: OffsetClock
    durable: Durability | None
    started: bool

    @property
    def queued(self) -> int: ...

    @property
    def inflight(self) -> int: ...

    @property
    def engine_up(self) -> dict[str, bool]: ...


def shed(gw: OverloadHost) -> None:
    """Raise the 429 (with ``Retry-After``) when the gateway is past ``max_held`` or
    ``max_inflight``."""
    cfg = gw.config
    if gw.queued >= cfg.max_held:
        what = f"holds {gw.queued} turns (max_held={cfg.max_held})"
    elif cfg.max_inflight and gw.inflight >= cfg.max_inflight:
        what = f"serves {gw.inflight} requests (max_inflight={cfg.max_inflight})"
    else:
        return
    gw.metrics.rejected.inc()
    raise GatewayError(429, f"the gateway {what}; retry later", type_="rate_limit_error",
                       code="queue_full", headers=[(b"retry-after", b"1")])


def oldest_hold_s(gw: OverloadHost, now_s: float) -> float:
    """How long the oldest turn held by the release policy has waited (0 when none is held):
    the scheduler's own figure (``turnstile_oldest_hold_seconds``)."""
    return gw.scheduler.oldest_hold_age(now_s)


async def _state_error(gw: OverloadHost) -> str | None:
    durable = gw.durable
    if durable is None:
        return None
    try:
        async with asyncio.timeout(gw.config.ready_state_timeout_s):
            await durable.backend.ping()
    except TimeoutError:
        return f"state backend did not answer within {gw.config.ready_state_timeout_s:g} s"
    except Exception as e:  # the backend's own errors (redis, sqlite) vary
        return f"state backend failed: {type(e).__name__}"
    return None


async def readiness(gw: OverloadHost) -> tuple[bool, dict[str, Any]]:
    """(ready, the JSON body ``/ready`` answers)."""
    cfg = gw.config
    reasons: list[str] = []
    hold = oldest_hold_s(gw, gw.clock.now())
    up = gw.engine_up
    if not gw.started:
        reasons.append("gateway not started")
    if not any(up.values()):
        reasons.append("no engine is healthy")
    if hold > cfg.ready_max_hold_s:
        reasons.append(f"oldest held turn has waited {hold:.1f} s "
                       f"(ready_max_hold_s={cfg.ready_max_hold_s:g})")
    bound = gw.scheduler.hold_bound_s(gw.clock.now())
    if bound > 0 and hold > bound + _BOUND_SLACK_S:
        reasons.append(f"oldest held turn has waited {hold:.1f} s, past the release "
                       f"policy's hold bound of {bound:.1f} s")
    state = await _state_error(gw)
    if state is not None:
        reasons.append(state)
    body = {
        "status": "ready" if not reasons else "unready",
        "reasons": reasons,
        "oldest_hold_s": round(hold, 3),
        "engines": up,
        "held_turns": gw.scheduler.held_turns,
        "queued_turns": gw.queued,
        "inflight": gw.inflight,
        "state": None if gw.durable is None else ("ok" if state is None else "failing"),
    }
    return not reasons, body
