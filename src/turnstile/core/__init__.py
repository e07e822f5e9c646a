"""The scheduler core: turn state machine, policy registries, clock seam."""

from turnstile.core.clock import Clock, VirtualClock, WallClock
from turnstile.core.scheduler import Action, Release, Retain, Scheduler, SchedulerError
from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, TurnState, WorkflowRecord

__all__ = [
    "Action",
    "Clock",
    "ClusterView",
    "EngineLoad",
    "Release",
    "Retain",
    "Scheduler",
    "SchedulerError",
    "TurnRecord",
    "TurnState",
    "VirtualClock",
    "WallClock",
    "WorkflowRecord",
]
