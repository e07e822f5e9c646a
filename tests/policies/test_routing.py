"""Routing policies: kv-affinity, composite (with and without shadow load), least-loaded-shadow."""

from __future__ import annotations

from turnstile.core.state import (
    ClusterView,
    EngineLoad,
    TurnRecord,
    WorkflowRecord,
    charge,
    pause_session,
    report_stats,
)
from turnstile.policies import ROUTING, PolicySet
from turnstile.workload import Turn


def view_of(*loads: int) -> ClusterView:
    engines = []
    for i, load in enumerate(loads):
        e = EngineLoad(f"e{i}")
        charge(e, load)
        engines.append(e)
    return ClusterView(engines)


def turn_of(wf_id: str = "w", *, input_tokens: int = 1_000, context_tokens: int = 0,
            last_engine: str | None = None) -> TurnRecord:
    wf = WorkflowRecord(wf_id, 0.0, "default", None)
    wf.last_engine = last_engine
    return TurnRecord(wf, 0, Turn(input_tokens=input_tokens, output_tokens=10,
                                  context_tokens=context_tokens))


def test_kv_affinity_stays_where_the_context_is_unless_that_engine_would_queue_it():
    pol = ROUTING.create("kv-affinity")
    sticky = turn_of(last_engine="e1", context_tokens=20_000)
    assert pol.route(sticky, view_of(0, 10_000), 0.0) == "e1"  # balanced
    # unbalanced, but e1 starts it now: moving would re-prefill its 20k-token context
    assert pol.route(sticky, view_of(0, 100_000), 0.0) == "e1"
    queued = view_of(0, 100_000)
    report_stats(queued["e1"], queue_len=3)  # e1 queues requests: it goes where it runs now
    assert pol.route(sticky, queued, 0.0) == "e0"
    full = ClusterView([EngineLoad("e0", capacity_tokens=200_000),
                        EngineLoad("e1", capacity_tokens=110_000)])
    charge(full["e1"], 100_000)  # its prompt does not fit beside e1's running work
    assert pol.route(sticky, full, 0.0) == "e0"
    assert pol.route(turn_of(), view_of(5_000, 0), 0.0) == "e1"  # first turn: least-loaded


def test_kv_affinity_balanced_leaves_whenever_the_cluster_is_unbalanced():
    """The previous rule (SGLang router's balance guard), kept for comparison: it moved 133
    of ~860 turns of SWE-bench-like sessions on 4 idle-ish engines, each move losing the
    whole context (hit rate 71% vs 97%, simulated)."""
    pol = ROUTING.create("kv-affinity-balanced")
    sticky = turn_of(last_engine="e1", context_tokens=20_000)
    assert pol.route(sticky, view_of(0, 10_000), 0.0) == "e1"  # within balance_abs_tokens
    assert pol.route(sticky, view_of(100_000, 140_000), 0.0) == "e1"  # within balance_rel
    assert pol.route(sticky, view_of(0, 100_000), 0.0) == "e0"  # imbalanced: least-loaded


def test_kv_affinity_on_slot_engines_moves_a_session_only_to_a_free_slot():
    """Slot engines (2 slots each): e0 is busy (it queues requests), e1 idle but both its
    slots hold paused sessions, e2 lightly loaded with a free slot. The session leaves e0 for
    e2, never for e1 (it would evict a paused session); with no free slot anywhere it stays."""
    pol = ROUTING.create("kv-affinity")
    engines = [EngineLoad(f"e{i}", kv_slots=2) for i in range(3)]
    charge(engines[0], 100_000)
    report_stats(engines[0], queue_len=2)
    pause_session(engines[1], "a", 30_000)
    pause_session(engines[1], "b", 30_000)
    charge(engines[2], 20_000)
    view = ClusterView(engines)
    turn = turn_of(last_engine="e0", context_tokens=50_000)
    assert pol.route(turn, view, 0.0) == "e2"
    assert pol.route(turn_of(), view, 0.0) == "e2"  # a first turn: least-loaded with a slot
    pause_session(engines[2], "c", 30_000)  # e2: one turn running + one paused = 2 slots
    assert pol.route(turn, view, 0.0) == "e0"  # no free slot elsewhere: it stays
    paged = view_of(100_000, 0)  # paged engines always have a free slot: unchanged
    report_stats(paged["e0"], queue_len=2)
    pause_session(paged["e1"], "a", 30_000)
    assert pol.route(turn_of(last_engine="e0"), paged, 0.0) == "e1"


def test_kv_affinity_leaves_an_unhealthy_engine():
    pol = ROUTING.create("kv-affinity")
    view = view_of(0, 0, 5)
    report_stats(view["e2"], healthy=False)
    charge(view["e0"], 10)
    assert pol.route(turn_of(last_engine="e2"), view, 0.0) == "e1"


def test_shadow_load_steers_composite_and_least_loaded_shadow():
    view = view_of(0, 0)
    pause_session(view["e0"], "other", 200_000)  # sessions paused in tool calls with KV on e0
    first = turn_of()
    assert ROUTING.create("composite").route(first, view, 0.0) == "e1"
    assert PolicySet.from_spec("eager+composite-noshadow").routing.route(first, view, 0.0) == "e0"
    assert ROUTING.create("least-loaded-shadow").route(first, view, 0.0) == "e1"
    assert ROUTING.create("least-loaded").route(first, view, 0.0) == "e0"


def test_composite_follows_the_kv_and_ignores_its_own_shadow():
    view = view_of(0, 0)
    rec = turn_of("w", input_tokens=1_000, context_tokens=50_000, last_engine="e1")
    wf = rec.workflow
    # the session itself is paused on e1: its own context is not load against e1
    pause_session(view["e1"], "w", 51_000)
    wf.paused_engine, wf.paused_tokens = "e1", 51_000
    pol = ROUTING.create("composite")
    assert pol.route(rec, view, 0.0) == "e1"
    # a heavily loaded e1 outweighs the cache hit
    charge(view["e1"], 400_000)
    assert pol.route(rec, view, 0.0) == "e0"


def test_composite_groups_compatible_lengths():
    pol = ROUTING.create("composite")
    view = view_of(0, 0)
    assert pol.route(turn_of("a", input_tokens=100), view, 0.0) == "e0"  # tie: listed first
    # e0 now serves ~100-token prompts; a 100k-token prompt fits the unused e1 better
    assert pol.route(turn_of("b", input_tokens=100_000), view, 0.0) == "e1"
    assert pol.route(turn_of("c", input_tokens=120), view, 0.0) == "e0"
    assert pol.route(turn_of("d", input_tokens=90_000), view, 0.0) == "e1"


def test_composite_balances_engines_with_little_kv():
    """On engines holding a few thousand KV tokens, load must still count: a short first
    request (e.g. a client's calibration) must not steer every later session to one engine."""
    engines = [EngineLoad("e0", 2_000), EngineLoad("e1", 2_000)]
    view = ClusterView(engines)
    pol = ROUTING.create("composite")
    assert pol.route(turn_of("probe", input_tokens=20), view, 0.0) == "e0"
    routed = []
    for i in range(6):
        e = pol.route(turn_of(f"s{i}", input_tokens=450), view, 0.0)
        charge(view[e], 460)  # runs on and stays running on the engine it was routed to
        routed.append(e)
    assert routed.count("e0") == routed.count("e1") == 3
    # with the old fixed floor alone (32k tokens) the length term wins: all go to e1
    legacy = ROUTING.create("composite", load_floor_frac=1e9)
    view = ClusterView([EngineLoad("e0", 2_000), EngineLoad("e1", 2_000)])
    legacy.route(turn_of("probe", input_tokens=20), view, 0.0)
    routed = []
    for i in range(6):
        e = legacy.route(turn_of(f"s{i}", input_tokens=450), view, 0.0)
        charge(view[e], 460)
        routed.append(e)
    assert routed == ["e1"] * 6
