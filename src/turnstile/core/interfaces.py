"""The four policy interfaces the scheduler core asks for decisions.

Policies are synchronous and never touch engines, clocks or the network: they read the records
and the :class:`~turnstile.core.state.ClusterView` they are given and return decisions; what
they learn they keep in their own state (never on the records, which only the core writes).
Every hook the core calls is declared here, and the core calls it on every policy of the kind
(a policy with nothing to do implements it as a no-op): nothing is discovered by name. The
simulator and the gateway drive the *same* policy objects through
:class:`~turnstile.core.scheduler.Scheduler`. Implementations and their registries live in
:mod:`turnstile.policies`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Protocol, runtime_checkable

from turnstile.core.actions import RetentionDecision
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

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        """``workflow`` finished (its flow time is now known): learn from it, forget it."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """When the policy wants to be asked again with no other event (a hold timer)."""
        ...

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float | None:
        """How long a next ready turn of ``workflow`` is expected to be held before release
        (read by retention policies bound to this one); None: the policy does not estimate it."""
        ...

    def hold_bound_s(self, now: float) -> float:
        """The longest this policy holds a ready turn as of ``now`` (0: it never holds;
        ``inf``: no bound). Health checks compare :meth:`Scheduler.oldest_hold_age` to it."""
        ...

    def admission_order(self) -> AdmissionPolicy | None:
        """The engine-queue order that belongs with this release order (PLAS orders engine
        queues by the same levels it releases by), used when a spec names no admission
        policy; None: the default admission policy."""
        ...

    def __len__(self) -> int: ...


@runtime_checkable
class RoutingPolicy(Protocol):
    """Decides *where* a released turn runs."""

    name: ClassVar[str]

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str: ...

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        """``workflow`` finished (its turns' real output lengths and tool returns are now all
        known): learn from it, forget it (bucket routers such as ``cmlfq``)."""
        ...


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decides the order in which an engine admits the turns queued at it.

    Returns a priority: lower runs first; equal priorities are admitted in arrival order. (An
    engine that reads priorities another way, or ignores them, says so in its engine profile;
    the driver translates.)
    """

    name: ClassVar[str]

    def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float: ...


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides how long a session's KV is kept across a tool call."""

    name: ClassVar[str]

    def on_tool_start(self, turn: TurnRecord, engine: EngineLoad, now: float) -> RetentionDecision:
        ...

    def on_tool_end(self, turn: TurnRecord, now: float) -> None:
        """The tool call returned (its duration is now known): learn from it."""
        ...

    def bind(self, release: ReleasePolicy) -> None:
        """Called once with the release policy of the same set, before any event (a policy
        that reads :meth:`ReleasePolicy.expected_hold_s` keeps it; the others ignore it)."""
        ...


class PolicyBundle(Protocol):
    """One policy of each kind: what a :class:`~turnstile.core.scheduler.Scheduler` drives
    (``turnstile.policies.PolicySet`` builds one from a spec)."""

    release: ReleasePolicy
    routing: RoutingPolicy
    admission: AdmissionPolicy
    retention: RetentionPolicy
