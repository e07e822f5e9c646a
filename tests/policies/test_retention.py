"""Retention policies: ttl, infercept and budget-keep, learning from observed tool calls."""

from __future__ import annotations

import pytest

from turnstile.core.actions import LRU, RetentionDecision
from turnstile.core.state import EngineLoad, TurnRecord, WorkflowRecord, charge
from turnstile.policies import RETENTION, PolicySet
from turnstile.policies.retention import (
    BudgetKeepRetention,
    ToolLatencyEstimator,
    tool_key,
)
from turnstile.workload import ToolCall, Turn


def finished_turn(tool: str | None, *, prompt: int = 1_000, output: int = 10,
                  finished_s: float = 0.0) -> TurnRecord:
    wf = WorkflowRecord("w", 0.0, "default", None)
    tools = (ToolCall(tool, 999.0),) if tool is not None else ()
    rec = TurnRecord(wf, 0, Turn(input_tokens=prompt, output_tokens=output, tools=tools))
    rec.finished_s = finished_s
    return rec


def observe(policy: object, tool: str, durations: list[float]) -> None:
    for d in durations:
        rec = finished_turn(tool, finished_s=100.0)
        policy.on_tool_end(rec, 100.0 + d)  # type: ignore[attr-defined]


def test_estimator_is_bounded_and_uses_nearest_rank():
    est = ToolLatencyEstimator(window=3)
    for d in (100.0, 1.0, 2.0, 3.0):
        est.observe("t", d)
    assert est.count("t") == 3 and est.mean("t") == pytest.approx(2.0)
    assert est.quantile("t", 0.9) == 3.0 and est.quantile("t", 0.5) == 2.0
    assert est.quantile("unseen", 0.9) is None and est.mean("unseen") is None


def test_tool_key_names_every_call_or_none():
    assert tool_key(finished_turn("Bash")) == "Bash"
    assert tool_key(finished_turn(None)) == ""
    wf = WorkflowRecord("w", 0.0, "default", None)
    two = TurnRecord(wf, 0, Turn(1, 1, tools=(ToolCall("Read", 1.0), ToolCall("Bash", 1.0))))
    assert tool_key(two) == "Read+Bash"


def test_ttl_pins_for_learned_p90_times_margin():
    pol = RETENTION.create("ttl")
    e0 = EngineLoad("e0")
    assert pol.on_tool_start(finished_turn("Bash"), e0, 0.0) == RetentionDecision("pin", 2.0)
    observe(pol, "Bash", [float(d) for d in range(1, 11)])  # p90 (nearest rank) = 9 s
    decision = pol.on_tool_start(finished_turn("Bash"), e0, 0.0)
    assert decision.action == "pin" and decision.ttl_s == pytest.approx(9.0 * 1.2)
    # capped at max_ttl_s when quantile × margin overshoots it
    observe(pol, "Build", [110.0] * 5)
    assert pol.on_tool_start(finished_turn("Build"), e0, 0.0) == RetentionDecision("pin", 120.0)


def test_ttl_falls_back_to_lru_for_a_tool_slower_than_max_ttl():
    pol = RETENTION.create("ttl")
    observe(pol, "Train", [200.0] * 5)
    assert pol.on_tool_start(finished_turn("Train"), EngineLoad("e0"), 0.0) == LRU


def test_infercept_picks_discard_offload_and_pin_by_waste():
    pol = RETENTION.create("infercept")
    idle = EngineLoad("e0")
    observe(pol, "slow", [60.0] * 3)
    observe(pol, "fast", [0.1] * 3)
    # a tiny context with a long tool: recomputing 50 tokens costs less than moving them
    assert pol.on_tool_start(finished_turn("slow", prompt=40), idle, 0.0).action == "discard"
    # a medium context with a long tool: swap it out for 3 T
    mid = pol.on_tool_start(finished_turn("slow", prompt=20_000), idle, 0.0)
    assert mid.action == "offload" and mid.ttl_s == pytest.approx(180.0)
    # a big context with a fast tool: keep it, for 1.5 T
    big = pol.on_tool_start(finished_turn("fast", prompt=50_000), idle, 0.0)
    assert big.action == "pin" and big.ttl_s == pytest.approx(0.15)


def test_infercept_discard_gets_dearer_with_a_busy_engine():
    pol = RETENTION.create("infercept")
    observe(pol, "slow", [60.0] * 3)
    busy = EngineLoad("e0")
    charge(busy, 500_000)  # recomputing would stall a big running batch
    assert pol.on_tool_start(finished_turn("slow", prompt=40), busy, 0.0).action == "offload"


class HoldingRelease:
    """A release policy stub that says the next turn will be held ``hold_s``."""

    name = "holding"

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float:
        return self.hold_s


def bound_budget_keep(release: object) -> BudgetKeepRetention:
    base = PolicySet.from_spec("eager+budget-keep")
    ps = PolicySet(release=release, routing=base.routing,  # type: ignore[arg-type]
                   admission=base.admission, retention=base.retention)
    assert isinstance(ps.retention, BudgetKeepRetention)
    return ps.retention


def test_budget_keep_adds_the_expected_hold_of_a_bound_release():
    e0 = EngineLoad("e0")
    unbound = RETENTION.create("budget-keep")
    assert unbound.on_tool_start(finished_turn("Bash"), e0, 0.0) == RetentionDecision("pin", 2.0)
    pol = bound_budget_keep(HoldingRelease(5.0))
    assert pol.on_tool_start(finished_turn("Bash"), e0, 0.0) == RetentionDecision("pin", 7.0)
    observe(pol, "Bash", [10.0] * 4)
    assert pol.on_tool_start(finished_turn("Bash"), e0, 0.0).ttl_s == pytest.approx(17.0)
    # quantile × margin + hold beyond max_ttl_s: not worth the memory
    assert bound_budget_keep(HoldingRelease(200.0)).on_tool_start(
        finished_turn("Bash"), e0, 0.0) == LRU


@pytest.mark.parametrize("release", ["eager", "plas"])
def test_budget_keep_adds_no_hold_for_a_release_that_never_holds_or_does_not_estimate(release):
    rel = PolicySet.from_spec(release).release
    pol = bound_budget_keep(rel)
    assert pol.release is rel
    assert rel.expected_hold_s(finished_turn("Bash").workflow, 0.0) == (
        0.0 if release == "eager" else None)
    assert pol.on_tool_start(finished_turn("Bash"), EngineLoad("e0"), 0.0).ttl_s == 2.0
