"""The block pool on its own: check-then-commit admission, prefix insert/match, eviction order,
the offload tier, and the next-finish heap of the batch scheduler."""

from __future__ import annotations

from turnstile.sim.batch_scheduler import BatchScheduler
from turnstile.sim.block_pool import BlockPool
from turnstile.sim.engine_config import EngineConfig
from turnstile.sim.request import Seg, SimRequest


def pool_state(pool: BlockPool) -> tuple:
    segs = tuple((k, s.lo, s.g, s.c, s.ev, dict(s.users)) for k, s in pool.segs.items())

    def keys(units):  # segments by their key (two pools' segments are distinct objects)
        return [u.key if isinstance(u, Seg) else u for u in units]

    return (pool.free, pool.private, pool.n_evict, pool.cpu_used, dict(pool.gpu),
            keys(pool.lru), keys(pool.cpu), segs)


def finished_session(pool: BlockPool, session: str, tokens: int) -> SimRequest:
    """A request of ``tokens`` that ran and finished: its full blocks are now cached."""
    req = SimRequest(session, session, tokens, 1)
    match = pool.match_prefix(req, tokens)
    new = -(-tokens // pool.bs) - match.n_hit
    assert pool.can_allocate(match, new)
    pool.allocate(req, match, new)
    pool.release(req, tokens)
    pool.remember_session(req, tokens)
    return req


def test_match_prefix_changes_nothing_and_allocate_commits_the_hit():
    pool = BlockPool(EngineConfig(num_gpu_blocks=100))
    finished_session(pool, "s", 320)  # 20 full blocks cached, evictable
    assert (pool.free, pool.n_evict) == (80, 20)
    nxt = SimRequest("s2", "s", 400, 10)
    before = pool_state(pool)
    match = pool.match_prefix(nxt, 400)
    assert pool_state(pool) == before
    assert match.n_hit == 20 and match.taken == 20 and match.reload == 0
    assert pool.can_allocate(match, 5)
    pool.allocate(nxt, match, 5)
    # the hit blocks are held now (not evictable), 5 fresh private blocks were taken
    assert (pool.free, pool.n_evict, pool.private) == (75, 0, 5)
    pool.check_integrity([(nxt, 400)])


def test_can_allocate_counts_the_hit_blocks_it_would_hold_as_unavailable():
    pool = BlockPool(EngineConfig(num_gpu_blocks=30))
    finished_session(pool, "s", 320)  # 20 cached, 10 free
    match = pool.match_prefix(SimRequest("x", "s", 800, 1), 800)
    # 30 available blocks, but holding the 20-block hit leaves 10 for fresh ones
    assert pool.available == 30
    assert pool.can_allocate(match, 10) and not pool.can_allocate(match, 11)


def test_eviction_takes_the_oldest_segment_tail_first_into_the_tier():
    pool = BlockPool(EngineConfig(num_gpu_blocks=40, num_cpu_blocks=8))
    finished_session(pool, "old", 320)
    finished_session(pool, "new", 320)
    pool.take(5)  # 0 free: 5 blocks come from the oldest segment's tail
    old = pool.segs[("old", 0)]
    assert isinstance(old, Seg) and (old.lo, old.g, old.c) == (0, 15, 20)
    assert pool.cpu_used == 5 and pool.evicted_blocks == 5 == pool.offloaded_blocks
    pool.take(10)  # the tier (8 blocks) drops its oldest: the tail of what "old" offloaded
    assert pool.cpu_used == 8
    assert (old.g, old.c) == (5, 13)
    assert pool.session_blocks("old") == (5, 8) and pool.session_blocks("new") == (20, 0)


def test_one_eviction_of_a_sum_equals_one_per_block_without_a_tier():
    """What the leap relies on: evicting n then m is evicting n + m (no offload tier)."""
    def pool_after(takes: list[int]) -> tuple:
        pool = BlockPool(EngineConfig(num_gpu_blocks=64, hash_block_tokens=64))
        for i, t in enumerate((100, 300, 200)):
            req = SimRequest(i, f"s{i}", t, 1, block_hashes=tuple(range(i * 10, i * 10 + 4)))
            match = pool.match_prefix(req, t)
            new = -(-t // 16) - match.n_hit
            pool.allocate(req, match, new)
            pool.release(req, t)
        for t in takes:
            pool.take(t)
        assert pool.evicted_blocks >= 20  # most takes evicted, hash blocks and segments
        return pool_state(pool)

    assert pool_after([3, 5, 7, 1, 9, 15, 2, 6]) == pool_after([48])


def test_next_finish_skips_buckets_that_are_gone():
    cfg = EngineConfig(num_gpu_blocks=100)
    s = BatchScheduler(cfg, BlockPool(cfg))
    s.fin = {7: [], 3: []}
    s.fin_heap = [3, 5, 7]
    assert s.next_finish() == 3
    del s.fin[3]
    assert s.next_finish() == 7 and s.fin_heap == [7]
