"""Admission policies: the order an engine admits the turns queued at it."""

from __future__ import annotations

from turnstile.core.state import EngineLoad, TurnRecord
from turnstile.policies.base import ADMISSION


@ADMISSION.register("fcfs")
class FcfsAdmission:
    """Baseline: one priority for all, so the engine admits in arrival order."""

    name = "fcfs"

    def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float:
        return 0.0
