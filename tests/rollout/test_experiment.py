"""``run_rollout_sim``: every policy on the same batches, drawn once."""

from __future__ import annotations

from typing import Any

from turnstile.rollout.experiment import RolloutSimRequest, SharedBatches, run_rollout_sim
from turnstile.rollout.workload import RolloutSpec, RolloutWorkload


def _strip(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("wall_s",)}


def test_a_policy_gets_the_same_results_after_another_as_alone() -> None:
    req = dict(steps=2, gpus=8, prompts=4, samples=4, mix="tp1x4,tp2x2", train_gpus=0)
    both = run_rollout_sim(RolloutSimRequest(policies=("least-open", "cmlfq"), **req))
    alone = run_rollout_sim(RolloutSimRequest(policies=("cmlfq",), **req))
    assert _strip(both["policies"]["cmlfq"]) == _strip(alone["policies"]["cmlfq"])
    assert both["policies"]["cmlfq"]["steps"][0]["trajectories_done"] == 16


def test_shared_batches_are_drawn_once_and_equal_fresh_draws() -> None:
    spec = RolloutSpec(n_prompts=2, group_size=3, seed=4)
    shared = SharedBatches(RolloutWorkload(spec))
    first = shared.batch(1)
    assert shared.batch(1) is first  # not drawn again
    assert first == RolloutWorkload(spec).batch(1)
    assert shared.forecast(0) == RolloutWorkload(spec).forecast(0)
    assert shared.spec == spec
