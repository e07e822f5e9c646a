"""The field's shipped agent policies, as baselines written from their public descriptions
(read, not copied). Each sees only what the gateway sees: turn indices, ready times, attained
tokens, and the engines' reported load.

- ``turn-priority`` (llm-d router, agentic-serving guide and talk: "favour agents near
  completion so their KV is freed"): score = turn index + ``wait_weight`` (0.05) x seconds
  waiting; a session idle longer than ``reset_idle_s`` (120 s) counts its turns from 0 again.
- ``las`` (llm-d's program-aware fairness): least attained service per program (tokens served
  to the session so far), lowest first, continuous rather than in levels (``plas`` is the
  levelled Autellix form).

Both release at once while the engines are not saturated, and hold ready turns in their order
only while every healthy engine is saturated, as llm-d's flow control queues requests: KV
demand above ``kv_saturation`` (0.8) of capacity, or more than ``max_active`` (8) requests in
flight per engine (the saturation examples llm-d gives). Continuum/CacheTTL's TTL retention is
``ttl`` (:mod:`turnstile.policies.retention`). Dynamo's session stickiness is the routing
policy ``sticky`` here.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import ClassVar

from turnstile.core.interfaces import AdmissionPolicy
from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, TurnState, WorkflowRecord
from turnstile.policies.base import RELEASE, ROUTING
from turnstile.policies.routing import StatelessRouting, _healthy


def saturated(e: EngineLoad, kv_saturation: float, max_active: int) -> bool:
    """``e`` is saturated: KV demand (released plus paused sessions) above ``kv_saturation`` x
    capacity (known capacity only), or more than ``max_active`` turns in flight."""
    if e.outstanding_turns > max_active:
        return True
    cap = e.capacity_tokens
    return cap > 0 and e.outstanding_tokens + e.paused_context_tokens > kv_saturation * cap


class _SaturationGated:
    """Ready turns in a heap by :meth:`key` (lower first); all go while some healthy engine is
    not saturated, none while every one is (or when none is idle and all are saturated)."""

    name: ClassVar[str] = "saturation-gated"

    def __init__(self, *, kv_saturation: float = 0.8, max_active: int = 8) -> None:
        self.kv_saturation = kv_saturation
        self.max_active = max_active
        self._heap: list[tuple[float, int, TurnRecord]] = []
        self._seq = 0

    def key(self, turn: TurnRecord, now: float) -> float:
        raise NotImplementedError

    def add(self, turn: TurnRecord, now: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.key(turn, now), self._seq, turn))

    def _open(self, view: ClusterView) -> bool:
        return view.any_idle() or any(
            not saturated(e, self.kv_saturation, self.max_active) for e in view.healthy())

    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        heap = self._heap
        while heap:
            turn = heap[0][2]
            if turn.state != TurnState.READY:
                heapq.heappop(heap)
                continue
            if not self._open(view):
                return
            heapq.heappop(heap)
            yield turn

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        pass

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        pass

    def next_wakeup(self, now: float) -> float | None:
        return None  # held only while saturated: a finishing turn wakes it

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float | None:
        return None

    def hold_bound_s(self, now: float) -> float:
        return float("inf")  # held while the engines stay saturated

    def admission_order(self) -> AdmissionPolicy | None:
        return None

    def __len__(self) -> int:
        return sum(1 for _, _, t in self._heap if t.state == TurnState.READY)


@RELEASE.register("turn-priority")
class TurnPriorityRelease(_SaturationGated):
    """llm-d's turn priority: score = turns since the session's last reset + ``wait_weight`` x
    seconds waiting, highest first; a gap of more than ``reset_idle_s`` between a session's
    turns resets its count. Since every waiting turn's score grows at the same rate, the order
    is the static key ``-(turns - wait_weight x ready_s)``."""

    name: ClassVar[str] = "turn-priority"

    def __init__(self, *, wait_weight: float = 0.05, reset_idle_s: float = 120.0,
                 kv_saturation: float = 0.8, max_active: int = 8) -> None:
        super().__init__(kv_saturation=kv_saturation, max_active=max_active)
        self.wait_weight = wait_weight
        self.reset_idle_s = reset_idle_s
        self._count: dict[str, tuple[int, float]] = {}  # session -> (turns, last ready)

    def key(self, turn: TurnRecord, now: float) -> float:
        wid = turn.workflow.id
        n, last = self._count.get(wid, (-1, turn.ready_s))
        n = 0 if n < 0 or turn.ready_s - last > self.reset_idle_s else n + 1
        self._count[wid] = (n, turn.ready_s)
        return -(n - self.wait_weight * turn.ready_s)

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        self._count.pop(workflow.id, None)


@RELEASE.register("las")
class LasRelease(_SaturationGated):
    """llm-d's program-aware fairness: least attained service first (tokens served to the
    session so far, prompt + output of its finished turns), arrival order among equals."""

    name: ClassVar[str] = "las"

    def key(self, turn: TurnRecord, now: float) -> float:
        return float(turn.workflow.attained_tokens)


@ROUTING.register("sticky")
class StickyRouting(StatelessRouting):
    """Dynamo's session stickiness: every turn of a session goes to the engine its previous
    turn ran on while that engine is healthy; a first turn (or one whose engine is gone) goes
    to the least-loaded healthy engine (outstanding tokens per unit of speed)."""

    name: ClassVar[str] = "sticky"

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        last = turn.workflow.last_engine
        if last is not None:
            e = view.get(last)
            if e is not None and e.healthy:
                return last
        return min(_healthy(view), key=lambda e: e.outstanding_tokens / e.weight).id
