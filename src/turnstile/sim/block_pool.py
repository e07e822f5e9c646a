"""The engine model's paged KV memory: a block pool with a prefix cache and a CPU offload tier.

``num_gpu_blocks == free + private + cached``: *private* blocks belong to running requests and
are not (yet) in the prefix cache; *cached* blocks are named (see below), shared by every
request whose prompt starts with them, and *evictable* when no running request holds them and
no retention pin protects them. Evictable units wait in an LRU list; an allocation that finds
too few free blocks evicts the oldest (to the CPU tier when there is one, as a CPU offload
connector does; otherwise they are gone). The tier drops its own oldest blocks when full.

How blocks are named (what makes two requests share KV):

* ``block_hashes`` (optional, e.g. Mooncake hash ids) name the prompt's leading full blocks,
  ``hash_block_tokens`` tokens each (``r`` KV blocks); equal hashes are equal content, shared
  across sessions. Only hash blocks that lie wholly inside the prompt are used. Each is cached
  (refcounted) one hash block at a time.
* Every later block (all of them without ``block_hashes``) is named by the session and its
  position: a session's turn n+1 extends turn n's prompt and output, so its blocks match. Where
  a turn's hash run stops at the block where an earlier turn of its session began its
  session-named blocks, the turn names its blocks from there on by the session too (the
  content the earlier turn stored; without it, every turn of a growing hashed session missed
  the hash block its predecessor's prompt ended in, and the output after it). The
  session-named blocks of a session form one :class:`Seg` that caches, evicts (tail first, as paged
  engines free a request's blocks in reverse) and offloads as a range in O(1). The LRU therefore
  orders segments and hash blocks, not single blocks: a segment's tail is evicted first, and a whole
  segment is as recent as its last release.

The scheduler uses it check-then-commit, like a minimal block manager: :meth:`match_prefix`
(read-only) → :meth:`can_allocate` → :meth:`allocate` on admission; :meth:`take` for the blocks
of a growing request; :meth:`release` (insert into the prefix cache) when a request finishes or
is preempted. Retention (pin, offload, discard) is in :mod:`turnstile.sim.kv_retention`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

from turnstile.sim.engine_config import EngineConfig
from turnstile.sim.kv_retention import FIRST, KEEP, MRU, RetentionTier
from turnstile.sim.request import Seg, SimRequest


class PrefixMatch:
    """What :meth:`BlockPool.match_prefix` found for a request (read-only until committed).

    ``n_exp`` leading hash blocks hit (``exp_cpu`` of them only in the CPU tier, ``exp_take``
    of them evictable now), then ``seg_hit`` blocks of the session segment ``seg``
    (``seg_reload`` from the CPU tier; ``seg_take`` evictable blocks it would hold)."""

    __slots__ = ("exp_cpu", "exp_take", "m", "n_exp", "n_hit", "reload", "seg", "seg_hit",
                 "seg_reload", "taken")

    def __init__(self, m: int, n_exp: int, exp_cpu: int, exp_take: int, seg: Seg | None,
                 seg_hit: int, seg_reload: int, seg_take: int, r: int) -> None:
        self.m = m
        self.n_exp = n_exp
        self.exp_cpu = exp_cpu
        self.exp_take = exp_take
        self.seg = seg
        self.seg_hit = seg_hit
        self.seg_reload = seg_reload
        #: leading blocks shared with the cache
        self.n_hit = n_exp * r + seg_hit
        #: blocks to copy back from the CPU tier
        self.reload = exp_cpu * r + seg_reload
        #: evictable blocks the hit takes out of the LRU (no longer available to allocate)
        self.taken = exp_take * r + seg_take


class BlockPool(RetentionTier):
    """GPU KV blocks, the prefix cache over them and the CPU offload tier of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        c = config
        self.num_gpu_blocks = c.num_gpu_blocks
        self.bs = c.block_size
        #: KV blocks per hash block
        self.r = (c.hash_block_tokens or c.block_size) // c.block_size
        self.caching = c.enable_prefix_cache
        self.cpu_cap = c.num_cpu_blocks if c.enable_prefix_cache else 0
        self.free = c.num_gpu_blocks
        self.private = 0  # blocks of running requests not (yet) in the prefix cache
        self.gpu: dict[Hashable, int] = {}  # cached hash block -> refcount
        self.pin: dict[Hashable, float] = {}  # pinned hash block -> pinned until
        self.segs: dict[tuple[str, int], Seg] = {}
        #: evictable units, oldest first: hash blocks (rc 0, unpinned) and segments (ev > 0)
        self.lru: OrderedDict[Any, None] = OrderedDict()
        self.n_evict = 0  # blocks they hold
        self.cpu: OrderedDict[Any, None] = OrderedDict()  # offload tier, oldest first
        self.cpu_used = 0
        self.pin_heap: list[tuple[float, int, list[Hashable], Seg | None]] = []
        self._pin_seq = 0
        #: session -> (full blocks, block_hashes, named blocks) of its last finished request
        self.sessions: dict[str, tuple[int, tuple[int, ...] | None, int]] = {}
        #: bumped whenever cached memory may have become reusable (admission memo key)
        self.ver = 0
        self.evicted_blocks = 0
        self.offloaded_blocks = 0
        self.reloaded_blocks = 0

    @property
    def available(self) -> int:
        """Blocks an allocation can get now: free plus evictable."""
        return self.free + self.n_evict

    # -- allocation ------------------------------------------------------------------------------

    def take(self, n: int) -> None:
        """Allocate ``n`` blocks (the caller checked they are available), evicting as needed."""
        free = self.free
        if n <= free:
            self.free = free - n
            return
        self.evict(n - free)
        self.free -= n

    def evict(self, n: int) -> None:
        """Evict at least ``n`` blocks, oldest unit first (a segment from its tail); they go to
        the CPU tier when there is one. Only whole hash blocks are evicted, so a few more than
        ``n`` may become free."""
        lru = self.lru
        cap = self.cpu_cap
        r = self.r
        evicted = 0
        while evicted < n:
            k = next(iter(lru))
            if type(k) is Seg:
                t = n - evicted
                if t >= k.ev:
                    t = k.ev
                    del lru[k]
                k.ev -= t
                k.g -= t  # the CPU range [g, c) grows down with it when there is a tier
                if cap:
                    self.cpu_used += t
                    self.cpu[k] = None
                    self.cpu.move_to_end(k)
                    self.offloaded_blocks += t
                else:
                    k.c = k.g
                    if k.g == k.lo and not k.users and not k.pin_until:
                        del self.segs[k.key]
                self.n_evict -= t
                evicted += t
            else:
                del lru[k]
                del self.gpu[k]
                self.n_evict -= r
                evicted += r
                if cap:
                    self.cpu[k] = None
                    self.cpu_used += r
                    self.offloaded_blocks += r
        self.evicted_blocks += evicted
        self.free += evicted
        if cap and self.cpu_used > cap:
            self.cpu_room()

    def cpu_room(self) -> None:
        """Drop the oldest CPU-tier blocks (segment tails first) until the tier fits."""
        cpu = self.cpu
        cap = self.cpu_cap
        while self.cpu_used > cap:
            k = next(iter(cpu))
            if type(k) is Seg:
                t = min(k.c - k.g, self.cpu_used - cap)
                k.c -= t
                self.cpu_used -= t
                if k.c == k.g:
                    del cpu[k]
                    if k.g == k.lo and not k.users and not k.pin_until:
                        del self.segs[k.key]
            else:
                del cpu[k]
                self.cpu_used -= self.r

    def sync(self, seg: Seg, where: int) -> None:
        """Recount a segment's evictable blocks after a change; place it in the LRU."""
        ev = 0 if seg.pin_until else seg.g - seg.floor()
        self.n_evict += ev - seg.ev
        seg.ev = ev
        lru = self.lru
        if ev > 0:
            if where == MRU:
                lru[seg] = None
                lru.move_to_end(seg)
            elif where == FIRST:
                lru[seg] = None
                lru.move_to_end(seg, last=False)
            elif seg not in lru:
                lru[seg] = None
        else:
            lru.pop(seg, None)
            if seg.c == seg.lo and not seg.users and not seg.pin_until:
                self.segs.pop(seg.key, None)

    # -- prefix cache: match, check, commit ------------------------------------------------------

    def named_blocks(self, req: SimRequest) -> int:
        """Leading blocks named by ``req.block_hashes``: whole hash blocks inside the prompt."""
        bh = req.block_hashes
        if not bh:
            return 0
        n = req.prompt_tokens // (self.r * self.bs)
        return (n if n < len(bh) else len(bh)) * self.r

    def match_prefix(self, req: SimRequest, target: int) -> PrefixMatch:
        """The longest cached run of ``req``'s leading blocks, leaving at least one of its
        ``target`` tokens to compute. Changes nothing."""
        r = self.r
        maxk = (target - 1) // self.bs  # at least one token is always computed
        bh = req.block_hashes
        m = self.named_blocks(req)
        n_exp = exp_cpu = exp_take = 0
        seg: Seg | None = None
        seg_hit = seg_reload = seg_take = 0
        if self.caching and maxk:
            gpu, cpu, lru = self.gpu, self.cpu, self.lru
            if m:
                jmax = (m if m < maxk else maxk) // r
                while n_exp < jmax:
                    h = bh[n_exp]  # type: ignore[index]
                    rc = gpu.get(h)
                    if rc is None:
                        if h not in cpu:
                            break
                        exp_cpu += 1
                    elif rc == 0 and h in lru:
                        exp_take += 1
                    n_exp += 1
                if n_exp < jmax and (req.session, n_exp * r) in self.segs:
                    # the hash run stops where an earlier turn of this session stored its own
                    # blocks under the session's name (its prompt ended there): they are the
                    # same content, so this turn names its blocks from there on by the session
                    m = n_exp * r
            if n_exp * r == m < maxk:
                seg = self.segs.get((req.session, m))
                if seg is not None and seg.c > m:
                    end = seg.c if seg.c < maxk else maxk
                    seg_hit = end - m
                    if end > seg.g:
                        seg_reload = end - seg.g
                    elif not seg.pin_until:
                        floor = seg.floor()
                        if end > floor:
                            seg_take = end - floor
                    if seg_reload and not seg.pin_until:
                        seg_take = seg.ev  # all of [floor, g) becomes held
        return PrefixMatch(m, n_exp, exp_cpu, exp_take, seg, seg_hit, seg_reload, seg_take, r)

    def can_allocate(self, match: PrefixMatch, new: int) -> bool:
        """Whether ``new`` fresh blocks fit next to ``match`` (its reloads included)."""
        return new + match.reload <= self.free + self.n_evict - match.taken

    def allocate(self, req: SimRequest, match: PrefixMatch, new: int) -> None:
        """Commit: ``req`` holds the matched blocks (reloaded from the CPU tier where needed)
        and ``new`` fresh private blocks. Call only after :meth:`can_allocate`."""
        r = self.r
        n_exp = match.n_exp
        if n_exp:
            bh = req.block_hashes
            gpu, cpu, lru = self.gpu, self.cpu, self.lru
            for j in range(n_exp):
                h = bh[j]  # type: ignore[index]
                rc = gpu.get(h)
                if rc is None:  # reloaded from the CPU tier
                    del cpu[h]
                    self.cpu_used -= r
                    gpu[h] = 1
                else:
                    if rc == 0 and h in lru:
                        del lru[h]
                        self.n_evict -= r
                    gpu[h] = rc + 1
        seg_hit = match.seg_hit
        if seg_hit:
            seg = match.seg
            assert seg is not None
            end = match.m + seg_hit
            seg_reload = match.seg_reload
            if seg_reload:
                self.cpu_used -= seg_reload
                seg.g = end
                if seg.c == end:
                    del self.cpu[seg]
            seg.users[req] = end
            self.sync(seg, KEEP)
            req._seg = seg
        reload = match.reload
        self.take(new + reload)  # ``reload`` of them now hold the reloaded blocks
        self.private += new
        self.reloaded_blocks += reload
        req._n_hit = match.n_hit
        req._n_exp = n_exp
        req._m = match.m

    def release(self, req: SimRequest, kv_len: int) -> None:
        """Give back ``req``'s blocks (``kv_len`` tokens): full ones are inserted into the
        prefix cache (its session segment becomes the most recent, ahead of its hash blocks,
        tail first), the rest are freed."""
        bs, r = self.bs, self.r
        n_hit = req._n_hit
        private = -(-kv_len // bs) - n_hit
        freed = private
        seg = req._seg
        if seg is not None:
            del seg.users[req]
            req._seg = None
        if self.caching:
            self.ver += 1
            full = kv_len // bs
            m = req._m
            n_exp = req._n_exp
            if full > m:  # session-named blocks [m, full)
                if seg is None:
                    key = (req.session, m)
                    seg = self.segs.get(key)
                    if seg is None:
                        seg = self.segs[key] = Seg(key, m)
                if full > seg.g:
                    start = m + n_hit - n_exp * r  # where our private session blocks begin
                    if start < seg.g:
                        start = seg.g  # [start, g) duplicates cached content: freed
                    if seg.c > seg.g:  # CPU copies of [g, full) are superseded
                        self.cpu_used -= (seg.c if seg.c < full else full) - seg.g
                    freed -= full - start
                    seg.g = full
                    if seg.c <= full:
                        seg.c = full
                        self.cpu.pop(seg, None)
            if seg is not None:
                self.sync(seg, MRU)
            bh = req.block_hashes
            if bh:
                gpu, cpu, lru, pin = self.gpu, self.cpu, self.lru, self.pin
                order: list[Hashable] = []  # becoming evictable, tail first
                for j in range((m if m < full else full) // r - 1, n_exp - 1, -1):
                    h = bh[j]
                    if h in gpu:
                        continue  # the same content was cached meanwhile: ours is freed
                    if h in cpu:
                        del cpu[h]
                        self.cpu_used -= r
                    gpu[h] = 0
                    freed -= r
                    order.append(h)
                for j in range(n_exp - 1, -1, -1):
                    h = bh[j]
                    rc = gpu[h] - 1
                    gpu[h] = rc
                    if rc == 0 and h not in pin:
                        order.append(h)
                if order:
                    lru.update(dict.fromkeys(order))
                    self.n_evict += r * len(order)
        elif seg is not None:
            self.sync(seg, KEEP)
        self.private -= private
        self.free += freed

    def slot_of(self, req: SimRequest) -> int:
        """Paged KV has no slots: -1 (the engine's lanes then take the server's choice)."""
        return -1

    def remember_session(self, req: SimRequest, kv_len: int) -> None:
        """``req`` finished: its blocks are what retention decisions on its session act on."""
        if self.caching:
            self.sessions[req.session] = (kv_len // self.bs, req.block_hashes, req._m)

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self, held: Iterable[tuple[SimRequest, int]]) -> None:
        """Recount everything from scratch (tests). ``held``: each running request with the KV
        tokens it holds."""
        r = self.r
        gpu, lru, cpu, pin = self.gpu, self.lru, self.cpu, self.pin
        assert self.free >= 0, self.free
        cached = len(gpu) * r + sum(s.g - s.lo for s in self.segs.values())
        assert self.free + self.private + cached == self.num_gpu_blocks, (
            self.free, self.private, cached)
        segs = set(map(id, self.segs.values()))
        n_evict = 0
        for k in lru:
            if type(k) is Seg:
                assert id(k) in segs and k.ev > 0, k
            else:
                assert gpu[k] == 0 and k not in pin
                n_evict += r
        for h, rc in gpu.items():
            assert rc >= 0 and h not in cpu
            if rc == 0 and h not in pin:
                assert h in lru
        assert pin.keys() <= gpu.keys()
        cpu_used = 0
        for k in cpu:
            if type(k) is Seg:
                assert id(k) in segs and k.c > k.g, k
                cpu_used += k.c - k.g
            else:
                cpu_used += r
        assert cpu_used == self.cpu_used <= self.cpu_cap, (cpu_used, self.cpu_used)
        running = {req for req, _ in held}
        for key, s in self.segs.items():
            assert s.key == key and key[1] == s.lo <= s.g <= s.c, s
            assert (s.c > s.g) == (s in cpu), s
            floor = s.floor()
            assert s.lo <= floor <= s.g, s
            ev = 0 if s.pin_until else s.g - floor
            assert s.ev == ev and (ev > 0) == (s in lru), (s, s.ev, ev)
            n_evict += ev
            for u, end in s.users.items():
                assert u in running and u._seg is s and end > s.lo
        assert n_evict == self.n_evict, (n_evict, self.n_evict)
        refs: dict[Hashable, int] = {}
        private = 0
        for req, kv_len in held:
            private += -(-kv_len // self.bs) - req._n_hit
            for j in range(req._n_exp):
                h = req.block_hashes[j]  # type: ignore[index]
                refs[h] = refs.get(h, 0) + 1
            if req._seg is not None:
                assert req._seg.users[req] == req._n_hit - req._n_exp * r + req._m
        assert private == self.private, (private, self.private)
        for h, rc in gpu.items():
            assert rc == refs.get(h, 0), (h, rc, refs.get(h, 0))
