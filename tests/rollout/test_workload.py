"""Rollout batches: seeded, shaped N×G, drifting longer and more tool-heavy, errors ~ length."""

from __future__ import annotations

import numpy as np

from turnstile.rollout.workload import RolloutSpec, RolloutWorkload, drifted_spec, training_tokens
from turnstile.workload import synth
from turnstile.workload.model import validate_workflow
from turnstile.workload.synth_spec import SynthSpec


def test_batches_are_seeded_and_shaped() -> None:
    spec = RolloutSpec(n_prompts=8, group_size=4, seed=3)
    a, b = RolloutWorkload(spec).batch(2), RolloutWorkload(spec).batch(2)
    assert [t.workflow for t in a] == [t.workflow for t in b]
    assert len(a) == 32 and len({t.id for t in a}) == 32
    assert len({t.prompt_id for t in a}) == 8
    for tr in a:
        assert not validate_workflow(tr.workflow)
        assert tr.workflow.turns[0].prompt_tokens == tr.prompt_tokens
        assert tr.workflow.turns[-1].tools == ()
    # samples of one prompt share the task (first prompt and hint)
    by_prompt: dict[str, set[tuple[int, float]]] = {}
    for tr in a:
        by_prompt.setdefault(tr.prompt_id, set()).add((tr.prompt_tokens, tr.hint))
    assert all(len(v) == 1 for v in by_prompt.values())
    assert RolloutWorkload(RolloutSpec(n_prompts=8, group_size=4, seed=4)).batch(2)[0].workflow \
        != a[0].workflow


def test_prompts_repeat_across_epochs() -> None:
    w = RolloutWorkload(RolloutSpec(n_prompts=8, group_size=2, pool_size=16))
    seen = [set(w.prompts_of(k)) for k in range(4)]
    assert seen[0] | seen[1] == set(range(16))  # one epoch = two steps
    assert seen[0].isdisjoint(seen[1])


def test_drift_longer_and_more_tool_heavy() -> None:
    w = RolloutWorkload(RolloutSpec(n_prompts=32, group_size=8))
    early, late = w.batch(0), w.batch(15)

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs))

    assert mean([t.num_turns for t in late]) > 1.3 * mean([t.num_turns for t in early])
    assert mean([t.total_output_tokens for t in late]) > mean([t.total_output_tokens
                                                               for t in early])
    base = synth.default_spec()
    s0, s15 = drifted_spec(base, w.spec, 0), drifted_spec(base, w.spec, 15)

    def tools_per_turn(s: SynthSpec) -> float:
        return sum(k * p for k, p in enumerate(s.tools_per_turn))

    assert tools_per_turn(s15) > 1.3 * tools_per_turn(s0)
    assert training_tokens(late) > training_tokens(early)


def test_tool_outcomes_correlate_with_length() -> None:
    batch = RolloutWorkload(RolloutSpec(n_prompts=32, group_size=8)).batch(0)
    statuses = {c.status for t in batch for turn in t.workflow.turns for c in turn.tools}
    assert {"ok", "error"} <= statuses
    rate = np.array([
        sum(c.status == "error" for turn in t.workflow.turns for c in turn.tools)
        / max(1, sum(len(turn.tools) for turn in t.workflow.turns))
        for t in batch
    ])
    length = np.array([t.total_output_tokens for t in batch], dtype=float)
    # the error *rate* (not just the count) rises with the trajectory's length
    assert np.corrcoef(rate, np.log(length))[0, 1] > 0.3
    # difficulty drives both
    z = np.array([t.difficulty for t in batch])
    assert np.corrcoef(z, np.log(length))[0, 1] > 0.5
