"""``auto`` (the default release policy): misses it adapts on, holds it makes, its bound."""


from __future__ import annotations

import math
from pathlib import Path

from turnstile.core.state import TurnRecord, WorkflowRecord
from turnstile.policies import PolicySet
from turnstile.policies.auto import AutoRelease
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.traces import load_trace
from turnstile.workload import ToolCall, Turn, Workflow

FIXTURE = Path(__file__).parents[1] / "fixtures" / "traces" / "mini_swe_agent"


def _run(spec: str, wfs: list[Workflow], hbt: int = 0, **group: object) -> ClusterSim:
    sim = ClusterSim(wfs, PolicySet.from_spec(spec), [EngineGroup(**group)],  # type: ignore[arg-type]
                     hash_block_tokens=hbt)
    sim.run()
    return sim


def test_misses_that_are_not_evictions_do_not_shrink_the_gate() -> None:
    """Sessions whose agent rewrites its context between turns (a summarised or edited
    history: the next prompt's blocks have other content hashes, though the trace counts the
    history as context), replayed one at a time on one engine: their context misses the
    prefix cache with KV to spare — no eviction. cvar took such misses for evictions and
    shrank its gate; auto counts none of them."""
    hbt = 64

    def session(i: int) -> Workflow:
        turns, ctx = [], 0
        for k in range(4):
            inp = 1_024
            n = (ctx + inp) // hbt
            turns.append(Turn(inp, 128, ctx, block_hashes=tuple(
                i * 10_000 + k * 1_000 + j for j in range(n)),  # rewritten: new content
                tools=(ToolCall("t", 5.0),)))
            ctx += inp + 128
        return Workflow(f"s{i}", i * 1_000.0, tuple(turns))

    wfs = [session(i) for i in range(12)]
    cvar = _run("cvar", wfs, hbt).policies.release
    auto = _run("auto", wfs, hbt).policies.release
    assert isinstance(auto, AutoRelease)
    assert cvar.kv_fill < 0.5  # cvar saw the misses and shrank its gate
    assert auto._miss[0] == 0 and auto._evicted_at == -math.inf  # none a gate could prevent
    assert auto.kv_fill >= 0.5


def test_a_growing_hashed_session_hits_its_own_earlier_blocks() -> None:
    """Agent logs imported with content-hash block names (mini-swe-agent): each turn's prompt
    grows past the hash block its predecessor's prompt ended in. Those blocks were stored
    under the session's name; the engine model matches them, so a session replayed alone on
    one engine misses little of its context: 2.5% here, each predecessor's partial last
    16-token block on ~500-token prompts (5.9% before: the whole hash block each predecessor's
    prompt ended in, and its output; on SWE-agent-like 6k-token prompts 3.1% before, 0.1%
    after)."""
    loaded = load_trace(FIXTURE)
    wfs = [w.shifted(i * 10_000.0, id=f"{w.id}#{i}") for i in range(4) for w in loaded.workflows]
    sim = _run("eager", wfs, loaded.hash_block_tokens)
    ctx = missed = 0
    for w in sim.finished:
        for t in w.turns[1:]:
            ctx += t.turn.context_tokens
            missed += max(0, t.turn.context_tokens - t.cached_tokens)
    # what remains: the partial last KV block of each predecessor and its last token
    assert ctx > 0 and missed <= 0.03 * ctx, (missed, ctx)


def test_started_workflows_are_never_held_and_new_ones_wait_for_kv() -> None:
    """Two long sessions fill a small engine's KV. Their own next turns are never held; a
    third session waits at the gate on KV demand alone with ``evidence_gate=False``; with it
    (no eviction seen yet) it waits only while its prompt and expected output do not fit
    beside the running turns' (the engine would queue it), then starts at once."""
    def session(i: int, at: float) -> Workflow:
        turns = tuple(Turn(30_000 if k == 0 else 500, 2_000, 0 if k == 0 else 32_000 + 2_500 * k,
                           tools=(ToolCall("t", 20.0),) if k < 2 else ())
                      for k in range(3))
        return Workflow(f"s{i}", at, turns)
    wfs = [session(0, 0.0), session(1, 0.1), session(2, 5.0)]
    for evidence in (True, False):
        pset = PolicySet.from_spec("auto")
        pset.release = AutoRelease(evidence_gate=evidence)
        sim = ClusterSim(wfs, pset, [EngineGroup(kv_tokens=80_000)])
        sim.run()
        done = {w.id: w for w in sim.finished}
        for w in done.values():
            for t in w.turns[1:]:
                assert t.released_s == t.ready_s  # a started workflow's turn goes at once
        first = done["s2"].turns[0]
        running_done = min(done[w].turns[0].finished_s for w in ("s0", "s1"))
        if evidence:  # no eviction seen: held only while the engine would queue it
            assert first.released_s > first.ready_s
            assert first.released_s <= running_done + 1e-6  # room once a running turn ends
            assert first.started_s - first.released_s < 0.1  # it did not queue there
        else:  # the gate holds on KV demand alone
            assert first.released_s > first.ready_s
            assert first.released_s - first.ready_s <= max(
                pset.release.hold_bound_s(sim.now), 60.0)


def test_the_bound_follows_observed_turn_and_flow_times() -> None:
    rel = AutoRelease()
    assert rel.hold_bound_s(0.0) == rel.boot_hold_s == 5.0
    rel._turn_p50 = 3.0
    assert rel.hold_bound_s(0.0) == 30.0  # 10 x the median turn time
    for _ in range(8):
        rel._flow_p50.add(100.0)
    assert rel.hold_bound_s(0.0) == 800.0  # 8 x the median flow time


def test_the_bound_counts_unfinished_workflows_at_their_age() -> None:
    """Started, unfinished workflows are lower bounds of flow time: the median counts them
    at their age net of holds (not only the short workflows that finished first)."""
    rel = AutoRelease(censored_flow=True)
    for _ in range(5):
        rel._flow_p50.add(100.0)
    for i in range(9):  # nine sessions started at t=0, one held 200 s so far
        rel._since[f"w{i}"] = 0.0
    rel._held_s["w0"] = 200.0
    rel._turn_p50 = 3.0
    assert rel.flow_p50_s(1_000.0) == 1_000.0  # 14 values: 5 x 100, 800, 8 x 1,000
    assert rel.hold_bound_s(1_000.0) == 8_000.0
    assert AutoRelease(censored_flow=False).flow_p50_s(1_000.0) == math.inf


def test_paused_sessions_sharing_a_prefix_count_its_kv_once() -> None:
    """Two sessions paused in long tool calls share a 30,720-token prefix (same
    ``block_hashes``, as AIPerf's shared system prompts). A paged engine stores it once: a
    third session with the same prefix fits beside them (and a running turn) and is not held.
    Counting each paused context whole (``dedup_shared=False``) holds it at the gate."""
    shared = tuple(range(30))  # 30 hash blocks of 1,024 tokens

    def session(i: int, at: float) -> Workflow:
        turns = tuple(Turn(30_720 if k == 0 else 500, 500, 0 if k == 0 else 31_220 + 1_000 * k,
                           tools=(ToolCall("t", 200.0),) if k < 2 else (), block_hashes=shared)
                      for k in range(3))
        return Workflow(f"s{i}", at, turns)
    busy = Workflow("busy", 55.0, (Turn(500, 4_000, 0),))  # keeps the engine from idling
    wfs = [session(0, 0.0), session(1, 0.1), busy, session(2, 60.0)]
    held = {}
    for dedup in (True, False):
        pset = PolicySet.from_spec("auto")
        # the gate's KV accounting on its own (no eviction evidence needed)
        rel = pset.release = AutoRelease(dedup_shared=dedup, evidence_gate=False)
        sim = ClusterSim(wfs, pset, [EngineGroup(kv_tokens=80_000)], hash_block_tokens=1_024)
        sim.run()
        first = {w.id: w for w in sim.finished}["s2"].turns[0]
        held[dedup] = first.released_s - first.ready_s
        assert held[dedup] <= max(rel.hold_bound_s(sim.now), 60.0)
    assert held[True] == 0.0
    assert held[False] > 0.0


def test_holds_past_the_ttft_tail_are_capped_once_their_share_is_spent() -> None:
    """First turns held past the TTFT P95 of unheld turns may be at most ``ttft_tail_share``
    of all turns (with n turns per workflow, that share x n of first turns); past it, the
    bound drops to that P95."""
    rel = AutoRelease()
    rel._turn_p50 = 30.0
    assert rel.hold_bound_s(0.0) == 300.0
    rel._ttft_cap = 4.0
    for _ in range(5):
        rel._wf_turns.add(10.0)  # 10 turns per workflow: 25% of first turns may go past
    for over in [True] * 3 + [False] * 13:
        rel._ttft_tail.append(over)
        rel._tail_n += over
    assert not rel._tail_spent() and rel.hold_bound_s(0.0) == 300.0  # 3/16 < 25%
    for _ in range(2):
        rel._ttft_tail.append(True)
        rel._tail_n += 1
    assert rel._tail_spent() and rel.hold_bound_s(0.0) == 4.0  # 5/18 >= 25%: capped


def test_the_gate_holds_only_while_evictions_cost_a_tenth_of_the_context() -> None:
    """Evidence for the gate: over the last 64 counted turns (a turn on the engine its session
    paused on, while that engine's KV demand overflowed), evictions cost more than 10% of the
    context. A few whole-context misses among many hits are not evidence; sustained ones are."""
    rel = AutoRelease()
    assert rel.evidence_gate and rel.evict_share == 0.1
    wf = WorkflowRecord("w", 0.0, "default", None)

    def finish(k: int, cached: int) -> None:
        prev = TurnRecord(wf, k - 1, Turn(1_000, 10, 0))
        prev.engine, prev.finished_s = "e0", 10.0 * k - 5
        turn = TurnRecord(wf, k, Turn(100, 10, 10_000))
        turn.engine, turn.cached_tokens, turn.finished_s = "e0", cached, 10.0 * k
        wf.turns[:] = [prev, turn] if k == 1 else [*wf.turns[:k - 1], prev, turn]
        rel._count_miss(turn)

    rel._overflow_at["e0"] = 1e9  # the engine overflowed during every pause
    for k in range(1, 61):  # 1 whole-context miss in 20: 5% of the context
        finish(k, 0 if k % 20 == 0 else 10_000)
    assert rel._evicted_at == -math.inf
    for k in range(61, 71):  # a run of misses: past 10% over the window
        finish(k, 0)
    assert rel._evicted_at > 0
