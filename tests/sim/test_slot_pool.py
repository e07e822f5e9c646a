"""Slot-limited KV (llama.cpp ``-np``): one sequence per slot, slot choice as the gateway's
llama.cpp adapter makes it, pins that only steer, the per-slot cap, and the same workload
through the paged and the slot model."""

from __future__ import annotations

import pytest

from turnstile.core.actions import RetentionDecision
from turnstile.sim.cluster import EngineGroup
from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.slot_pool import SlotPool


def flat_perf() -> FittedPerf:
    return FittedPerf(0.001, 1e-6, kv_bytes_per_token=1024, engine="test")


def slot_engine(slots: int = 4, slot_tokens: int = 1000) -> EngineModel:
    cfg = EngineConfig(num_gpu_blocks=slots * slot_tokens, block_size=1, kv_slots=slots,
                       max_num_seqs=slots)
    return EngineModel("e0", cfg, flat_perf())


def run(eng: EngineModel, now: float) -> float:
    for _ in range(100_000):
        out = eng.step(now)
        eng.check_integrity()
        if out is None:
            return now
        now += out.duration_s
    raise AssertionError("engine did not drain")


def turn(eng: EngineModel, session: str, prompt: int, now: float, out: int = 4):
    req = SimRequest(f"{session}-{prompt}", session, prompt, out)
    eng.submit(req, now)
    t = run(eng, now)
    assert req.done
    return req, t


def slot_of(eng: EngineModel, session: str) -> int | None:
    pool = eng.pool
    assert isinstance(pool, SlotPool)
    for s in pool.slots:
        if s.session == session:
            return s.id
    return None


def test_a_session_returning_to_its_slot_hits_its_whole_last_context() -> None:
    eng = slot_engine()
    a1, t = turn(eng, "a", 300, 0.0)
    a2, t = turn(eng, "a", 300 + 4 + 20, t)
    # the slot holds prompt + outputs but the last output token (never stored): 303 tokens
    assert a1.cached_tokens == 0 and a2.cached_tokens == 303
    assert eng.session_blocks("a") == (324 + 3, 0)


def test_the_fifth_session_evicts_the_least_recently_used_slot() -> None:
    eng = slot_engine()
    t = 0.0
    for s in "abcd":
        _, t = turn(eng, s, 200, t)
    _, t = turn(eng, "a", 224, t)  # a is used again: b is now the least recently used
    assert [slot_of(eng, s) for s in "abcd"] == [0, 1, 2, 3]
    e1, t = turn(eng, "e", 200, t)
    assert slot_of(eng, "b") is None and slot_of(eng, "e") == 1
    assert e1.cached_tokens == 0 and eng.stats()["evicted_blocks"] == 203
    b2, t = turn(eng, "b", 224, t)
    assert b2.cached_tokens == 0  # b's slot was taken: its context is re-prefilled
    a3, _ = turn(eng, "a", 250, t)
    assert a3.cached_tokens == 227


def test_only_n_sessions_stay_resident_however_short_they_are() -> None:
    """Paged KV keeps every short session; four slots keep four, whatever their length."""
    paged = EngineModel("p", EngineConfig(num_gpu_blocks=4000, block_size=1), flat_perf())
    slots = slot_engine()
    for eng in (paged, slots):
        t = 0.0
        for i in range(8):
            _, t = turn(eng, f"s{i}", 50, t)
        hits = [turn(eng, f"s{i}", 80, t + i)[0].cached_tokens for i in range(8)]
        if eng is paged:
            assert hits == [53] * 8
        else:
            # s0..s3 lost their slots to s4..s7, whose next turns then evict each other
            assert hits == [0, 0, 0, 0, 0, 0, 0, 0]


def test_requests_beyond_the_slots_wait_for_one() -> None:
    eng = slot_engine(slots=2)
    reqs = [SimRequest(f"r{i}", f"s{i}", 100, 50) for i in range(3)]
    for r in reqs:
        eng.submit(r, 0.0)
    run(eng, 0.0)
    assert reqs[0].started_s == reqs[1].started_s == 0.0
    assert reqs[2].started_s == pytest.approx(min(reqs[0].finished_s, reqs[1].finished_s))


def test_a_turn_longer_than_a_slot_is_refused() -> None:
    eng = slot_engine(slots=4, slot_tokens=500)
    eng.submit(SimRequest("ok", "a", 490, 11), 0.0)  # 500 tokens in the slot: fits
    with pytest.raises(ValueError, match="a slot"):
        eng.submit(SimRequest("big", "b", 490, 12), 0.0)


def test_a_pin_steers_others_to_another_idle_slot() -> None:
    eng = slot_engine(slots=2)
    _, t = turn(eng, "a", 200, 0.0)
    _, t = turn(eng, "b", 200, t)  # a is the least recently used
    eng.retain("a", RetentionDecision("pin", ttl_s=100.0), t)
    _, t = turn(eng, "c", 200, t)
    assert slot_of(eng, "a") == 0 and slot_of(eng, "b") is None
    a2, _ = turn(eng, "a", 230, t)
    assert a2.cached_tokens == 203


def test_a_pin_never_makes_a_request_wait_nor_reserves_a_slot() -> None:
    eng = slot_engine(slots=2)
    _, t = turn(eng, "a", 200, 0.0)
    _, t = turn(eng, "b", 200, t)
    eng.retain("a", RetentionDecision("pin", ttl_s=100.0), t)
    eng.retain("b", RetentionDecision("pin", ttl_s=100.0), t)
    c, t2 = turn(eng, "c", 200, t)
    # every idle slot pinned: the server takes the least recently used one at once
    assert c.started_s == t and slot_of(eng, "a") is None and slot_of(eng, "b") == 1
    assert t2 - t < 1.0


def test_a_pin_expires() -> None:
    eng = slot_engine(slots=2)
    _, t = turn(eng, "a", 200, 0.0)
    _, t = turn(eng, "b", 200, t)
    eng.retain("a", RetentionDecision("pin", ttl_s=1.0), t)
    _, t = turn(eng, "c", 200, t + 0.5)  # pinned: c takes b's slot
    assert slot_of(eng, "a") == 0 and slot_of(eng, "b") is None
    _, t = turn(eng, "d", 200, t + 1.0)  # expired: a's is the least recently used
    assert slot_of(eng, "a") is None and eng.next_pin_expiry is None


def test_a_turn_forwarded_when_every_slot_is_taken_goes_to_the_server_and_the_gateway_loses_track(
) -> None:
    """Every slot bound: the turn goes unbound, the server puts it in the first slot to free
    up, and the gateway, which still believes that slot holds b, sends b's next turn there."""
    eng = slot_engine(slots=2)
    _, t = turn(eng, "a", 200, 0.0)
    _, t = turn(eng, "b", 200, t)
    b2 = SimRequest("b2", "b", 230, 4)  # own slot: 27 tokens to compute, finishes first
    c = SimRequest("c", "c", 200, 4)  # a's slot
    e = SimRequest("e", "e", 200, 4)  # no slot left in the gateway's view
    for r in (b2, c, e):
        eng.submit(r, t)
    pool = eng.pool
    assert isinstance(pool, SlotPool)
    assert pool.unbound == 1 and e not in pool.bound
    t = run(eng, t)
    assert b2.cached_tokens == 203 and e.started_s == pytest.approx(b2.finished_s)
    assert slot_of(eng, "e") == 1 and pool.slots[1].owner == "b"  # stale
    b3, _ = turn(eng, "b", 260, t)
    assert b3.cached_tokens == 0 and slot_of(eng, "e") is None


def test_discard_erases_the_slot() -> None:
    eng = slot_engine(slots=2)
    _, t = turn(eng, "a", 200, 0.0)
    eng.retain("a", RetentionDecision("discard"), t)
    assert eng.session_blocks("a") == (0, 0)
    a2, _ = turn(eng, "a", 230, t)
    assert a2.cached_tokens == 0


def test_shared_hash_blocks_are_reused_from_another_sessions_slot() -> None:
    cfg = EngineConfig(num_gpu_blocks=2000, block_size=1, kv_slots=2, max_num_seqs=2,
                       hash_block_tokens=64)
    eng = EngineModel("e0", cfg, flat_perf())
    eng.submit(SimRequest("x", "x", 300, 2, block_hashes=(1, 2, 3, 4)), 0.0)
    t = run(eng, 0.0)
    eng.submit(SimRequest("y", "y", 300, 2, block_hashes=(1, 2, 9)), t)
    t = run(eng, t)
    eng.submit(y := SimRequest("z", "z", 300, 2, block_hashes=(1, 2, 3, 5)), t)
    run(eng, t)
    # z gets the least recently used slot, x's: they share three hash blocks
    assert y.cached_tokens == 192


def test_a_group_with_slots_builds_a_token_granular_slot_engine() -> None:
    g = EngineGroup(kv_tokens=2072, kv_slots=4, slot_tokens=796, max_num_seqs=4,
                    max_batched_tokens=2048)
    cfg = g.build_config(16)
    assert (cfg.block_size, cfg.kv_slots, cfg.slot_tokens, cfg.capacity_tokens) == (
        1, 4, 796, 3184)
    # the scheduler's KV gate is told the sessions' KV, as the gateway is
    assert g.scheduler_kv_tokens(cfg) == 2072
    paged = EngineGroup(kv_tokens=2072)
    assert paged.scheduler_kv_tokens(paged.build_config(16)) == 2064
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(num_gpu_blocks=100, block_size=1, kv_slots=2, max_num_seqs=4)


def test_the_cores_engine_record_knows_the_slots() -> None:
    """The simulated cluster tells the core how many sessions a slot engine keeps, as the
    gateway does for a llama.cpp server; a paged engine says none."""
    from turnstile.policies import PolicySet
    from turnstile.sim.cluster import ClusterSim

    slots = EngineGroup(kv_tokens=2072, kv_slots=4, slot_tokens=796, max_num_seqs=4,
                        max_batched_tokens=2048, perf=flat_perf())
    paged = EngineGroup(kv_tokens=2072, perf=flat_perf())
    sim = ClusterSim([], PolicySet.from_spec("cvar"), [slots, paged])
    assert [e.kv_slots for e in sim.scheduler.view.values()] == [4, 0]


@pytest.mark.parametrize("seed", range(5))
def test_random_sessions_keep_the_slots_consistent(seed: int) -> None:
    """Random multi-turn sessions, concurrent arrivals and retention: the pool's accounting
    holds at every step (check_integrity), every request finishes, and a hit is never more
    than the session's previous context."""
    import random

    rng = random.Random(seed)
    eng = slot_engine(slots=3, slot_tokens=400)
    ctx: dict[str, int] = {}
    now = 0.0
    reqs = []
    for _ in range(60):
        s = f"s{rng.randrange(6)}"
        prompt = min(ctx.get(s, 0) + rng.randrange(1, 60), 380)
        req = SimRequest(len(reqs), s, prompt, rng.randrange(1, 12))
        eng.submit(req, now)
        reqs.append((req, ctx.get(s, 0)))
        ctx[s] = prompt + req.output_tokens
        for _ in range(rng.randrange(0, 6)):
            out = eng.step(now)
            eng.check_integrity()
            if out is None:
                break
            now += out.duration_s
        if rng.random() < 0.3:
            action = rng.choice(["pin", "discard", "lru", "offload"])
            eng.retain(f"s{rng.randrange(6)}", RetentionDecision(action, ttl_s=0.05), now)
    run(eng, now)
    assert all(r.done for r, _ in reqs)
    assert all(r.cached_tokens <= max(prev, 0) for r, prev in reqs)
    assert eng.stats()["hit_tokens"] > 0
