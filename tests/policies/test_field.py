"""The field's baselines: llm-d's turn-priority and LAS orders, Dynamo-style stickiness."""

from __future__ import annotations

from types import SimpleNamespace

from turnstile.policies import PolicySet
from turnstile.policies.field import LasRelease, TurnPriorityRelease
from turnstile.sim.cluster import EngineGroup, run_sim
from turnstile.workload.model import ToolCall, Turn, Workflow

GROUP = [EngineGroup(gpu="H100", model="llama-3.1-8b", count=2, kv_tokens=24_576)]


def _wfs(n: int = 30) -> list[Workflow]:
    turns = tuple(Turn(input_tokens=2_000, output_tokens=200, context_tokens=2_200 * i,
                       tools=(ToolCall("Bash", 1.0, "ok"),)) for i in range(4))
    return [Workflow(f"w{i}", 0.2 * i, turns) for i in range(n)]


def test_every_baseline_finishes_every_workflow_under_contention():
    for spec in ("turn-priority", "las", "eager+sticky", "turn-priority:max_active=2"):
        res = run_sim(_wfs(), spec, GROUP)
        assert all(w.finished_s > 0 for w in res.workflows), spec


def test_turn_priority_prefers_later_turns_and_resets_after_idle():
    rel = TurnPriorityRelease(reset_idle_s=120.0)
    wf = SimpleNamespace(id="w0")
    keys = [rel.key(SimpleNamespace(workflow=wf, ready_s=r), r)  # type: ignore[arg-type]
            for r in (0.0, 10.0, 20.0, 500.0)]
    # counts 0, 1, 2 then 0 again after a 480 s gap: key = -(n - 0.05 x ready)
    assert keys == [-(0 - 0.0), -(1 - 0.5), -(2 - 1.0), -(0 - 25.0)]


def test_las_orders_by_attained_service_and_sticky_stays_put():
    wf = SimpleNamespace(attained_tokens=5_000)
    assert LasRelease().key(SimpleNamespace(workflow=wf), 0.0) == 5_000.0  # type: ignore[arg-type]
    ps = PolicySet.from_spec("las+sticky")
    assert ps.release.name == "las" and ps.routing.name == "sticky"
    res = run_sim(_wfs(6), "eager+sticky", GROUP)
    for w in res.workflows:
        assert len({t.engine for t in w.turns}) == 1  # healthy engines: never moves
