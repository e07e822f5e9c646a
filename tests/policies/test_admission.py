"""Admission policies: tiered-aging and compat-batching on hand-made records."""

from __future__ import annotations

import pytest

from turnstile.core import Release, Scheduler
from turnstile.core.state import EngineLoad, TurnRecord, WorkflowRecord
from turnstile.policies import ADMISSION, PolicySet
from turnstile.policies.admission import CompatBatchingAdmission, TieredAgingAdmission
from turnstile.workload import ToolCall, Turn, Workflow


def ready_turn(
    wf_id: str, *, input_tokens: int, context_tokens: int = 0, ready_s: float = 0.0,
    last_engine: str | None = None,
) -> TurnRecord:
    wf = WorkflowRecord(wf_id, 0.0, "default", None)
    wf.last_engine = last_engine
    rec = TurnRecord(wf, 0, Turn(input_tokens=input_tokens, output_tokens=10,
                                 context_tokens=context_tokens))
    rec.ready_s = ready_s
    return rec


def test_tiered_aging_prefers_cached_state_and_ages_the_oldest():
    pol = ADMISSION.create("tiered-aging")
    e0 = EngineLoad("e0")
    cached = ready_turn("cached", input_tokens=100, context_tokens=50_000, ready_s=40.0,
                        last_engine="e0")
    recompute = ready_turn("gone", input_tokens=100, context_tokens=50_000, ready_s=40.0,
                           last_engine="e1")
    old = ready_turn("old", input_tokens=100, context_tokens=500_000, ready_s=0.0)
    p_cached = pol.priority(cached, e0, 40.0)
    p_recompute = pol.priority(recompute, e0, 40.0)
    p_old = pol.priority(old, e0, 40.0)
    assert p_cached == pytest.approx(40.0 + 100 / 10_000)
    assert p_recompute == pytest.approx(40.0 + 50_100 / 10_000)
    assert p_old == pytest.approx(30.0)  # capped at w_max_s: it has waited 40 s > 30 s
    assert p_old < p_cached < p_recompute


def test_tiered_aging_cpu_tier_from_an_injected_kv_tier():
    pol = TieredAgingAdmission(kv_tier=lambda turn, engine: "cpu", reload_factor=0.1)
    rec = ready_turn("w", input_tokens=1_000, context_tokens=40_000, ready_s=5.0)
    assert pol.cost_tokens(rec, EngineLoad("e0")) == pytest.approx(1_000 + 4_000)
    assert pol.priority(rec, EngineLoad("e0"), 5.0) == pytest.approx(5.5)


def test_tiered_aging_through_the_scheduler_uses_the_previous_engine():
    """The core un-pauses the session before admission: last_engine is the residency signal."""
    ps = PolicySet.from_spec("eager+tiered-aging")
    s = Scheduler(ps, ["e0"])
    first = Turn(input_tokens=100, output_tokens=10, tools=(ToolCall("Bash", 1.0),))
    second = Turn(input_tokens=100, output_tokens=10, context_tokens=50_000)
    s.workflow_arrived(0.0, Workflow("a", 0.0, (first, second)))
    s.turn_finished(1.0, "a", 0)
    (resumed,) = s.tool_finished(2.0, "a", 0)
    # a session of the same size whose KV is nowhere (it ran elsewhere before) arrives now
    (fresh,) = s.workflow_arrived(2.0, Workflow("b", 2.0, (second,)))
    assert isinstance(resumed, Release) and isinstance(fresh, Release)
    assert resumed.priority == pytest.approx(2.0 + 100 / 10_000)
    assert fresh.priority == pytest.approx(2.0 + 50_100 / 10_000)


def test_compat_batching_defers_outliers_per_engine():
    pol = CompatBatchingAdmission(bucket_s=0.5, split_ratio=4.0)
    e0, e1 = EngineLoad("e0"), EngineLoad("e1")
    for i in range(5):
        rec = ready_turn(f"s{i}", input_tokens=1_024, ready_s=float(i))
        assert pol.priority(rec, e0, float(i)) == float(i)  # the engine's typical length: FIFO
    near = ready_turn("near", input_tokens=2_048, ready_s=10.0)  # 2× away: within split_ratio
    assert pol.priority(near, e0, 10.0) == 10.0
    far = ready_turn("far", input_tokens=65_536, ready_s=10.0)  # ~6 doublings away
    p_far = pol.priority(far, e0, 10.0)
    assert 10.0 + 0.5 * 5 < p_far < 10.0 + 0.5 * 6.5
    # another engine has its own history: its first turn is never deferred
    assert pol.priority(ready_turn("x", input_tokens=65_536, ready_s=10.0), e1, 10.0) == 10.0


def test_compat_batching_rejects_a_split_ratio_below_one():
    with pytest.raises(ValueError, match="split_ratio"):
        CompatBatchingAdmission(split_ratio=0.5)
