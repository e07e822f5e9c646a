"""Routing policies: which engine a released turn runs on."""

from __future__ import annotations

from turnstile.core.state import ClusterView, EngineLoad, TurnRecord
from turnstile.policies.base import ROUTING


class NoHealthyEngineError(RuntimeError):
    pass


def _healthy(view: ClusterView) -> list[EngineLoad]:
    engines = view.healthy()
    if not engines:
        raise NoHealthyEngineError("no healthy engine to route to")
    return engines


@ROUTING.register("round-robin")
class RoundRobinRouting:
    """Baseline: engines in turn, skipping unhealthy ones."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        ids = view.ids
        for _ in range(len(ids)):
            engine = view[ids[self._next % len(ids)]]
            self._next += 1
            if engine.healthy:
                return engine.id
        raise NoHealthyEngineError("no healthy engine to route to")


@ROUTING.register("least-loaded")
class LeastLoadedRouting:
    """Baseline: the engine with the fewest outstanding tokens per unit of speed.

    Ties go to the engine listed first, so the choice is deterministic.
    """

    name = "least-loaded"

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        return min(_healthy(view), key=lambda e: e.outstanding_tokens / e.weight).id
