"""Engine profiles: everything one serving engine does differently, behind one small interface.

The engine model (:mod:`turnstile.sim.engine`, the step executor, the KV pools) and the step-time
models are general: they never ask which engine they model. Where engines differ, they read a
rule or a number from the engine's :class:`EngineProfile`:

``kv_layout``
    ``paged``: KV in blocks of ``block_size`` tokens with a prefix cache of that granularity;
    ``slots``: one sequence per slot (:mod:`turnstile.sim.slot_pool`), counted in tokens;
``server_slot``
    on a slot-limited engine (or one whose forward passes follow its slots), the idle slot the
    engine gives a request not bound to one (a :data:`turnstile.core.slots.SlotRule`; an engine
    profiled without one gets :func:`generic_server_slot`, a neutral rule);
``max_batched_tokens``, ``ubatch_tokens``, ``ubatch_split``, ``one_token_pass``
    how the engine cuts a step: its default logical batch, and into which forward passes
    (:func:`turnstile.sim.fitted_perf.forward_passes`); whether a pass of one token has its
    own fixed cost;
``attention_tile_tokens``
    the query tokens from which the engine's attention kernel computes in tiles of that size (the
    ``below`` and ``tiles`` small-chunk rules of :class:`~turnstile.sim.fitted_perf.FittedPerf`; 0:
    no such kernel switch);
``warm``
    the :class:`WarmRule` that decides which steps pay a fitted cold-step cost (None: the engine
    has no cold steps);
``priority_order``
    how the engine reads a request's ``priority`` (:data:`PRIORITY_ORDERS`);
``kv_pinning``
    whether a session's KV can be pinned, offloaded or discarded across its tool call at the
    scheduler's word (False: the retention policy's decisions are no-ops, the engine's own LRU
    prefix cache decides, as the gateway's adapter for such an engine makes them).

Profiles of real engines live in :mod:`turnstile.sim.profiles` (one module each) and register
themselves; :func:`profile_for` finds one by the engine kind a profile file or an adapter names,
and gives :data:`GENERIC` (no quirk at all) for a kind it does not know.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from turnstile.core.slots import ServerSlot, SlotRule

__all__ = [
    "GENERIC",
    "KV_LAYOUTS",
    "PRIORITY_ORDERS",
    "EngineProfile",
    "WarmRule",
    "generic_server_slot",
    "get_profile",
    "profile_for",
    "profile_names",
    "register",
]

#: ``paged``: blocks with a prefix cache; ``slots``: one sequence per slot
KV_LAYOUTS = ("paged", "slots")
#: ``lower-first``: a lower ``priority`` runs first; ``higher-first``: the reverse; ``ignored``:
#: the engine runs requests in arrival order whatever their priority
PRIORITY_ORDERS = ("lower-first", "higher-first", "ignored")

V = TypeVar("V", bound=ServerSlot)


def generic_server_slot(slots: Iterable[V], session: str) -> V | None:
    """The neutral slot rule (a :data:`~turnstile.core.slots.SlotRule`), for an engine whose
    profile names none (:data:`GENERIC` among them): the idle slot holding ``session``'s
    sequence, else the least recently used idle one, a tie (slots never used) to the *first* in
    ``slots``, i.e. the lowest id; None when every slot is busy.

    No engine was measured to pick this way; it is the plain reading of "reuse the session's
    slot, else the oldest", with ties broken in id order. An engine whose pick differs (another
    tie-break, a prefix match across sessions) names its own rule in its profile: which slots are
    busy sets how a step is cut into forward passes (:mod:`turnstile.sim.lanes`), so even the
    tie-break can move step times."""
    lru = None
    for s in slots:
        if s.busy:
            continue
        if s.session == session:
            return s
        if lru is None or s.last_used < lru.last_used:
            lru = s
    return lru


@dataclass(frozen=True, slots=True)
class WarmRule:
    """Which steps run with the engine's caches warm (the rest pay a fitted cold-step cost).

    A step runs *warm* after ``steps`` iterations in a row of fewer than ``max_prefill`` prompt
    tokens each, with no pause of more than ``gap_s`` before it; an iteration that computes
    ``max_prefill`` prompt tokens or more, or a pause, starts the count again."""

    gap_s: float
    steps: int
    max_prefill: int

    def __post_init__(self) -> None:
        if not (self.gap_s >= 0 and self.steps >= 0 and self.max_prefill >= 0):
            raise ValueError(f"a warm rule's terms must be >= 0, got {self}")


@dataclass(frozen=True)
class EngineProfile:
    """What one engine does differently (see the module docstring for each hook)."""

    #: the engine kind, as adapters and profile files name it
    name: str
    #: other spellings of the kind
    aliases: tuple[str, ...] = ()
    kv_layout: str = "paged"
    #: KV block tokens of a paged engine (its prefix cache's granularity); 1 with slots
    block_size: int = 16
    #: the engine's pick of an idle slot for an unbound request (:func:`generic_server_slot`
    #: unless the engine's profile names its own)
    server_slot: SlotRule = generic_server_slot
    max_batched_tokens: int = 8192
    ubatch_tokens: int = 0
    ubatch_split: str = "simple"
    one_token_pass: bool = False
    attention_tile_tokens: float = 0.0
    warm: WarmRule | None = None
    priority_order: str = "lower-first"
    #: the retention policy's pin/offload/discard reach the engine's KV (False: no-ops there)
    kv_pinning: bool = True
    #: what the engine must be started with for the profile to hold, and what it ignores
    notes: str = ""

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.priority_order not in PRIORITY_ORDERS:
            raise ValueError(f"priority_order must be one of {PRIORITY_ORDERS}, "
                             f"got {self.priority_order!r}")
        if self.block_size < 1 or (self.kv_layout == "slots" and self.block_size != 1):
            raise ValueError(f"block_size must be >= 1 (1 with slots), got {self.block_size}")

    @property
    def slot_limited(self) -> bool:
        """The engine keeps one sequence per slot (simulate its slots, not paged KV)."""
        return self.kv_layout == "slots"

    @property
    def honours_priority(self) -> bool:
        return self.priority_order != "ignored"


#: the profile of an engine kind nobody profiled: paged KV, no kernel switch, no cold steps,
#: the neutral slot rule
GENERIC = EngineProfile(name="generic")

_PROFILES: dict[str, EngineProfile] = {}
#: the package whose modules hold the real engines' profiles (imported on first lookup)
_PACKAGE = "turnstile.sim.profiles"


def _norm(kind: str) -> str:
    return kind.strip().lower()


def register(profile: EngineProfile) -> EngineProfile:
    """Make ``profile`` known by its name and aliases (an engine's module calls it)."""
    for key in (profile.name, *profile.aliases):
        other = _PROFILES.get(_norm(key))
        if other is not None and other is not profile:
            raise ValueError(f"engine kind {key!r} is already {other.name!r}'s profile")
        _PROFILES[_norm(key)] = profile
    return profile


def _loaded() -> dict[str, EngineProfile]:
    if not _PROFILES:
        importlib.import_module(_PACKAGE)
    return _PROFILES


def profile_for(kind: str | None) -> EngineProfile:
    """The profile of engine kind ``kind`` (any registered spelling, any case); :data:`GENERIC`
    for an empty or unknown kind."""
    return _loaded().get(_norm(kind or ""), GENERIC)


def get_profile(kind: str) -> EngineProfile:
    """The profile of ``kind``; a ``KeyError`` naming the known kinds when there is none."""
    found = _loaded().get(_norm(kind))
    if found is None:
        raise KeyError(f"no engine profile {kind!r}; known: {', '.join(profile_names())}")
    return found


def profile_names() -> list[str]:
    """The registered engine kinds (their main names)."""
    return sorted({p.name for p in _loaded().values()})
