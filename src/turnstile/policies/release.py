"""Release policies: when a READY turn is sent to an engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import ClassVar

from turnstile.core.interfaces import AdmissionPolicy
from turnstile.core.state import ClusterView, TurnRecord, WorkflowRecord
from turnstile.policies.base import RELEASE


@RELEASE.register("eager")
class EagerRelease:
    """Baseline: release every ready turn at once, first come first served."""

    name: ClassVar[str] = "eager"

    def __init__(self) -> None:
        self._queue: deque[TurnRecord] = deque()

    def add(self, turn: TurnRecord, now: float) -> None:
        self._queue.append(turn)

    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        q = self._queue
        while q:
            yield q.popleft()

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        pass

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        pass

    def next_wakeup(self, now: float) -> float | None:
        return None

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float | None:
        return 0.0  # every ready turn is released at once

    def hold_bound_s(self, now: float) -> float:
        return 0.0  # never holds

    def admission_order(self) -> AdmissionPolicy | None:
        return None

    def __len__(self) -> int:
        return len(self._queue)
