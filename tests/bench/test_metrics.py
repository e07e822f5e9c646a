"""compute_metrics on hand-made records with known times."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from turnstile.bench.metrics import compute_metrics, public_metrics, summarize
from turnstile.core.state import WorkflowRecord

Factory = Callable[..., WorkflowRecord]


def _two(wf: Factory) -> list[WorkflowRecord]:
    # w1: turn 0 held 1 s, engine queue 0.5 s; a tool; turn 1 released at once, one token.
    w1 = wf("w1", 0.0, [(0.0, 1.0, 1.5, 2.0, 4.0, 5), (6.0, 6.0, 6.0, 6.5, 7.0, 1)])
    # w2: held 3 s, TTFT 3.25 s, TPOT exactly (5.25 − 4.25) / 10 = 0.1 s.
    w2 = wf("w2", 1.0, [(1.0, 4.0, 4.0, 4.25, 5.25, 11)])
    return [w1, w2]


def test_flow_time_is_last_turn_minus_arrival(wf: Factory) -> None:
    m = compute_metrics(_two(wf), makespan_s=10.0)
    assert m["workflows"] == 2 and m["turns"] == 3
    flow = m["flow_time_s"]
    assert flow["count"] == 2
    assert flow["mean"] == pytest.approx((7.0 + 4.25) / 2)
    assert flow["p50"] == pytest.approx((7.0 + 4.25) / 2)
    assert flow["p95"] == pytest.approx(4.25 + 0.95 * (7.0 - 4.25))
    assert flow["max"] == 7.0
    assert m["_flow_times_s"] == [7.0, 4.25]


def test_flow_excludes_a_tool_after_the_last_turn(wf: Factory) -> None:
    w = wf("w", 0.0, [(0.0, 0.0, 0.0, 1.0, 2.0, 3)])
    w.finished_s = 30.0  # the scheduler marks it done when the trailing tool returns
    assert compute_metrics([w], makespan_s=30.0)["_flow_times_s"] == [2.0]


def test_ttft_includes_holding_and_engine_ttft_does_not(wf: Factory) -> None:
    m = compute_metrics(_two(wf), makespan_s=10.0)
    assert m["ttft_s"]["count"] == 3
    assert m["ttft_s"]["mean"] == pytest.approx((2.0 + 0.5 + 3.25) / 3)
    assert m["ttft_s"]["p50"] == pytest.approx(2.0)
    assert m["ttft_s"]["max"] == pytest.approx(3.25)
    assert m["engine_ttft_s"]["mean"] == pytest.approx((1.0 + 0.5 + 0.25) / 3)
    assert m["hold_s"]["mean"] == pytest.approx((1.0 + 0.0 + 3.0) / 3)
    assert m["e2e_s"]["mean"] == pytest.approx((4.0 + 1.0 + 4.25) / 3)

    held = wf("h", 0.0, [(0.0, 10.0, 10.0, 10.125, 11.0, 2)])
    h = compute_metrics([held], makespan_s=11.0)
    assert h["ttft_s"]["p95"] == pytest.approx(10.125)
    assert h["engine_ttft_s"]["p95"] == pytest.approx(0.125)
    assert h["hold_s"]["p95"] == pytest.approx(10.0)


def test_tpot_formula_skips_single_token_turns(wf: Factory) -> None:
    m = compute_metrics(_two(wf), makespan_s=10.0)
    tpot = m["tpot_s"]
    assert tpot["count"] == 2  # w1's second turn has one output token
    assert tpot["mean"] == pytest.approx(((4.0 - 2.0) / 4 + 0.1) / 2)
    assert tpot["max"] == pytest.approx(0.5)


def test_slo_attainment_and_goodput(wf: Factory) -> None:
    m = compute_metrics(_two(wf), makespan_s=10.0, slo_ttft_s=2.0, slo_tpot_s=0.1)
    slo = m["slo"]
    # TTFT 2.0 (meets, inclusive), 0.5 (meets), 3.25 (misses)
    assert slo["ttft_attainment"] == pytest.approx(2 / 3)
    # multi-token turns: TPOT 0.5 (misses), 0.1 (meets, inclusive)
    assert slo["tpot_attainment"] == pytest.approx(1 / 2)
    # both: only w1's single-token turn 1 (TPOT vacuously met)
    assert slo["turn_attainment"] == pytest.approx(1 / 3)
    assert slo["goodput_tokens_per_s"] == pytest.approx(1 / 10.0)
    assert m["throughput"]["output_tokens_per_s"] == pytest.approx(17 / 10.0)
    assert m["throughput"]["workflows_per_s"] == pytest.approx(2 / 10.0)

    loose = compute_metrics(_two(wf), makespan_s=10.0, slo_ttft_s=5.0, slo_tpot_s=1.0)["slo"]
    assert loose["turn_attainment"] == 1.0
    assert loose["goodput_tokens_per_s"] == pytest.approx(1.7)
    assert "workflow_attainment" not in loose


def test_slo_scale_with_given_and_estimated_standalone(wf: Factory) -> None:
    given = compute_metrics(
        _two(wf), makespan_s=10.0, slo_scale_k=1.5, standalone_s={"w1": 3.5, "w2": 4.25}
    )["slo"]
    assert given["standalone_source"] == "given"
    assert given["slowdown"]["max"] == pytest.approx(2.0)
    assert given["workflow_attainment"] == pytest.approx(0.5)

    est = compute_metrics(_two(wf), makespan_s=10.0, slo_scale_k=2.0)["slo"]
    assert est["standalone_source"].startswith("estimated")
    # w1 waited 1.5 s → 7 / 5.5; w2 waited 3 s → 4.25 / 1.25 = 3.4
    assert est["slowdown"]["max"] == pytest.approx(3.4)
    assert est["slowdown"]["count"] == 2
    assert est["workflow_attainment"] == pytest.approx(0.5)


def test_unfinished_workflows_and_turns_are_counted_apart(wf: Factory) -> None:
    open_wf = wf(
        "w3", 2.0, [(2.0, 2.0, 2.0, 2.5, 3.0, 4), (5.0, 5.0, 5.5, -1.0, -1.0, 4)], done=False
    )
    m = compute_metrics([*_two(wf), open_wf], makespan_s=10.0)
    assert m["workflows"] == 2 and m["workflows_unfinished"] == 1
    assert m["turns"] == 4 and m["turns_unfinished"] == 1
    assert m["flow_time_s"]["count"] == 2
    assert m["output_tokens"] == 17 + 4


def test_engine_stats_hit_rate_recompute_and_aliases(wf: Factory) -> None:
    stats: dict[str, dict[str, Any]] = {
        "e0": {
            "prompt_tokens": 300,
            "prefix_hit_tokens": 100,
            "recomputed_prefill_tokens": 50,
            "preemptions": 2,
            "healthy": True,
            "name": "x",
        },
        "e1": {"prompt_tokens": 100, "cached_tokens": 100, "preemptions": 1, "steps": 7},
    }
    m = compute_metrics(_two(wf), engine_stats=stats, makespan_s=10.0)
    assert m["prefix_hit_rate"] == pytest.approx(200 / 400)
    assert m["recomputed_prefill_tokens"] == 50
    assert m["preemptions"] == 3
    assert m["engine_totals"]["steps"] == 7
    assert "healthy" not in m["engine_totals"] and "name" not in m["engine_totals"]

    # no prompt_tokens from the engines: the finished turns' prompts (3 × 100) are the base
    m2 = compute_metrics(_two(wf), engine_stats={"e": {"hit_tokens": 75}}, makespan_s=10.0)
    assert m2["prefix_hit_rate"] == pytest.approx(75 / 300)
    assert m2["recomputed_prefill_tokens"] is None

    m3 = compute_metrics(_two(wf), makespan_s=10.0)
    assert m3["prefix_hit_rate"] is None and m3["preemptions"] is None


def test_cost(wf: Factory) -> None:
    m = compute_metrics(
        _two(wf), makespan_s=10.0, gpu_price_per_h=3.6, gpu_power_w=500.0, num_gpus=2
    )
    cost = m["cost"]
    assert cost["gpu_hours"] == pytest.approx(20 / 3600)
    assert cost["dollars"] == pytest.approx(0.02)
    assert cost["tokens_per_dollar"] == pytest.approx(17 / 0.02)
    assert cost["joules"] == pytest.approx(10_000.0)
    assert cost["tokens_per_joule"] == pytest.approx(17 / 10_000)
    assert compute_metrics(_two(wf), makespan_s=10.0)["cost"] is None
    only_power = compute_metrics(_two(wf), makespan_s=10.0, gpu_power_w=100.0)["cost"]
    assert "tokens_per_dollar" not in only_power and only_power["tokens_per_joule"] > 0


def test_percentiles_match_numpy_linear() -> None:
    s = summarize(range(1, 101))
    assert s["count"] == 100
    assert s["p50"] == pytest.approx(50.5)
    assert s["p95"] == pytest.approx(95.05)
    assert s["p99"] == pytest.approx(99.01)
    assert s["max"] == 100.0


@pytest.mark.parametrize("makespan_s", [0.0, 5.0])
def test_empty_input_never_crashes(makespan_s: float) -> None:
    m = compute_metrics(
        iter([]),
        makespan_s=makespan_s,
        engine_stats={},
        gpu_price_per_h=2.0,
        gpu_power_w=700.0,
        slo_scale_k=3.0,
    )
    assert m["workflows"] == 0 and m["turns"] == 0
    for key in ("flow_time_s", "ttft_s", "engine_ttft_s", "hold_s", "tpot_s", "e2e_s"):
        assert m[key]["count"] == 0 and m[key]["p95"] is None and m[key]["mean"] is None
    assert m["slo"]["ttft_attainment"] is None
    assert m["slo"]["workflow_attainment"] is None
    assert m["throughput"]["workflows_per_s"] == (0.0 if makespan_s else None)
    assert m["cost"]["tokens_per_dollar"] == (0.0 if makespan_s else None)
    assert m["_flow_times_s"] == []
    json.dumps(public_metrics(m), allow_nan=False)


def test_workflow_without_turns_and_zero_makespan(wf: Factory) -> None:
    empty = WorkflowRecord("e", 0.0, "default", None)
    m = compute_metrics([empty, *_two(wf)], makespan_s=0.0)
    assert m["workflows"] == 2 and m["workflows_unfinished"] == 1
    assert m["throughput"]["output_tokens_per_s"] is None
    json.dumps(public_metrics(m), allow_nan=False)


def test_public_metrics_strips_private_keys_at_every_depth(wf: Factory) -> None:
    m = compute_metrics(_two(wf), makespan_s=10.0)
    m["slo"]["_debug"] = [1, 2]
    pub = public_metrics(m)
    assert "_flow_times_s" not in pub and "_debug" not in pub["slo"]
    assert "_flow_times_s" in m  # the input is not modified


def test_vectorized_on_many_turns(wf: Factory) -> None:
    turns = [(float(i), i + 0.5, i + 0.5, i + 1.0, i + 2.0, 8) for i in range(10)]
    wfs = [wf(f"w{k}", 0.0, turns) for k in range(20_000)]  # 200k turns
    t0 = time.perf_counter()
    m = compute_metrics(wfs, makespan_s=100.0)
    elapsed = time.perf_counter() - t0
    assert m["turns"] == 200_000 and m["workflows"] == 20_000
    assert m["ttft_s"]["p99"] == pytest.approx(1.0)
    assert m["tpot_s"]["mean"] == pytest.approx(1.0 / 7)
    assert elapsed < 1.0, f"compute_metrics took {elapsed:.2f} s for 200k turns"
