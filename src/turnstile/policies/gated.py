"""Release policies that hold ready turns behind a fixed in-flight cap and release them in a
static key order: ``fcfs-workflow`` and ``plas`` (Autellix's program-level LAS).

Both also order the engine queue by the same key (they implement ``priority`` and declare
themselves their :meth:`admission_order`), so a spec that names only the release policy gets the
same order at admission.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import ClassVar

from turnstile.core.interfaces import AdmissionPolicy
from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, TurnState, WorkflowRecord
from turnstile.policies.base import RELEASE


class _KeyedGatedRelease:
    """Ready turns in a heap by ``sort_key``; released while fewer than
    ``max_inflight_per_engine × engines`` are in flight, or when some engine is idle. A turn
    held longer than ``starvation_s`` goes first (anti-starvation)."""

    name: ClassVar[str] = "keyed"

    def __init__(self, max_inflight_per_engine: int = 16, starvation_s: float = 60.0) -> None:
        self.max_inflight_per_engine = max_inflight_per_engine
        self.starvation_s = starvation_s
        self._heap: list[tuple[float, float, int, TurnRecord]] = []
        self._fifo: list[tuple[float, int, TurnRecord]] = []
        #: the sequence number of each held turn's live entries (lazy deletion in both heaps)
        self._seq_of: dict[TurnRecord, int] = {}
        self._seq = 0
        self._n = 0

    def sort_key(self, turn: TurnRecord) -> float:
        raise NotImplementedError

    def add(self, turn: TurnRecord, now: float) -> None:
        self._seq += 1
        self._seq_of[turn] = self._seq
        heapq.heappush(self._heap, (self.sort_key(turn), turn.workflow.arrival_s, self._seq, turn))
        heapq.heappush(self._fifo, (now, self._seq, turn))
        self._n += 1

    def _valid(self, seq: int, turn: TurnRecord) -> bool:
        return self._seq_of.get(turn) == seq and turn.state == TurnState.READY

    def _take(self, turn: TurnRecord) -> TurnRecord:
        del self._seq_of[turn]
        self._n -= 1
        return turn

    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        fifo, heap = self._fifo, self._heap
        while fifo and (not self._valid(fifo[0][1], fifo[0][2]) or
                        now - fifo[0][0] >= self.starvation_s):
            _, seq, turn = heapq.heappop(fifo)
            if self._valid(seq, turn):
                yield self._take(turn)
        cap = self.max_inflight_per_engine * len(view)
        while heap:
            _, _, seq, turn = heap[0]
            if not self._valid(seq, turn):
                heapq.heappop(heap)
                continue
            if view.released_turns >= cap and not view.any_idle():
                return
            heapq.heappop(heap)
            yield self._take(turn)

    def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float:
        return self.sort_key(turn)

    def admission_order(self) -> AdmissionPolicy | None:
        return self  # engine queues in the same key order (see the module docstring)

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        pass

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        pass

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float | None:
        return None  # held behind a cap, for no estimated time

    def hold_bound_s(self, now: float) -> float:
        return self.starvation_s  # a turn held this long goes first

    def next_wakeup(self, now: float) -> float | None:
        fifo = self._fifo
        while fifo and not self._valid(fifo[0][1], fifo[0][2]):
            heapq.heappop(fifo)
        return fifo[0][0] + self.starvation_s if fifo else None

    def __len__(self) -> int:
        return self._n


@RELEASE.register("fcfs-workflow")
class FcfsWorkflowRelease(_KeyedGatedRelease):
    """Workflows first come, first served: a turn of an older workflow goes before any turn of
    a newer one, behind the fixed in-flight cap."""

    name: ClassVar[str] = "fcfs-workflow"

    def sort_key(self, turn: TurnRecord) -> float:
        return turn.workflow.arrival_s


@RELEASE.register("plas")
class PlasRelease(_KeyedGatedRelease):
    """Program-level least attained service in a multi-level feedback queue (Autellix, 2025).

    A workflow's level is set by the tokens of service it has received so far (prompt + output
    of its finished turns) against geometric thresholds; lower levels go first, FCFS by
    workflow arrival inside a level; turns held longer than ``starvation_s`` go first.
    """

    name: ClassVar[str] = "plas"

    def __init__(
        self,
        thresholds: tuple[int, ...] = (4_096, 32_768, 262_144, 2_097_152),
        max_inflight_per_engine: int = 16,
        starvation_s: float = 60.0,
    ) -> None:
        super().__init__(max_inflight_per_engine, starvation_s)
        self.thresholds = thresholds

    def level(self, attained_tokens: int) -> int:
        for i, t in enumerate(self.thresholds):
            if attained_tokens < t:
                return i
        return len(self.thresholds)

    def sort_key(self, turn: TurnRecord) -> float:
        return float(self.level(turn.workflow.attained_tokens))
