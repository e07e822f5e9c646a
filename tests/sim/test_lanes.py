"""Slots and forward passes: llama.cpp's ``split_equal`` over runs of consecutive slots, the
server's slot choice, and an engine model whose step times follow its requests' slots."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest
from turnstile.sim.engine_profile import profile_for
from turnstile.sim.fitted_perf import FittedPerf, forward_passes
from turnstile.sim.lanes import Lanes, equal_split_passes
from turnstile.workload import ToolCall, Turn, Workflow

UB = 512
#: llama-server's pick of an idle slot for an unbound request (its profile's rule)
SERVER_SLOT = profile_for("llama.cpp").server_slot


@pytest.mark.parametrize(
    ("seqs", "passes"),
    [
        ([(0, 1), (1, 1), (2, 1)], (1, 0)),  # three decoders on consecutive slots: one pass
        ([(0, 1), (1, 1), (3, 1)], (1, 1)),  # a gap: {0, 1}, then {3} alone
        ([(0, 1), (2, 1)], (0, 2)),  # two one-token passes (cheaper on a CPU than one of two)
        ([(0, 1), (3, 1), (1, 20)], (2, 1)),  # {0, 1} one token each, {3}, then slot 1's 19
        ([(0, 1), (1, 1), (2, 20)], (2, 0)),  # the profile's layout: newcomer after decoders
        ([(1, 1), (0, 20)], (1, 1)),  # batch order: decoders first, so slot 0 is not added
        ([(0, 1100)], (3, 0)),  # 512 + 512 + 76
        ([(0, 513)], (1, 1)),  # 512, then a one-token pass
        ([(0, 30), (1, 10)], (2, 0)),  # 10 of each, then slot 0's other 20
        ([], (0, 0)),
    ],
)
def test_equal_split_passes_follow_llama_cpp(seqs, passes):
    assert equal_split_passes(seqs, UB) == passes


def test_a_pass_takes_at_most_the_micro_batch():
    # four prompts of 300 on consecutive slots: 128 of each a pass, then 128, then 44
    assert equal_split_passes([(i, 300) for i in range(4)], UB) == (3, 0)


@given(st.integers(0, 3000), st.integers(0, 8), st.sampled_from([8, 16, 512]))
def test_the_closed_form_is_the_profiles_layout(p, d, ub):
    """``forward_passes`` (what the profile fits: decoders on slots 0..d-1, the prompt on d) is
    ``equal_split_passes`` of that layout (with no more slots than a micro-batch's tokens)."""
    seqs = [(i, 1) for i in range(d)] + ([(d, p)] if p else [])
    assert forward_passes(p, d, ub, "equal") == equal_split_passes(seqs, ub)


def req(i: int, session: str) -> SimRequest:
    return SimRequest(i, session, 10, 5)


def test_the_server_picks_the_sessions_slot_else_the_least_recently_used():
    lanes = Lanes(3, UB, SERVER_SLOT)
    a, b, c = req(0, "a"), req(1, "b"), req(2, "c")
    # never-used slots tie; llama.cpp keeps the last of a tie, so a fresh server fills its
    # slots from the highest id down (seen on llama-server: 3, 2, 1 with -np 4)
    assert [lanes.admit(r) for r in (a, b, c)] == [2, 1, 0]
    lanes.release(b)
    lanes.release(a)
    a2 = req(3, "a")
    assert lanes.admit(a2) == 2  # its session's slot, though slot 1 was used less recently
    d = req(4, "d")
    assert lanes.admit(d) == 1
    lanes.release(c)
    lanes.release(a2)
    assert lanes.admit(req(5, "e")) == 0  # least recently used of {0, 2}
    with pytest.raises(RuntimeError, match="busy"):
        lanes.admit(req(6, "f"), slot=1)


def test_decoding_slots_price_the_step():
    lanes = Lanes(4, UB, SERVER_SLOT)
    rs = [req(i, f"s{i}") for i in range(4)]
    for i, r in enumerate(rs):
        lanes.admit(r, slot=i)
        lanes.start_decoding(r)
    assert lanes.decode_passes() == (1, 0)
    lanes.release(rs[2])
    assert lanes.decode_passes() == (1, 1)  # {0, 1} and {3}
    assert lanes.prefill_passes(rs[1], 0) == (1, 1)
    new = req(9, "n")
    lanes.admit(new)  # slot 2 again: the least recently used idle one
    lanes.chunk(new, 40)
    # batch order 0, 1, 3 (decoders), 2 (the prompt): {0, 1, 2} one token each, {3} alone,
    # then slot 2's other 39
    assert lanes.step_passes() == (2, 1)
    assert lanes.chunks == []


# -- the engine model --------------------------------------------------------------------------

#: a llama.cpp-like CPU engine: 8 ms a pass, 2 ms a token, one-token passes 3 ms
PERF = FittedPerf(b0=0.008, b1=0.002, b2=0.002, b0_one=0.003, ubatch_tokens=UB,
                  ubatch_split="equal", engine="llama.cpp")


def test_the_engine_model_prices_its_slots():
    """Three decoders on slots 0-2; when slot 1's finishes, {0, 2} decode as two one-token
    passes (2 × (3 + 2) ms), not one of two tokens (8 + 2 × 2 ms)."""
    eng = EngineModel("e", EngineConfig(num_gpu_blocks=4096, block_size=16, max_num_seqs=4),
                      PERF)
    assert eng.sched.lanes is not None
    for i, out in enumerate((40, 3, 40)):
        eng.submit(SimRequest(i, f"s{i}", 16, out), 0.0)
    now, durs = 0.0, []
    while (o := eng.step(now)) is not None:
        durs.append(o.duration_s)
        now = o.end_s
        if len(durs) == 6:
            break
    assert durs[1] == pytest.approx(0.008 + 3 * 0.002)  # three decoders, one pass
    assert durs[-1] == pytest.approx(2 * (0.003 + 0.002))  # {0, 2}: two one-token passes
    blind = FittedPerf(b0=0.008, b1=0.002, b2=0.002, b0_one=0.003, ubatch_tokens=UB)
    assert blind.lane_ubatch == 0  # the simple split does not depend on slots
    assert EngineModel("f", EngineConfig(num_gpu_blocks=64), blind).sched.lanes is None


def sessions(n: int) -> list[Workflow]:
    """Agent sessions of four turns, each appending to the last one's context."""
    out = []
    for i in range(n):
        turns, ctx = [], 0
        for k in range(4):
            new, gen = 40 + 13 * (i % 5) + 9 * k, 4 + (7 * i + 3 * k) % 23
            turns.append(Turn(new, gen, context_tokens=ctx,
                              tools=(ToolCall("t", 0.05 * (1 + k % 3)),)))
            ctx += new + gen
        out.append(Workflow(f"w{i}", 0.3 * i, tuple(turns)))
    return out


@pytest.mark.parametrize("slots", [0, 4])
def test_slot_aware_steps_leap_exactly(slots):
    """Leaps price their iterations by the same slots as single steps: fast-forward changes
    nothing, on a paged engine (the server's slot choice) and a slot-limited one (its own)."""
    group = EngineGroup(count=2, kv_tokens=8192, max_num_seqs=4, max_batched_tokens=2048,
                        kv_slots=slots, perf=PERF)

    def run(ff: bool):
        res = ClusterSim(sessions(24), PolicySet.from_spec("eager"), [group],
                         block_size=1 if slots else 16, fast_forward=ff).run()
        turns = sorted((t.workflow.id, t.index, t.first_token_s, t.finished_s)
                       for w in res.workflows for t in w.turns)
        return turns, res.engine_stats

    stepped, leaped = run(False), run(True)
    assert [t[:2] for t in leaped[0]] == [t[:2] for t in stepped[0]]
    for a, b in zip(stepped[0], leaped[0], strict=True):
        assert b[2:] == pytest.approx(a[2:], rel=1e-9, abs=0.0), (a, b)
    assert leaped[1] == stepped[1]


def test_prompts_of_one_step_are_batched_by_slot():
    """The server adds prompts to its batch slot by slot, whatever order they came in: two
    equal prompts admitted into slots 3 then 2 are one pass over {2, 3}."""
    lanes = Lanes(4, UB, SERVER_SLOT)
    a, b = req(0, "a"), req(1, "b")
    assert (lanes.admit(a), lanes.admit(b)) == (3, 2)
    lanes.chunk(a, 20)
    lanes.chunk(b, 20)
    assert lanes.step_passes() == (1, 0)  # in admission order it would be {3}, then {2}


def test_every_chunk_of_a_long_prompt_prices_its_passes():
    """A prompt longer than the step budget beside a decoder: the decoder's slot (3) and the
    prompt's (2) are not a run, so every step of the prompt, the first and the continued
    ones, is a one-token pass then a 63-token one."""
    eng = EngineModel("e", EngineConfig(num_gpu_blocks=4096, block_size=16, max_num_seqs=4,
                                        max_batched_tokens=64), PERF)
    eng.submit(SimRequest(0, "a", 16, 400), 0.0)
    now = eng.step(0.0).end_s  # a's prompt; a decodes from here on, in slot 3
    eng.submit(SimRequest(1, "b", 200, 3), now)
    durs = []
    for _ in range(3):  # b's chunks of 63, 63, 63 (then 11)
        o = eng.step(now)
        eng.check_integrity()
        durs.append(o.duration_s)
        now = o.end_s
    assert sorted(eng.sched.lanes.of.values()) == [2, 3]
    one_then_rest = 0.008 + 0.003 + 0.002 * 63 + 0.002 * 1
    assert durs == pytest.approx([one_then_rest] * 3, rel=1e-12)


def long_sessions(n: int) -> list[Workflow]:
    """Sessions whose prompts take many step budgets, beside others decoding."""
    out = []
    for i in range(n):
        turns, ctx = [], 0
        for k in range(2):
            new, gen = 900 + 250 * ((3 * i + k) % 5), 30 + (11 * i + 5 * k) % 60
            turns.append(Turn(new, gen, context_tokens=ctx, tools=(ToolCall("t", 0.2),)))
            ctx += new + gen
        out.append(Workflow(f"w{i}", 0.15 * i, tuple(turns)))
    return out


def test_prefill_leaps_price_their_passes_by_slot(monkeypatch):
    """Chunked prefills leaped over (fast-forward) beside decoders in scattered slots give the
    very floats that stepping gives: the leap counts each iteration's passes from the slots."""
    import turnstile.sim.leap_loop as leap_loop
    from turnstile.build_info import compiled_build

    group = EngineGroup(count=1, kv_tokens=16_384, max_num_seqs=4, max_batched_tokens=128,
                        perf=PERF)
    ran = []
    run_prefill = leap_loop.LeapLoops._run_prefill

    def counted(self, out, plan, until):
        got = run_prefill(self, out, plan, until)
        ran.append(bool(got))
        return got

    def timeline(ff: bool):
        res = ClusterSim(long_sessions(10), PolicySet.from_spec("eager"), [group],
                         fast_forward=ff).run()
        return sorted((t.workflow.id, t.index, repr(t.first_token_s), repr(t.finished_s))
                      for w in res.workflows for t in w.turns), res.iterations

    stepped = timeline(False)
    monkeypatch.setattr(leap_loop.LeapLoops, "_run_prefill", counted)
    assert timeline(True) == stepped
    if compiled_build() is None:
        assert any(ran), "no prefill leap ran"


def test_lanes_hand_the_step_its_prompt_chunks_when_there_are_several():
    lanes = Lanes(4, UB, SERVER_SLOT)
    a, b = req(0, "a"), req(1, "b")
    lanes.admit(a)
    lanes.admit(b)
    lanes.chunk(a, 30, 500)
    assert lanes.step_passes() == (1, 0)
    assert lanes.step_prompts() is None  # one chunk: the step's sums say it exactly
    lanes.chunk(a, 30, 530)
    lanes.chunk(b, 40, 0)
    lanes.step_passes()
    assert lanes.step_prompts() == [(30, 530), (40, 0)]
    assert lanes.step_prompts() is None  # taken


def test_an_engine_prices_two_small_appends_in_one_step_each_by_its_kernel():
    """Two sessions' 40-token prompts admitted in one step of a threshold model: both pay
    ``b5`` (each is under 64 query tokens), as llama.cpp's kernel choice per sequence does."""
    perf = FittedPerf(0.008, 1e-3, 2e-3, 0.0, 5e-7, b5=7e-7, small_chunk_tokens=64.0,
                      small_chunk_rule="below", ubatch_tokens=UB, ubatch_split="equal",
                      engine="llama.cpp")
    perf.slot_passes = True
    eng = EngineModel("e", EngineConfig(num_gpu_blocks=4096, block_size=16, max_num_seqs=4,
                                        max_batched_tokens=2048), perf)
    eng.submit(SimRequest(0, "a", 40, 5), 0.0)
    eng.submit(SimRequest(1, "b", 40, 5), 0.0)
    o = eng.step(0.0)
    eng.check_integrity()
    pairs = 40 * 41 / 2
    # slots 3 and 2, one pass over {2, 3}
    assert o.duration_s == pytest.approx(0.008 + 1e-3 * 80 + (5e-7 + 7e-7) * 2 * pairs,
                                         rel=1e-12)
