"""Retention of a session's cached KV across a tool call: pin, offload, discard (part of the
block pool, :class:`~turnstile.sim.block_pool.BlockPool`, which mixes this in).

A retention decision acts on the blocks of the session's last finished request. ``pin`` keeps
them out of the LRU until a deadline (a heap of pins expires them in time order); ``offload``
moves the unused ones to the CPU tier now; ``discard`` frees them and their CPU copies now.
Blocks a running request holds are never moved or freed.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turnstile.core.actions import RetentionDecision
    from turnstile.sim.request import Seg

# where BlockPool.sync puts a segment in the LRU: where it is, most recent, oldest
KEEP, MRU, FIRST = 0, 1, 2


class RetentionTier:
    """Pin / offload / discard on the block pool's state (a mixin of ``BlockPool``)."""

    # the pool's state this part works on (set by BlockPool.__init__)
    r: int
    caching: bool
    cpu_cap: int
    free: int
    n_evict: int
    cpu_used: int
    offloaded_blocks: int
    ver: int
    gpu: dict[Hashable, int]
    pin: dict[Hashable, float]
    segs: dict[tuple[str, int], Seg]
    lru: OrderedDict[Any, None]
    cpu: OrderedDict[Any, None]
    pin_heap: list[tuple[float, int, list[Hashable], Seg | None]]
    sessions: dict[str, tuple[int, tuple[int, ...] | None, int]]
    _pin_seq: int

    # BlockPool's (declared here, not under TYPE_CHECKING, so that mypyc can compile the mixin)
    def sync(self, seg: Seg, where: int) -> None:
        raise NotImplementedError

    def cpu_room(self) -> None:
        raise NotImplementedError

    def retain(self, session: str, decision: RetentionDecision, now: float) -> None:
        """Apply ``decision`` to ``session``'s cached blocks (see the module docstring; ``lru``
        and, without a tier, ``offload`` leave them to the LRU)."""
        action = decision.action
        if action == "lru" or not self.caching:
            return
        rec = self.sessions.get(session)
        if rec is None:
            return
        full, bh, m = rec
        hashes = bh[: min(m, full) // self.r] if bh else ()
        seg = self.segs.get((session, m))
        self.ver += 1
        if action == "pin":
            self.pin_session(hashes, seg, now + decision.ttl_s, now)
        elif action == "offload":
            if self.cpu_cap:
                self.offload_session(hashes, seg)
        elif action == "discard":
            self.discard_session(hashes, seg)
        else:
            raise ValueError(f"unknown retention action {action!r}")

    def pin_session(self, hashes: tuple[int, ...], seg: Seg | None, until: float,
                    now: float) -> None:
        if until <= now:
            return
        gpu, lru, pin = self.gpu, self.lru, self.pin
        pinned: list[Hashable] = []
        for h in hashes:
            if h not in gpu:
                continue
            if pin.get(h, -1.0) < until:
                pin[h] = until
            if h in lru:
                del lru[h]
                self.n_evict -= self.r
            pinned.append(h)
        if seg is not None and seg.g > seg.lo:
            if seg.pin_until < until:
                seg.pin_until = until
            self.sync(seg, KEEP)
        else:
            seg = None
        if pinned or seg is not None:
            heapq.heappush(self.pin_heap, (until, self._pin_seq, pinned, seg))
            self._pin_seq += 1

    @property
    def next_pin_expiry(self) -> float | None:
        return self.pin_heap[0][0] if self.pin_heap else None

    def expire_pins(self, now: float) -> None:
        """Unpin everything pinned until ``now`` or earlier; it becomes the oldest in the LRU."""
        heap, pin, gpu, lru = self.pin_heap, self.pin, self.gpu, self.lru
        self.ver += 1
        while heap and heap[0][0] <= now:
            _, _, hashes, seg = heapq.heappop(heap)
            for h in hashes:  # prefix first, each put at the front: the tail goes first
                until = pin.get(h)
                if until is None or until > now:
                    continue
                del pin[h]
                if gpu.get(h) == 0:
                    lru[h] = None
                    lru.move_to_end(h, last=False)
                    self.n_evict += self.r
            if seg is not None and 0 < seg.pin_until <= now:
                seg.pin_until = 0.0
                self.sync(seg, FIRST)  # ahead of its hash blocks: evicted first

    def offload_session(self, hashes: tuple[int, ...], seg: Seg | None) -> None:
        r = self.r
        cpu = self.cpu
        if seg is not None:
            seg.pin_until = 0.0
            floor = seg.floor()
            t = seg.g - floor
            if t > 0:
                seg.g = floor  # [floor, c) is now in the tier
                self.free += t
                self.cpu_used += t
                self.offloaded_blocks += t
                cpu[seg] = None
                cpu.move_to_end(seg)
            self.sync(seg, KEEP)
        gpu = self.gpu
        for h in reversed(hashes):  # tail first: it is evicted first from the tier
            if gpu.get(h) == 0:
                self.drop_gpu(h)
                cpu[h] = None
                self.cpu_used += r
                self.offloaded_blocks += r
        if self.cpu_used > self.cpu_cap:
            self.cpu_room()

    def discard_session(self, hashes: tuple[int, ...], seg: Seg | None) -> None:
        if seg is not None:
            seg.pin_until = 0.0
            floor = seg.floor()
            if seg.c > seg.g:
                self.cpu_used -= seg.c - seg.g
                del self.cpu[seg]
            self.free += seg.g - floor
            seg.g = seg.c = floor
            self.sync(seg, KEEP)
        gpu, cpu = self.gpu, self.cpu
        for h in hashes:
            if gpu.get(h) == 0:
                self.drop_gpu(h)
            elif h in cpu:
                del cpu[h]
                self.cpu_used -= self.r

    def drop_gpu(self, h: Hashable) -> None:
        """Free an unused cached hash block now."""
        del self.gpu[h]
        if h in self.lru:
            del self.lru[h]
            self.n_evict -= self.r
        self.pin.pop(h, None)
        self.free += self.r

    def session_blocks(self, session: str) -> tuple[int, int]:
        """(GPU, CPU) blocks still cached of ``session``'s last finished request."""
        rec = self.sessions.get(session)
        if rec is None:
            return (0, 0)
        full, bh, m = rec
        r = self.r
        on_gpu = on_cpu = 0
        for h in bh[: min(m, full) // r] if bh else ():
            if h in self.gpu:
                on_gpu += r
            elif h in self.cpu:
                on_cpu += r
        seg = self.segs.get((session, m))
        if seg is not None:
            on_gpu += seg.g - seg.lo
            on_cpu += seg.c - seg.g
        return on_gpu, on_cpu
