"""Retention policies: how long a session's KV is kept across a tool call."""

from __future__ import annotations

from turnstile.core.state import EngineLoad, TurnRecord
from turnstile.policies.base import LRU, RETENTION, RetentionDecision


@RETENTION.register("lru")
class LruRetention:
    """Baseline: no pinning; the engine's prefix cache evicts least-recently-used blocks."""

    name = "lru"

    def on_tool_start(self, turn: TurnRecord, engine: EngineLoad, now: float) -> RetentionDecision:
        return LRU

    def on_tool_end(self, turn: TurnRecord, now: float) -> None:
        pass
