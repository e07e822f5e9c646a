"""The scheduler core: turn state machine, policy interfaces, actions, clock seam."""

from turnstile.core.actions import LRU, Action, Release, Retain, RetentionDecision
from turnstile.core.clock import Clock, VirtualClock, WallClock
from turnstile.core.interfaces import (
    AdmissionPolicy,
    PolicyBundle,
    ReleasePolicy,
    RetentionPolicy,
    RoutingPolicy,
)
from turnstile.core.scheduler import Scheduler, SchedulerError
from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, TurnState, WorkflowRecord

__all__ = [
    "LRU",
    "Action",
    "AdmissionPolicy",
    "Clock",
    "ClusterView",
    "EngineLoad",
    "PolicyBundle",
    "Release",
    "ReleasePolicy",
    "Retain",
    "RetentionDecision",
    "RetentionPolicy",
    "RoutingPolicy",
    "Scheduler",
    "SchedulerError",
    "TurnRecord",
    "TurnState",
    "VirtualClock",
    "WallClock",
    "WorkflowRecord",
]
