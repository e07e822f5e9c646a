"""The four policy interfaces of the scheduler core.

Policies are synchronous and never touch engines, clocks or the network: they read the records
and the :class:`~turnstile.core.state.ClusterView` they are given and return decisions. The
simulator and the gateway drive the *same* policy objects.

Each policy kind has a registry keyed by its CLI name (``--policies cvar+kv-affinity+ttl``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

from turnstile.core.registry import Registry
from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, WorkflowRecord


@runtime_checkable
class ReleasePolicy(Protocol):
    """Decides *when* a READY turn is sent to an engine, and in what order.

    The policy owns its holding queue. ``add`` gives it a turn that became ready; ``select``
    yields the turns to release now, in release order, removing them from its queue (the core
    routes and releases each one before asking for the next, so the view stays current).
    """

    name: ClassVar[str]

    def add(self, turn: TurnRecord, now: float) -> None: ...

    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]: ...

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        """A released turn finished (its output length is now known): learn from it."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """When the policy wants to be asked again with no other event (a hold timer)."""
        ...

    # Optional: ``on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None`` is
    # called once per finished workflow when the policy defines it.

    def __len__(self) -> int: ...


@runtime_checkable
class RoutingPolicy(Protocol):
    """Decides *where* a released turn runs."""

    name: ClassVar[str]

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str: ...


@runtime_checkable
class WorkflowObserver(Protocol):
    """Declared hook: a policy (routing) that learns from each finished workflow — its turns'
    real output lengths and tool returns, all in the past by then."""

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None: ...


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decides the order in which an engine admits the turns queued at it.

    Returns a priority: lower runs first (vLLM's ``--scheduling-policy priority`` convention);
    equal priorities are admitted in arrival order.
    """

    name: ClassVar[str]

    def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float: ...


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    """What to do with a session's KV while its tool call runs."""

    action: Literal["lru", "pin", "offload", "discard"]
    #: how long to pin (``pin``) or keep in the offload tier (``offload``)
    ttl_s: float = 0.0


LRU = RetentionDecision("lru")


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides how long a session's KV is kept across a tool call."""

    name: ClassVar[str]

    def on_tool_start(self, turn: TurnRecord, engine: EngineLoad, now: float) -> RetentionDecision:
        ...

    def on_tool_end(self, turn: TurnRecord, now: float) -> None:
        """The tool call returned (its duration is now known): learn from it."""
        ...


RELEASE: Registry[ReleasePolicy] = Registry("release")
ROUTING: Registry[RoutingPolicy] = Registry("routing")
ADMISSION: Registry[AdmissionPolicy] = Registry("admission")
RETENTION: Registry[RetentionPolicy] = Registry("retention")
REGISTRIES: tuple[Registry, ...] = (RELEASE, ROUTING, ADMISSION, RETENTION)
