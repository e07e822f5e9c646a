"""Which llama.cpp slot a session's turn runs in: the gateway's choice and the server's.

The gateway's llama.cpp adapter binds each turn to a slot (``id_slot``) from what it believes
the slots hold; the simulator's slot-limited KV model makes the same choice, so that it predicts
what the gateway will do. Both keep their own bookkeeping and call :func:`choose_slot`. A turn
sent unbound gets the server's own pick, :func:`server_slot`, which the simulator's models of
the server's slots (``sim.slot_pool``, ``sim.lanes``) share.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

__all__ = ["GatewaySlot", "ServerSlot", "choose_slot", "server_slot"]


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
    """What the server knows of one slot."""

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


def server_slot(slots: Iterable[V], session: str) -> V | None:
    """The idle slot llama.cpp's server gives an unbound request of ``session``: the one holding
    the session's sequence (its longest-common-prefix pick), else the least recently used; None
    when every slot is busy.

    Ties go to the *last* such slot in ``slots``, as in the server's
    ``get_available_slot``, which keeps a slot whose ``t_last_used <= t_last``: its slots start
    never used (``t_last_used = -1``), so a fresh server fills them from the highest id down.
    Which slots are busy sets how a step is cut into forward passes (:mod:`turnstile.sim.lanes`)."""
    lru = None
    for s in slots:
        if s.busy:
            continue
        if s.session == session:
            return s
        if lru is None or s.last_used <= lru.last_used:
            lru = s
    return lru


def choose_slot(slots: Iterable[S], session: str, now_s: float) -> tuple[S | None, S | None]:
    """``(own, chosen)``: the slot the gateway believes holds ``session`` (None: none), and the
    slot to bind the turn to: ``own`` if no turn is bound there; else a slot with no bound turn
    and no pin, one believed empty first, then the least recently used; None when there is
    none (every slot busy or pinned: the server picks)."""
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
