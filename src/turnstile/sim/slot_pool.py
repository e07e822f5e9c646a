"""The engine model's slot-limited KV memory (llama.cpp ``llama-server``): one sequence per slot.

A llama.cpp server started with ``-np N -c C`` has ``N`` slots of ``C / N`` KV tokens each, and
keeps exactly one sequence per slot: across a tool call an engine holds at most ``N`` sessions,
whatever their length, and a turn longer than ``C / N`` tokens cannot run. A request runs in an
idle slot, and what it finds cached is the common prefix with that slot's previous contents: all
of its session's last context if the slot held its session, nothing otherwise (or the leading
``block_hashes`` the two share, for traces that name shared content). :class:`SlotPool` models
that behind the same check-then-commit interface as the paged
:class:`~turnstile.sim.block_pool.BlockPool`, in tokens (the engine runs it with
``block_size == 1``), so the batch scheduler and the step executor run unchanged.

Which idle slot a request gets is what turnstile's gateway does in front of llama.cpp
(:class:`turnstile.gateway.adapters.LlamaCppAdapter.choose_slot`), with the server's own
choice where the gateway leaves it open:

1. the slot holding the request's session;
2. else an idle slot nobody pinned: empty first, then the least recently used;
3. else (every idle slot pinned) the server's choice: the least recently used idle slot.

A retention ``pin`` therefore only steers that choice for its TTL: it reserves no memory and
never makes a request wait. ``discard`` erases the session's slot; ``offload`` and ``lru``
leave it (this model has no slot save/restore tier). Memory accounting (``free``/``private``)
counts the tokens running requests compute, so that the scheduler's block arithmetic holds;
it never binds, since every slot owns ``C / N`` tokens and at most ``N`` requests run.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

from turnstile.sim.engine_config import EngineConfig
from turnstile.sim.request import SimRequest

if TYPE_CHECKING:
    from turnstile.core.actions import RetentionDecision


class Slot:
    """One llama.cpp slot: the sequence it holds (``session``, ``tokens``), whether a request
    runs in it, when it was last used (a counter) and until when a pin steers others off it."""

    __slots__ = ("busy", "hashes", "id", "last_used", "pin_until", "session", "tokens")

    def __init__(self, slot_id: int) -> None:
        self.id = slot_id
        self.session: str | None = None
        self.tokens = 0
        self.hashes: tuple[int, ...] | None = None
        self.busy = False
        self.last_used = 0
        self.pin_until = 0.0  # > 0 while pinned

    def __repr__(self) -> str:
        return f"<Slot {self.id} {self.session} {self.tokens} tok busy={self.busy}>"


class SlotMatch:
    """What :meth:`SlotPool.match_prefix` found: the ``slot`` the request would run in and the
    ``n_hit`` leading tokens it would reuse there (``reload`` and ``taken`` are always 0)."""

    __slots__ = ("n_hit", "slot")
    reload = 0
    taken = 0

    def __init__(self, slot: Slot | None, n_hit: int) -> None:
        self.slot = slot
        self.n_hit = n_hit


class SlotPool:
    """The slots of one slot-limited engine (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        c = config
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
        #: (until, seq, slot): pins in expiry order (stale entries are skipped)
        self.pin_heap: list[tuple[float, int, Slot]] = []
        self._pin_seq = 0
        self._tick = 0
        #: running request -> its slot
        self.held: dict[SimRequest, Slot] = {}
        #: tokens of other sessions' sequences a request overwrote (a slot eviction)
        self.evicted_blocks = 0
        self.offloaded_blocks = 0
        self.reloaded_blocks = 0

    @property
    def available(self) -> int:
        return self.free

    # -- check-then-commit ----------------------------------------------------------------------

    def choose(self, session: str) -> Slot | None:
        """The idle slot a request of ``session`` gets (see the module docstring); ``None``
        when every slot is busy."""
        own = free = lru = None
        for s in self.slots:
            if s.busy:
                continue
            if s.session == session:
                own = s
                break
            if not s.pin_until and (
                free is None
                or (s.session is None, -s.last_used) > (free.session is None, -free.last_used)
            ):
                free = s
            if lru is None or s.last_used < lru.last_used:
                lru = s
        return own or free or lru

    def match_prefix(self, req: SimRequest, target: int) -> SlotMatch:
        """The slot ``req`` would run in and the prefix it reuses there, leaving at least one of
        its ``target`` tokens to compute. Changes nothing."""
        slot = self.choose(req.session)
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
        """Whether there is an idle slot (a slot's memory always holds what may run in it)."""
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
        slot.pin_until = 0.0
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
        """``req`` finished (or was preempted) with ``kv_len`` tokens in its slot: they stay
        there as the slot's sequence until another request takes the slot."""
        slot = self.held.pop(req)
        private = kv_len - req._n_hit
        self.private -= private
        self.free += private
        slot.busy = False
        slot.tokens = kv_len if self.caching else 0
        self._tick += 1
        slot.last_used = self._tick
        self.ver += 1

    def remember_session(self, req: SimRequest, kv_len: int) -> None:
        """Nothing to remember: the slot holds the session's sequence."""

    # -- retention ------------------------------------------------------------------------------

    def _slot_of(self, session: str) -> Slot | None:
        for s in self.slots:
            if s.session == session:
                return s
        return None

    def retain(self, session: str, decision: RetentionDecision, now: float) -> None:
        """``pin``: keep other sessions off ``session``'s slot until ``now + ttl_s`` while
        another slot is free to take; ``discard``: erase it (if idle); ``offload``/``lru``:
        leave it."""
        action = decision.action
        if action in ("lru", "offload"):
            return
        slot = self._slot_of(session)
        if slot is None:
            return
        self.ver += 1
        if action == "pin":
            until = now + decision.ttl_s
            if until > now:
                slot.pin_until = until
                heapq.heappush(self.pin_heap, (until, self._pin_seq, slot))
                self._pin_seq += 1
        elif action == "discard":
            if not slot.busy:
                slot.session = None
                slot.tokens = 0
                slot.hashes = None
                slot.pin_until = 0.0
        else:
            raise ValueError(f"unknown retention action {action!r}")

    @property
    def next_pin_expiry(self) -> float | None:
        return self.pin_heap[0][0] if self.pin_heap else None

    def expire_pins(self, now: float) -> None:
        """Unpin every slot pinned until ``now`` or earlier."""
        heap = self.pin_heap
        self.ver += 1
        while heap and heap[0][0] <= now:
            _, _, slot = heapq.heappop(heap)
            if 0 < slot.pin_until <= now:
                slot.pin_until = 0.0

    def session_blocks(self, session: str) -> tuple[int, int]:
        """(tokens in a slot, 0) of ``session``'s last sequence."""
        slot = self._slot_of(session)
        return (slot.tokens if slot is not None else 0, 0)

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
            private += kv_len - req._n_hit
        assert private == self.private and self.free + private == self.num_gpu_blocks, (
            private, self.private, self.free)
        for s in self.slots:
            assert 0 <= s.tokens <= self.slot_tokens, s
