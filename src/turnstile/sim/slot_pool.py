"""The engine model's slot-limited KV memory: one sequence per slot.

A slot-limited engine (an engine profile with ``kv_layout = "slots"``) has ``N`` slots of ``C / N``
KV tokens each, and keeps exactly one sequence per slot: across a tool call an engine holds at most
``N`` sessions, whatever their length, and a turn longer than ``C / N`` tokens cannot run. A request
runs in an idle slot, and what it finds cached is the common prefix with that slot's previous
contents: all of its session's last context if the slot held its session, nothing otherwise (or the
leading ``block_hashes`` the two share, for traces that name shared content). :class:`SlotPool`
models that behind the same check-then-commit interface as the paged
:class:`~turnstile.sim.block_pool.BlockPool`, in tokens (the engine runs it with
``block_size == 1``), so the batch scheduler and the step executor run unchanged.

Which slot a request gets is decided twice, as in front of a real server:

* when it is forwarded (:meth:`SlotPool.forward`, at ``submit``), turnstile's gateway (its
  adapter for a slot-limited engine, :func:`turnstile.core.slots.choose_slot`) picks from what
  *it* believes: the slot
  it last gave the session, if it counts no turn there; else a slot with no turn of its own
  and no pin: one it believes empty first, then the least recently used. The request is bound to
  that slot (``id_slot``) and runs there once the slot is idle. When there is no such slot
  (every one busy or pinned), the request goes unbound and the gateway forgets where the
  session's KV is;
* an unbound request gets, when it is admitted, the engine's choice: the rule its profile
  names (``EngineProfile.server_slot``, which the engine model passes; an engine profiled
  without one gets the neutral :func:`turnstile.sim.engine_profile.generic_server_slot`: the
  idle slot holding its session, else the least recently used idle one, ties to the lowest id).

So the gateway's belief can go stale: an unbound request may overwrite a slot the gateway still
thinks another session owns, and a session whose KV the gateway forgot looks like an empty
slot to the next session. A retention ``pin`` is the gateway's: it keeps other sessions' bound
requests off the slot the gateway believes the session owns, until the TTL; it reserves no
memory, and the server ignores it. ``discard`` erases that slot (if the gateway counts no turn
there); ``offload`` and ``lru`` leave it (this model has no slot save/restore tier). Memory
accounting (``free``/``private``) counts the tokens running requests compute, so that the
scheduler's block arithmetic holds; it never binds, since every slot owns ``C / N`` tokens and
at most ``N`` requests run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from turnstile.core.slots import SlotRule, choose_slot
from turnstile.sim.engine_config import EngineConfig
from turnstile.sim.request import SimRequest

if TYPE_CHECKING:
    from turnstile.core.actions import RetentionDecision


class Slot:
    """One slot. The engine's view: the sequence it holds (``session``, ``tokens``),
    whether a request runs in it (``busy``), when it was last used (``last_used``, a counter).
    The gateway's view: the session it believes the slot holds (``owner``), the turns it bound
    there and that are not over (``bound``), when it last used it (``gw_last_used``, a counter)
    and until when it pinned it (``pinned_until_s``)."""

    __slots__ = ("bound", "busy", "gw_last_used", "hashes", "id", "last_used", "owner",
                 "pinned_until_s",
                 "session", "tokens")

    def __init__(self, slot_id: int) -> None:
        self.id = slot_id
        self.session: str | None = None
        self.tokens = 0
        self.hashes: tuple[int, ...] | None = None
        self.busy = False
        self.last_used = 0
        self.owner: str | None = None
        self.bound = 0
        self.gw_last_used = 0
        self.pinned_until_s = 0.0

    def __repr__(self) -> str:
        return (f"<Slot {self.id} {self.session} {self.tokens} tok busy={self.busy} "
                f"owner={self.owner} bound={self.bound}>")


class SlotMatch:
    """What :meth:`SlotPool.match_prefix` found: the ``slot`` the request would run in (``None``:
    none is idle for it) and the ``n_hit`` leading tokens it would reuse there (``reload`` and
    ``taken`` are always 0)."""

    __slots__ = ("n_hit", "slot")
    reload = 0
    taken = 0

    def __init__(self, slot: Slot | None, n_hit: int) -> None:
        self.slot = slot
        self.n_hit = n_hit


class SlotPool:
    """The slots of one slot-limited engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, server_slot: SlotRule) -> None:
        """``server_slot``: the engine's rule for a request not bound to a slot (its profile's,
        ``EngineProfile.server_slot``; no default here, so no engine's pick is assumed)."""
        c = config
        self._server_slot = server_slot
        if c.block_size != 1:
            raise ValueError("a slot-limited engine counts KV in tokens: block_size must be 1")
        self.slot_tokens = c.slot_tokens
        self.slots = [Slot(i) for i in range(c.kv_slots)]
        self.caching = c.enable_prefix_cache
        self.hash_tokens = c.hash_block_tokens or 1
        self.bs = 1
        self.num_gpu_blocks = c.num_gpu_blocks
        self.free = c.num_gpu_blocks
        self.private = 0  # tokens running requests computed (not reused from their slot)
        self.n_evict = 0
        self.cpu_cap = 0
        self.cpu_used = 0
        self.ver = 0
        #: pins are the gateway's and are read against the clock when a request is forwarded:
        #: no pin ever expires inside the engine (the step executor reads an empty heap)
        self.pin_heap: list[tuple[float, int, Slot]] = []
        self._tick = 0
        #: request -> the slot the gateway bound it to (until it finishes)
        self.bound: dict[SimRequest, Slot] = {}
        #: running request -> its slot
        self.held: dict[SimRequest, Slot] = {}
        #: tokens of other sessions' sequences a request overwrote (a slot eviction)
        self.evicted_blocks = 0
        #: requests forwarded unbound (every slot busy or pinned in the gateway's view)
        self.unbound = 0
        self.offloaded_blocks = 0
        self.reloaded_blocks = 0

    @property
    def available(self) -> int:
        return self.free

    # -- the gateway's choice, when a request is forwarded ---------------------------------------

    def forward(self, req: SimRequest, now: float) -> None:
        """The gateway forwards ``req`` at ``now``: bind it to a slot, as its adapter's
        ``begin`` does, or leave it to the engine."""
        own, slot = choose_slot(self.slots, req.session, now)
        if slot is None:
            self.unbound += 1
            if own is not None:
                own.owner = None  # the server picks: where the session's KV is, is unknown
            return
        if own is not None and own is not slot:
            own.owner = None
        slot.owner = req.session
        slot.bound += 1
        slot.pinned_until_s = 0.0
        self._tick += 1
        slot.gw_last_used = self._tick
        self.bound[req] = slot

    # -- check-then-commit ----------------------------------------------------------------------

    def choose(self, req: SimRequest) -> Slot | None:
        """The slot ``req`` runs in if admitted now: its bound slot if idle, else (unbound) the
        engine's pick; ``None`` when there is none."""
        slot = self.bound.get(req)
        if slot is not None:
            return None if slot.busy else slot
        return self._server_slot(self.slots, req.session)

    def match_prefix(self, req: SimRequest, target: int) -> SlotMatch:
        """The slot ``req`` would run in and the prefix it reuses there, leaving at least one of
        its ``target`` tokens to compute. Changes nothing."""
        slot = self.choose(req)
        hit = 0
        if slot is not None and self.caching and slot.tokens:
            if slot.session == req.session:
                hit = slot.tokens
            elif req.block_hashes and slot.hashes:
                j = 0
                for a, b in zip(req.block_hashes, slot.hashes, strict=False):
                    if a != b:
                        break
                    j += 1
                hit = min(j * self.hash_tokens, slot.tokens, req.prompt_tokens)
            if hit > target - 1:
                hit = target - 1
        return SlotMatch(slot, hit)

    def can_allocate(self, match: SlotMatch, new: int) -> bool:
        """Whether the request's slot is idle (a slot's memory holds what may run in it)."""
        return match.slot is not None and new <= self.free

    def allocate(self, req: SimRequest, match: SlotMatch, new: int) -> None:
        """Commit: ``req`` runs in ``match.slot``, whose sequence beyond the reused prefix is
        dropped (another session's sequence is evicted whole)."""
        slot = match.slot
        assert slot is not None and not slot.busy
        if slot.session != req.session and slot.tokens:
            self.evicted_blocks += slot.tokens - match.n_hit
        slot.session = req.session
        slot.tokens = match.n_hit
        slot.hashes = req.block_hashes
        slot.busy = True
        self._tick += 1
        slot.last_used = self._tick
        self.held[req] = slot
        self.free -= new
        self.private += new
        req._n_hit = match.n_hit

    def take(self, n: int) -> None:
        """``n`` more tokens for a running request (the caller checked they are available)."""
        self.free -= n

    def release(self, req: SimRequest, kv_len: int) -> None:
        """``req`` finished with ``kv_len`` tokens in its slot: they stay there as the slot's
        sequence until another request takes the slot. (No preemption here: memory never runs
        out.)"""
        slot = self.held.pop(req)
        private = kv_len - req._n_hit
        self.private -= private
        self.free += private
        slot.busy = False
        slot.tokens = kv_len if self.caching else 0
        self._tick += 1
        slot.last_used = self._tick
        gw = self.bound.pop(req, None)
        if gw is not None:  # the gateway's end(): the turn is over
            gw.bound -= 1
            gw.gw_last_used = self._tick
        self.ver += 1

    def slot_of(self, req: SimRequest) -> int:
        """The id of the slot ``req`` runs in (it was allocated one)."""
        return self.held[req].id

    def remember_session(self, req: SimRequest, kv_len: int) -> None:
        """Nothing to remember: the slot holds the session's sequence."""

    # -- retention ------------------------------------------------------------------------------

    def _owned(self, session: str) -> Slot | None:
        for s in self.slots:
            if s.owner == session:
                return s
        return None

    def retain(self, session: str, decision: RetentionDecision, now: float) -> None:
        """As the gateway's slot adapter: ``pin`` keeps other sessions' requests off the
        slot it believes ``session`` owns until ``now + ttl_s``; ``discard`` erases that slot
        (when the gateway counts no turn there); ``offload``/``lru`` leave it."""
        action = decision.action
        if action in ("lru", "offload"):
            return
        slot = self._owned(session)
        if slot is None:
            return
        if action == "pin":
            slot.pinned_until_s = now + decision.ttl_s
        elif action == "discard":
            if not slot.bound and not slot.busy:
                slot.session = None
                slot.tokens = 0
                slot.hashes = None
                slot.owner = None
                self.ver += 1
        else:
            raise ValueError(f"unknown retention action {action!r}")

    @property
    def next_pin_expiry(self) -> float | None:
        return None

    def expire_pins(self, now: float) -> None:
        """Nothing expires inside the engine (see ``pin_heap``)."""

    def session_blocks(self, session: str) -> tuple[int, int]:
        """(tokens in a slot, 0) of ``session``'s last sequence."""
        for s in self.slots:
            if s.session == session:
                return (s.tokens, 0)
        return (0, 0)

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self, held: Iterable[tuple[SimRequest, int]]) -> None:
        """Recount from scratch (tests). ``held``: each running request with its KV tokens."""
        held = list(held)
        assert {r for r, _ in held} == set(self.held), (held, self.held)
        assert sum(s.busy for s in self.slots) == len(self.held)
        private = 0
        for req, kv_len in held:
            slot = self.held[req]
            assert slot.busy and slot.session == req.session, slot
            assert kv_len <= self.slot_tokens, (req, kv_len)
            assert self.bound.get(req, slot) is slot, (req, slot)
            private += kv_len - req._n_hit
        assert private == self.private and self.free + private == self.num_gpu_blocks, (
            private, self.private, self.free)
        for s in self.slots:
            assert 0 <= s.tokens <= self.slot_tokens, s
            assert s.bound == sum(1 for b in self.bound.values() if b is s), s
        owners = [s.owner for s in self.slots if s.owner is not None]
        assert len(owners) == len(set(owners)), owners
