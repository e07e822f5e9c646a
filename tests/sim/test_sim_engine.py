"""The engine model: hand-computed timings, prefix cache, preemption, offload, retention,
priorities, and conservation over random request mixes."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from turnstile.core.actions import RetentionDecision
from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest, StepOutcome
from turnstile.sim.engine_profile import WarmRule
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.roofline_perf import RooflinePerf

KV_8B = 2 * 32 * 8 * 128 * 2  # llama-3.1-8b KV bytes per token


def flat_perf(kv_bytes_per_token: float = KV_8B) -> FittedPerf:
    """1 ms per step + 1 µs per prefill token: easy durations to reason about."""
    return FittedPerf(0.001, 1e-6, kv_bytes_per_token=kv_bytes_per_token, engine="test")


def run(eng: EngineModel, now: float = 0.0, limit: int = 1_000_000) -> tuple[float, list]:
    """Step until idle, checking integrity; returns (time, outcomes)."""
    outs: list[StepOutcome] = []
    for _ in range(limit):
        out = eng.step(now)
        eng.check_integrity()
        if out is None:
            return now, outs
        outs.append(out)
        now += out.duration_s
    raise AssertionError("engine did not drain")


def one(eng: EngineModel, rid: str, session: str, prompt: int, out: int, now: float, **kw):
    req = SimRequest(rid, session, prompt, out, **kw)
    eng.submit(req, now)
    t, _ = run(eng, now)
    assert req.done
    return req, t


# --- timing by hand ---------------------------------------------------------------------------


def test_single_request_ttft_and_decode_match_the_roofline_by_hand() -> None:
    perf = RooflinePerf("H100-SXM", "llama-3.1-8b")
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=1000), perf)
    req = SimRequest("r", "s", 1000, 4, arrival_s=0.0)
    eng.submit(req, 0.0)
    t, outs = run(eng)
    # step 1: prefill all 1000 prompt tokens (compute-bound) and sample the first token
    pairs = 1000 * 1001 / 2
    prefill = (2 * 8.03e9 * 1000 + 4 * 32 * 4096 * pairs) / (989e12 * 0.65) + 0.002
    # steps 2-4: one decode each, reading the weights and 1000+k context tokens (memory-bound)
    decode = [(8.03e9 * 2 + (1000 + k) * KV_8B) / (3.35e12 * 0.85) + 0.002 for k in (1, 2, 3)]
    assert [o.duration_s for o in outs] == pytest.approx([prefill, *decode], rel=1e-12)
    assert req.started_s == 0.0
    assert req.first_token_s == pytest.approx(prefill, rel=1e-12)
    assert req.finished_s == pytest.approx(prefill + sum(decode), rel=1e-12) == t
    assert outs[0].started == [req] and outs[0].first_token == [req]
    assert outs[-1].finished == [req] and req.num_output == 4
    s = eng.stats()
    assert (s["prefilled_tokens"], s["decode_tokens"], s["iterations"]) == (1000, 3, 4)
    assert s["running"] == 0 and s["kv_used_frac"] == 0.0


def test_chunked_prefill_splits_a_long_prompt_over_the_token_budget() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=2000, max_batched_tokens=4096), flat_perf())
    req = SimRequest("r", "s", 10_000, 2)
    eng.submit(req, 0.0)
    _, outs = run(eng)
    durs = [o.duration_s for o in outs]
    assert durs == pytest.approx([0.001 + 4096e-6, 0.001 + 4096e-6, 0.001 + 1808e-6, 0.001])
    assert [bool(o.first_token) for o in outs] == [False, False, True, False]
    assert req.first_token_s == pytest.approx(sum(durs[:3]))


def test_a_decode_batch_shares_each_iteration() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=100), flat_perf())
    reqs = [SimRequest(i, f"s{i}", 16, 5) for i in range(3)]
    for r in reqs:
        eng.submit(r, 0.0)
    _, outs = run(eng)
    # one step prefills all three (48 tokens), then 4 decode steps carry all three at once
    assert len(outs) == 5
    assert outs[0].duration_s == pytest.approx(0.001 + 48e-6)
    assert outs[-1].finished == reqs


# --- prefix cache -----------------------------------------------------------------------------


def test_next_turn_of_a_session_hits_its_prompt_and_output() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=100), flat_perf())
    r1, t = one(eng, "t1", "s", 100, 10, 0.0)
    assert r1.cached_tokens == 0
    # turn 2 = turn 1's prompt + output + 30 new tokens; KV holds 109 tokens = 6 full blocks
    r2, _ = one(eng, "t2", "s", 140, 5, t)
    assert r2.cached_tokens == 96
    s = eng.stats()
    assert s["hit_tokens"] == 96 and s["prompt_tokens"] == 240
    assert s["prefilled_tokens"] == 100 + 44
    # positions 96..108 were computed by turn 1 (its partial block is not cached)
    assert s["recomputed_tokens"] == 13


def test_a_repeated_prompt_hits_all_but_its_last_token() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=100), flat_perf())
    hashes = tuple(range(1000, 1010))
    one(eng, "a", "user-a", 160, 1, 0.0, block_hashes=hashes)
    b, _ = one(eng, "b", "user-b", 160, 1, 1.0, block_hashes=hashes)
    # 10 full blocks cached; at least one token is recomputed to produce logits
    assert b.cached_tokens == 144
    c, _ = one(eng, "c", "user-c", 160, 1, 2.0, block_hashes=(*hashes[:3], 7, 8, 9))
    assert c.cached_tokens == 48  # the prefix diverges at block 3
    d, _ = one(eng, "d", "user-d", 160, 1, 3.0)  # no hashes, another session: nothing shared
    assert d.cached_tokens == 0


def test_coarse_hash_blocks_name_several_kv_blocks() -> None:
    cfg = EngineConfig(num_gpu_blocks=200, hash_block_tokens=64)  # 4 KV blocks per hash
    eng = EngineModel("e0", cfg, flat_perf())
    one(eng, "a", "u1", 300, 1, 0.0, block_hashes=(1, 2, 3, 4, 5))
    # a shares hash blocks 1, 2, 3 (192 tokens); its 5th hash block is partial: never used
    b, _ = one(eng, "b", "u2", 250, 1, 1.0, block_hashes=(1, 2, 3, 9))
    assert b.cached_tokens == 192
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig(num_gpu_blocks=10, hash_block_tokens=40)


def test_prefix_cache_can_be_disabled() -> None:
    eng = EngineModel(
        "e0", EngineConfig(num_gpu_blocks=100, enable_prefix_cache=False), flat_perf()
    )
    one(eng, "t1", "s", 100, 10, 0.0)
    r2, _ = one(eng, "t2", "s", 140, 5, 1.0)
    assert r2.cached_tokens == 0 and eng.stats()["kv_free_blocks"] == 100


def test_lru_evicts_the_oldest_session_first() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=30), flat_perf())
    one(eng, "a1", "a", 160, 1, 0.0)  # 10 cached blocks each
    one(eng, "b1", "b", 160, 1, 1.0)
    one(eng, "c1", "c", 160, 1, 2.0)
    one(eng, "d1", "d", 160, 1, 3.0)  # evicts a (the oldest)
    assert eng.session_blocks("a") == (0, 0) and eng.session_blocks("b") == (10, 0)
    b2, _ = one(eng, "b2", "b", 176, 1, 4.0)
    assert b2.cached_tokens == 160


def test_eviction_takes_a_sessions_tail_first() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=20), flat_perf())
    one(eng, "a1", "a", 160, 1, 0.0)  # 10 blocks cached
    one(eng, "b1", "b", 240, 1, 1.0)  # needs 15: evicts 5 of a's, from the tail
    assert eng.session_blocks("a") == (5, 0)
    a2, _ = one(eng, "a2", "a", 200, 1, 2.0)
    assert a2.cached_tokens == 80  # the surviving prefix still hits


# --- preemption -------------------------------------------------------------------------------


def test_preemption_by_recompute_when_kv_runs_out() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=20), flat_perf())
    reqs = [SimRequest(i, f"s{i}", 64, 150, priority=0.0) for i in range(3)]
    for r in reqs:
        eng.submit(r, 0.0)
    run(eng)
    s = eng.stats()
    assert all(r.done and r.num_output == 150 for r in reqs)
    assert s["preemptions"] > 0 and s["recomputed_tokens"] > 0
    assert sum(r.preempted for r in reqs) == s["preemptions"]
    # the latest arrival is the victim: the first request is never preempted
    assert reqs[0].preempted == 0 and reqs[2].preempted > 0
    assert s["prompt_tokens"] == s["hit_tokens"] + s["prefilled_tokens"]
    assert s["kv_used_frac"] == 0.0


def test_preemption_victim_is_the_lowest_priority() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=20), flat_perf())
    low = SimRequest("low", "a", 64, 150, priority=9.0)
    high = SimRequest("high", "b", 64, 150, priority=1.0)
    eng.submit(low, 0.0)
    eng.step(0.0)  # low starts first
    eng.submit(high, 0.0)
    run(eng, 0.0)
    assert low.preempted > 0 and high.preempted == 0
    assert high.finished_s < low.finished_s


def test_requests_that_can_never_fit_are_refused() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=10), flat_perf())
    with pytest.raises(ValueError, match="can never run"):
        eng.submit(SimRequest("big", "s", 150, 20), 0.0)
    eng.submit(SimRequest("ok", "s", 150, 11), 0.0)  # 160 tokens, the last never stored
    with pytest.raises(ValueError, match="output_tokens"):
        eng.submit(SimRequest("empty", "s", 10, 0), 0.0)


# --- offload tier and retention ---------------------------------------------------------------


def test_offload_round_trip_charges_the_reload() -> None:
    perf = flat_perf()
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=20, num_cpu_blocks=100), perf)
    one(eng, "a1", "a", 160, 1, 0.0)  # 10 blocks cached
    one(eng, "b1", "b", 300, 1, 1.0)  # needs 19: 9 of a's go to the CPU tier (tail first)
    assert eng.session_blocks("a") == (1, 9)
    assert eng.stats()["offloaded_blocks"] == 9
    a2 = SimRequest("a2", "a", 176, 1)
    eng.submit(a2, 2.0)
    out = eng.step(2.0)
    assert out is not None
    reload_s = 9 * 16 * KV_8B / 25e9
    # prefill of the 16 new tokens after a 160-token hit, plus the reload of 9 blocks
    assert out.duration_s == pytest.approx(
        perf.step_time(16, 0, 160, 16 * 160 + 16 * 17 / 2) + reload_s
    )
    assert a2.cached_tokens == 160 and eng.stats()["reloaded_blocks"] == 9
    eng.check_integrity()


def test_without_a_tier_evicted_blocks_are_gone() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=20), flat_perf())
    one(eng, "a1", "a", 160, 1, 0.0)
    one(eng, "b1", "b", 300, 1, 1.0)
    a2, _ = one(eng, "a2", "a", 176, 1, 2.0)
    assert a2.cached_tokens == 16 and eng.stats()["reloaded_blocks"] == 0


def _pressure(eng: EngineModel, t: float) -> float:
    for i in range(3):  # 3 other sessions of 10 blocks through a 30-block engine
        _, t = one(eng, f"x{i}", f"x{i}", 160, 1, t)
    return t


def test_pin_keeps_a_session_past_lru_pressure() -> None:
    control = EngineModel("c", EngineConfig(num_gpu_blocks=30), flat_perf())
    _, t = one(control, "a1", "a", 160, 1, 0.0)
    t = _pressure(control, t)
    a2, _ = one(control, "a2", "a", 176, 1, t)
    assert a2.cached_tokens == 0  # LRU evicted it

    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=30), flat_perf())
    _, t = one(eng, "a1", "a", 160, 1, 0.0)
    eng.retain("a", RetentionDecision("pin", ttl_s=100.0), t)
    assert eng.stats()["kv_used_frac"] == pytest.approx(10 / 30)
    t = _pressure(eng, t)
    a2, _ = one(eng, "a2", "a", 176, 1, t)
    assert a2.cached_tokens == 160


def test_an_engine_that_cannot_pin_leaves_its_kv_to_the_lru() -> None:
    """vLLM's profile (``kv_pinning=False``): the retention policy's pin is a no-op, as the
    gateway's vLLM adapter makes it; the same pin on the default profile keeps the session."""
    from turnstile.sim.engine_profile import profile_for

    vllm = profile_for("vllm")
    assert not vllm.kv_pinning and profile_for("llama.cpp").kv_pinning
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=30), flat_perf(), profile=vllm)
    _, t = one(eng, "a1", "a", 160, 1, 0.0)
    eng.retain("a", RetentionDecision("pin", ttl_s=100.0), t)
    eng.retain("a", RetentionDecision("discard"), t)  # nor is a discard carried out
    assert eng.stats()["kv_free_blocks"] == 20  # the session's 10 blocks still cached
    t = _pressure(eng, t)
    a2, _ = one(eng, "a2", "a", 176, 1, t)
    assert a2.cached_tokens == 0  # LRU evicted it, pin or no pin


def test_pin_expires_and_an_idle_engine_waits_for_it() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=20), flat_perf())
    _, t = one(eng, "a1", "a", 160, 1, 0.0)
    eng.retain("a", RetentionDecision("pin", ttl_s=5.0), t)
    big = SimRequest("big", "b", 300, 1)  # needs 19 blocks; 10 are pinned
    eng.submit(big, t)
    out = eng.step(t)
    assert out is not None and not out.busy and out.duration_s == pytest.approx(5.0)
    assert eng.next_pin_expiry == pytest.approx(t + 5.0)
    run(eng, t + out.duration_s)
    assert big.done and big.started_s == pytest.approx(t + 5.0)
    assert eng.stats()["idle_wait_s"] == pytest.approx(5.0)


def test_discard_frees_a_session_now() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=30, num_cpu_blocks=30), flat_perf())
    _, t = one(eng, "a1", "a", 160, 1, 0.0)
    assert eng.stats()["kv_free_blocks"] == 20
    eng.retain("a", RetentionDecision("discard"), t)
    eng.check_integrity()
    assert eng.stats()["kv_free_blocks"] == 30 and eng.session_blocks("a") == (0, 0)
    a2, _ = one(eng, "a2", "a", 176, 1, t)
    assert a2.cached_tokens == 0


def test_retain_offload_moves_a_session_to_the_tier() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=30, num_cpu_blocks=30), flat_perf())
    _, t = one(eng, "a1", "a", 160, 1, 0.0)
    eng.retain("a", RetentionDecision("offload"), t)
    eng.check_integrity()
    assert eng.session_blocks("a") == (0, 10) and eng.stats()["kv_free_blocks"] == 30
    a2, _ = one(eng, "a2", "a", 176, 1, t)
    assert a2.cached_tokens == 160 and eng.stats()["reloaded_blocks"] == 10
    # lru is a no-op; an unknown session is ignored
    eng.retain("a", RetentionDecision("lru"), t)
    eng.retain("nobody", RetentionDecision("discard"), t)


def test_retention_applies_to_hash_named_blocks_too() -> None:
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=30, num_cpu_blocks=30), flat_perf())
    hashes = tuple(range(50, 58))
    _, t = one(eng, "a1", "a", 160, 10, 0.0, block_hashes=hashes)  # 8 hash + 2 session blocks
    assert eng.session_blocks("a") == (10, 0)
    eng.retain("a", RetentionDecision("offload"), t)
    assert eng.session_blocks("a") == (0, 10)
    eng.retain("a", RetentionDecision("discard"), t)
    assert eng.session_blocks("a") == (0, 0)
    eng.check_integrity()


# --- ordering ---------------------------------------------------------------------------------


def _start_order(priority_scheduling: bool) -> list[str]:
    cfg = EngineConfig(num_gpu_blocks=100, max_num_seqs=1, priority_scheduling=priority_scheduling)
    eng = EngineModel("e0", cfg, flat_perf())
    for rid, prio in (("p5", 5.0), ("p1", 1.0), ("p3", 3.0), ("p1b", 1.0)):
        eng.submit(SimRequest(rid, rid, 32, 2, priority=prio), 0.0)
    _, outs = run(eng)
    return [r.rid for o in outs for r in o.started]


def test_priority_ordering_lower_first_then_arrival() -> None:
    assert _start_order(True) == ["p1", "p1b", "p3", "p5"]


def test_fifo_ordering_ignores_priority() -> None:
    assert _start_order(False) == ["p5", "p1", "p3", "p1b"]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_batched_tokens"):
        EngineConfig(num_gpu_blocks=10, max_num_seqs=512, max_batched_tokens=256)
    with pytest.raises(TypeError):
        EngineConfig(16, 100)  # type: ignore[misc]  # keyword-only
    cfg = EngineConfig.sized_for("H100", "llama-3.1-8b", cpu_offload_gb=10.0, max_num_seqs=64)
    assert cfg.num_gpu_blocks * 16 <= 447_000 and cfg.num_cpu_blocks == int(10e9 // (KV_8B * 16))


# --- conservation over random mixes -----------------------------------------------------------

turns = st.lists(
    st.tuples(st.integers(1, 120), st.integers(1, 60), st.floats(0.0, 0.5)), min_size=1, max_size=4
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sessions=st.lists(turns, min_size=1, max_size=6),
    block_size=st.sampled_from([4, 16]),
    extra_blocks=st.integers(0, 24),
    cpu_blocks=st.sampled_from([0, 8, 64]),
    max_num_seqs=st.integers(1, 8),
    budget=st.sampled_from([8, 64, 512]),
    priority_scheduling=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_conservation_over_random_sessions(
    sessions: list[list[tuple[int, int, float]]],
    block_size: int,
    extra_blocks: int,
    cpu_blocks: int,
    max_num_seqs: int,
    budget: int,
    priority_scheduling: bool,
    seed: int,
) -> None:
    rng = random.Random(seed)
    # each session's turn n+1 prompt = turn n prompt + output + new input
    plans: list[list[tuple[int, int, float]]] = []
    biggest = 0
    for sess in sessions:
        ctx, plan = 0, []
        for new, out, gap in sess:
            prompt = ctx + new
            plan.append((prompt, out, gap))
            biggest = max(biggest, prompt + out - 1)
            ctx = prompt + out
        plans.append(plan)
    cfg = EngineConfig(
        num_gpu_blocks=-(-biggest // block_size) + extra_blocks,
        block_size=block_size,
        num_cpu_blocks=cpu_blocks,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max(budget, max_num_seqs),
        priority_scheduling=priority_scheduling,
    )
    eng = EngineModel("e0", cfg, RooflinePerf("H100", "llama-3.1-8b"))
    pending = [(0.0, i, 0) for i in range(len(plans))]  # (time, session, turn)
    done: list[SimRequest] = []
    now = 0.0
    while pending or eng.has_work():
        pending.sort()
        while pending and pending[0][0] <= now:
            _, i, n = pending.pop(0)
            prompt, out, _gap = plans[i][n]
            req = SimRequest((i, n), f"s{i}", prompt, out, priority=float(rng.randint(0, 3)))
            eng.submit(req, now)
        out_ = eng.step(now)
        eng.check_integrity()
        if out_ is None:
            now = pending[0][0]
            continue
        assert out_.duration_s > 0
        now += out_.duration_s
        for req in out_.finished:
            assert req.finished_s == now
            done.append(req)
            i, n = req.rid
            action = rng.choice(["lru", "pin", "offload", "discard"])
            eng.retain(req.session, RetentionDecision(action, rng.uniform(0, 0.3)), now)
            eng.check_integrity()
            if n + 1 < len(plans[i]):
                pending.append((now + plans[i][n][2], i, n + 1))
    s = eng.stats()
    for key in ("preemptions", "reloaded_blocks", "evicted_blocks", "idle_wait_s", "hit_tokens"):
        event(f"{key} > 0: {s[key] > 0}")
    assert len(done) == sum(len(p) for p in plans) == s["finished"]
    for r in done:
        assert 0 <= r.started_s < r.first_token_s <= r.finished_s
        assert r.num_output == r.output_tokens
    # every token an admission needed was either a cache hit or prefilled
    assert s["prompt_tokens"] == s["hit_tokens"] + s["prefilled_tokens"]
    # every context position of a session was computed for the first time exactly once, by a
    # prefill or by a decode; everything else prefilled was recomputation
    first_time = sum(p[-1][0] + p[-1][1] - 1 for p in plans)
    assert s["prefilled_tokens"] - s["recomputed_tokens"] + s["decode_tokens"] == first_time
    assert s["recomputed_tokens"] >= 0 and s["running"] == 0 and s["queue_len"] == 0
    assert eng.stats()["kv_used_frac"] <= 1.0


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(1, 40)), min_size=1, max_size=12
    ),
    cpu_blocks=st.sampled_from([0, 16]),
    ratio=st.sampled_from([1, 2]),
)
def test_shared_hash_blocks_keep_the_books(reqs, cpu_blocks: int, ratio: int) -> None:
    # requests sharing hash prefixes across sessions, all submitted at once
    cfg = EngineConfig(
        num_gpu_blocks=40, block_size=8, num_cpu_blocks=cpu_blocks, hash_block_tokens=8 * ratio
    )
    eng = EngineModel("e0", cfg, flat_perf())
    for k, (family, n_hashes, out) in enumerate(reqs):
        hashes = tuple(family * 100 + j for j in range(n_hashes))
        prompt = n_hashes * 8 * ratio + k % 5
        eng.submit(SimRequest(k, f"u{k}", prompt, out, block_hashes=hashes), 0.0)
    run(eng)
    s = eng.stats()
    assert s["finished"] == len(reqs)
    assert s["prompt_tokens"] == s["hit_tokens"] + s["prefilled_tokens"]


def test_a_prompt_after_an_idle_spell_or_a_large_chunk_pays_the_cold_step() -> None:
    """``FittedPerf.cold_step_s``: a CPU engine's caches go cold while it idles and while it
    computes a large chunk; a few small steps in a row warm them again."""
    perf = FittedPerf(0.001, 1e-6, engine="test", cold_step_s=0.004, warm=WarmRule(0.1, 3, 64))
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=1000), perf)
    a, t = one(eng, "a", "s1", 100, 5, 0.0)
    assert a.first_token_s == pytest.approx(0.001 + 100e-6 + 0.004)  # the engine's first step
    # the decodes right after the large chunk run cold too, until three small steps in a row
    assert t - a.first_token_s == pytest.approx(4 * 0.001 + 3 * 0.004)
    # right after four small steps (the decodes): warm
    b, t2 = one(eng, "b", "s2", 2, 3, t + 0.01)
    assert b.first_token_s - (t + 0.01) == pytest.approx(0.001 + 2e-6)
    # after a pause longer than the warm rule's gap_s: cold
    c, t3 = one(eng, "c", "s3", 2, 1, t2 + 0.5)
    assert c.first_token_s - (t2 + 0.5) == pytest.approx(0.001 + 2e-6 + 0.004)
    # right after one small step (c's prefill, one token out): not yet warm again
    d, _ = one(eng, "d", "s4", 2, 1, t3)
    assert d.first_token_s - t3 == pytest.approx(0.001 + 2e-6 + 0.004)
    # the same engine without the term: every step as before
    plain = EngineModel("e1", EngineConfig(num_gpu_blocks=1000), flat_perf(0.0))
    e, _ = one(plain, "e", "s1", 100, 5, 0.0)
    assert e.first_token_s == pytest.approx(0.001 + 100e-6)
