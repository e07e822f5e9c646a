"""Libra-like workloads: seeded, within Libra's caps, long-tailed, and causal — remaining length
depends on the tool-return keys C-MLFQ's prefix tree sees."""

from __future__ import annotations

import numpy as np
import pytest

from turnstile.core.registry import UnknownNameError
from turnstile.rollout.libra_workloads import (
    WORKLOADS,
    DapoMathSpec,
    LibraWorkload,
    R2EGymSpec,
    SearchR1Spec,
    make_workload,
    workload_names,
)
from turnstile.rollout.workload import RolloutTrajectory, RolloutWorkload
from turnstile.workload.model import ToolStatus, validate_workflow

LIBRA = ("r2e-gym", "search-r1", "dapo-math")
_STATUS_WORD = {"ok": "success", "error": "failure", "timeout": "timeout"}


def tool_key(name: str, result_tokens: int | None, status: ToolStatus) -> str:
    """Libra's causal code ``tool:size:status`` with the routers' size classes (small < 256 ≤
    medium < 2048 ≤ large), restated here so this test does not depend on a policy module."""
    n = result_tokens or 0
    size = "small" if n < 256 else "medium" if n < 2048 else "large"
    return f"{name}:{size}:{_STATUS_WORD[status]}"


def _many(name: str, steps: int = 3, **kw: object) -> list[RolloutTrajectory]:
    w = make_workload(name, n_prompts=64, **kw)
    return [t for k in range(steps) for t in w.batch(k)]


def _remaining_after(batch: list[RolloutTrajectory]) -> dict[str, list[int]]:
    """Output tokens still to come after each tool return, by the return's causal key."""
    out: dict[str, list[int]] = {}
    for tr in batch:
        turns = tr.workflow.turns
        for j in range(len(turns) - 1):
            c = turns[j].tools[0]
            rest = sum(t.output_tokens for t in turns[j + 1:])
            out.setdefault(tool_key(c.name, c.result_tokens, c.status), []).append(rest)
    return out


@pytest.mark.parametrize("name", LIBRA)
def test_batches_are_seeded_valid_and_shaped(name: str) -> None:
    a = make_workload(name, n_prompts=6, group_size=3, seed=5).batch(2)
    b = make_workload(name, n_prompts=6, group_size=3, seed=5).batch(2)
    assert [t.workflow for t in a] == [t.workflow for t in b]
    assert len(a) == 18 and len({t.id for t in a}) == 18 and len({t.prompt_id for t in a}) == 6
    for tr in a:
        assert not validate_workflow(tr.workflow)
        assert tr.workflow.meta["prompt"] == tr.prompt_id[1:]
        assert float(tr.workflow.meta["hint"]) == pytest.approx(tr.hint, rel=1e-5)
        assert tr.workflow.turns[0].prompt_tokens == tr.prompt_tokens
        assert tr.workflow.turns[-1].tools == ()
        for j in range(1, tr.num_turns):  # a growing transcript: prompt = last prompt + output
            prev, cur = tr.workflow.turns[j - 1], tr.workflow.turns[j]
            assert cur.context_tokens == prev.prompt_tokens + prev.output_tokens
            assert cur.input_tokens == sum(c.result_tokens or 0 for c in prev.tools)
    by_prompt: dict[str, set[tuple[int, float]]] = {}
    for tr in a:
        by_prompt.setdefault(tr.prompt_id, set()).add((tr.prompt_tokens, tr.hint))
    assert all(len(v) == 1 for v in by_prompt.values())
    other = make_workload(name, n_prompts=6, group_size=3, seed=6).batch(2)
    assert [t.workflow for t in other] != [t.workflow for t in a]
    forecast = make_workload(name, n_prompts=6, group_size=3, seed=5).forecast(2)
    assert len(forecast) == 18 and [t.workflow for t in forecast] != [t.workflow for t in a]


def test_r2e_gym_within_libra_caps_long_tailed_with_fast_tools() -> None:
    batch = _many("r2e-gym")
    s = R2EGymSpec()
    out = np.array([t.total_output_tokens for t in batch])
    assert max(t.num_turns for t in batch) <= s.max_turns == 12
    assert out.max() <= s.max_new_tokens == 30_000
    assert max(t.prompt_tokens for t in batch) <= 2_048
    for tr in batch:
        last = tr.workflow.turns[-1]
        assert last.prompt_tokens + last.output_tokens <= s.max_seq_length
    p50, p90 = np.percentile(out, [50, 90])
    assert p90 > 2.5 * p50 and out.max() >= 20_000  # a long tail of stragglers
    calls = [c for t in batch for turn in t.workflow.turns for c in turn.tools]
    assert np.median([c.duration_s for c in calls]) < 0.5  # local validator: tool time ≈ 0
    keys = {tool_key(c.name, c.result_tokens, c.status) for c in calls}
    sizes = {k.split(":")[1] for k in keys}
    statuses = {k.split(":")[2] for k in keys}
    assert sizes == {"small", "medium", "large"}
    assert statuses == {"success", "failure", "timeout"}


def test_search_r1_short_calls_with_a_30s_timeout_tail() -> None:
    batch = _many("search-r1")
    s = SearchR1Spec()
    assert max(t.num_turns for t in batch) <= s.max_turns
    for tr in batch:
        assert all(t.output_tokens <= 1_024 for t in tr.workflow.turns)
        last = tr.workflow.turns[-1]
        assert last.prompt_tokens + last.output_tokens <= 4_096
    calls = [c for t in batch for turn in t.workflow.turns for c in turn.tools]
    assert {c.name for c in calls} == {"search"}
    timeouts = [c for c in calls if c.status == "timeout"]
    assert all(c.duration_s == 30.0 for c in timeouts)
    assert 0.01 < len(timeouts) / len(calls) < 0.10
    assert np.median([c.duration_s for c in calls]) < 2.0
    assert np.median([t.total_output_tokens for t in batch]) < 1_000


def test_dapo_math_one_long_generation_no_tools() -> None:
    batch = _many("dapo-math")
    assert all(t.num_turns == 1 and t.workflow.turns[0].tools == () for t in batch)
    out = np.array([t.total_output_tokens for t in batch])
    assert out.max() <= DapoMathSpec().max_new_tokens == 32_768
    p50, p99 = np.percentile(out, [50, 99])
    assert 2_000 < p50 < 6_000 and p99 > 4 * p50


@pytest.mark.parametrize("name", LIBRA)
def test_harder_samples_generate_more(name: str) -> None:
    batch = _many(name)
    z = np.array([t.difficulty for t in batch])
    out = np.array([t.total_output_tokens for t in batch])
    rank = np.corrcoef(np.argsort(np.argsort(z)), np.argsort(np.argsort(out)))[0, 1]
    assert rank > 0.3


def test_r2e_remaining_length_follows_the_tool_returns() -> None:
    rem = _remaining_after(_many("r2e-gym"))
    passed = rem["execute_bash:small:success"]
    failed = rem.get("execute_bash:medium:failure", []) + rem.get("execute_bash:large:failure", [])
    assert len(passed) > 50 and len(failed) > 50
    assert np.mean(passed) < 0.5 * np.mean(failed)
    assert np.percentile(passed, 90) < 0.6 * np.percentile(failed, 90)
    # the key explains a real share of the variance of what remains
    allv = np.array([x for v in rem.values() for x in v], dtype=float)
    within = sum(((np.array(v) - np.mean(v)) ** 2).sum() for v in rem.values())
    assert 1 - within / ((allv - allv.mean()) ** 2).sum() > 0.05


def test_search_r1_weak_results_mean_more_searching() -> None:
    rem = _remaining_after(_many("search-r1"))
    good = rem["search:medium:success"]
    weak = [x for k, v in rem.items() if k != "search:medium:success" for x in v]
    assert np.mean(good) < 0.7 * np.mean(weak)


def test_generations_lengthen_across_steps() -> None:
    w = make_workload("dapo-math", n_prompts=64)
    early = np.mean([t.total_output_tokens for t in w.batch(0)])
    late = np.mean([t.total_output_tokens for t in w.batch(40)])
    assert late > 1.2 * early


def test_registry_by_name() -> None:
    assert workload_names() == list(WORKLOADS) == ["tool-heavy", *LIBRA]
    assert isinstance(make_workload("tool-heavy", n_prompts=2), RolloutWorkload)
    w = make_workload("r2e-gym", n_prompts=3, max_turns=4)
    assert isinstance(w, LibraWorkload) and w.spec.max_turns == 4 and w.spec.batch_size == 12
    assert max(t.num_turns for t in w.batch(0)) <= 4
    with pytest.raises(UnknownNameError, match="r2e-gym"):
        make_workload("swe-bench")
