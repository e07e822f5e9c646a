"""A run ends at its last completion, not at a policy timer still pending after it (issue 31,
item 5): makespan and every rate divide by the time the last turn finished."""

from __future__ import annotations

import pytest

from turnstile.bench.metrics import compute_metrics
from turnstile.policies import PolicySet
from turnstile.policies.release import EagerRelease
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.workload.model import ToolCall, Turn, Workflow

TIMER_S = 5_000.0


class LateTimerRelease(EagerRelease):
    """Eager, but asks to be woken at ``TIMER_S`` (a hold timer nobody needs any more)."""

    def next_wakeup(self, now: float) -> float | None:
        return TIMER_S if now < TIMER_S else None


def _workflows() -> list[Workflow]:
    turns = (Turn(500, 20, 0, tools=(ToolCall("bash", 1.0, "ok"),)), Turn(100, 30, 520))
    return [Workflow(f"w{i}", 0.5 * i, turns) for i in range(4)]


def _run(release: EagerRelease):
    ps = PolicySet.from_spec("eager")
    ps = PolicySet(release=release, routing=ps.routing, admission=ps.admission,
                   retention=ps.retention, spec="eager+late-timer")
    return ClusterSim(_workflows(), ps, [EngineGroup(gpu="H100", count=2)]).run()


def test_a_pending_policy_timer_does_not_extend_the_makespan() -> None:
    late = _run(LateTimerRelease())
    plain = _run(EagerRelease())
    last = max(w.finished_s for w in late.workflows)
    assert late.extra["clock_end_s"] == pytest.approx(TIMER_S)  # the timer did fire
    assert late.makespan_s == pytest.approx(last) and last < 60.0
    assert late.makespan_s == pytest.approx(plain.makespan_s)


def test_every_rate_ends_at_the_last_completion() -> None:
    res = _run(LateTimerRelease())
    m = compute_metrics(res.workflows, engine_stats=res.engine_stats,
                        makespan_s=res.makespan_s, gpu_price_per_h=3.6, gpu_power_w=700.0,
                        num_gpus=res.num_gpus)
    last = max(w.finished_s for w in res.workflows)
    assert m["makespan_s"] == pytest.approx(last)
    assert m["last_completion_s"] == pytest.approx(last)
    tokens = m["output_tokens"]
    assert m["throughput"]["output_tokens_per_s"] == pytest.approx(tokens / last)
    assert m["cost"]["gpu_hours"] == pytest.approx(2 * last / 3600)
    assert m["cost"]["joules"] == pytest.approx(2 * 700.0 * last)
