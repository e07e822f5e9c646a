"""What the core and its drivers exchange: the actions an event returns, and the retention
decision a policy hands back through them.

These live in the core (not in ``policies``) so that drivers (the simulator's engine model,
the gateway's engine adapters) depend only on the core's vocabulary, never on a policy module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnstile.core.state import TurnRecord


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    """What to do with a session's KV while its tool call runs."""

    action: Literal["lru", "pin", "offload", "discard"]
    #: how long to pin (``pin``) or keep in the offload tier (``offload``)
    ttl_s: float = 0.0


LRU = RetentionDecision("lru")


@dataclass(frozen=True, slots=True)
class Release:
    """Send ``turn`` to ``engine`` with admission ``priority`` (lower runs first)."""

    turn: TurnRecord
    engine: str
    priority: float


@dataclass(frozen=True, slots=True)
class Retain:
    """Keep (or offload, or drop) ``turn``'s session KV on ``engine`` during its tool call."""

    turn: TurnRecord
    engine: str
    decision: RetentionDecision


Action = Release | Retain
