"""Which slot a session's turn runs in, on an engine that keeps one sequence per slot: the
gateway's choice, and the shape of the engine's.

A gateway in front of a slot-limited engine binds each turn to a slot from what it believes the
slots hold; the simulator's slot-limited KV model makes the same choice, so that it predicts what
the gateway will do. Both keep their own bookkeeping and call :func:`choose_slot`. A turn sent
unbound gets the engine's own pick: a :data:`SlotRule`. Which rule is the engine's own, and so
lives with the rest of what that engine does differently, in its profile
(``turnstile.sim.engine_profile.EngineProfile.server_slot``); this module defines none. The
simulator's models of an engine's slots (``sim.slot_pool``, ``sim.lanes``) call the rule the
profile gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

__all__ = ["GatewaySlot", "ServerSlot", "SlotRule", "choose_slot"]


class GatewaySlot(Protocol):
    """What the gateway believes of one slot."""

    @property
    def owner(self) -> str | None:
        """The session whose KV the slot holds (None: empty, or unknown)."""

    @property
    def bound(self) -> int:
        """Turns bound to the slot and not over."""

    @property
    def pinned_until_s(self) -> float:
        """Until when a retention pin keeps other sessions off the slot."""

    @property
    def gw_last_used(self) -> float:
        """When the gateway last bound or released a turn there (any increasing clock)."""


class ServerSlot(Protocol):
    """What the engine knows of one slot."""

    @property
    def busy(self) -> bool:
        """A request runs in it."""

    @property
    def session(self) -> str | None:
        """The session whose sequence it holds (None: empty)."""

    @property
    def last_used(self) -> int:
        """When a request last started or ended there (any increasing counter)."""


S = TypeVar("S", bound=GatewaySlot)
V = TypeVar("V", bound=ServerSlot)

#: how an engine picks the idle slot of a request not bound to one: ``rule(slots, session)``,
#: the slots in id order, returns one of the idle ones, or None when every slot is busy
SlotRule = Callable[[Iterable[V], str], V | None]


def choose_slot(slots: Iterable[S], session: str, now_s: float) -> tuple[S | None, S | None]:
    """``(own, chosen)``: the slot the gateway believes holds ``session`` (None: none), and the
    slot to bind the turn to: ``own`` if no turn is bound there; else a slot with no bound turn
    and no pin, one believed empty first, then the least recently used; None when there is
    none (every slot busy or pinned: the engine picks)."""
    own = best = None
    for s in slots:
        if s.owner == session:
            own = s
        elif not s.bound and s.pinned_until_s <= now_s and (
            best is None
            or (s.owner is None, -s.gw_last_used) > (best.owner is None, -best.gw_last_used)
        ):
            best = s
    return own, (own if own is not None and not own.bound else best)
