"""AgentCgroup loader: the hand-made fixture (exact values) and the real trace (SOURCE.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from turnstile.traces import LoadedTrace, load_agentcgroup
from turnstile.traces.agentcgroup import discover
from turnstile.workload.model import validate_workflow

AGENT = "agentcgroup_swerebench_claude_code"


def _tool_input_chars(*inputs: object) -> int:
    return sum(len(json.dumps(x)) for x in inputs)


# ------------------------------------------------------------------------- hand-made fixture


@pytest.fixture(scope="module")
def tiny(fixtures_dir: Path) -> LoadedTrace:
    return load_agentcgroup(fixtures_dir / "agentcgroup")


def test_fixture_counts_and_skips(tiny: LoadedTrace) -> None:
    assert tiny.counts["sessions"] == 2
    assert tiny.counts["llm_calls"] == 6
    assert tiny.counts["haiku.llm_calls"] == 4
    assert tiny.counts["glm47flash_local.llm_calls"] == 2
    assert tiny.counts["skipped"] == 1
    assert tiny.counts["synthetic"] == 1
    assert any("demo__cli-3/attempt_1 has no trace.jsonl; skipped" in n for n in tiny.notes)
    assert any("<synthetic>" in n for n in tiny.notes)
    assert [w.id for w in tiny.workflows] == [
        "glm47flash_local/demo__cli-2/attempt_1",
        "haiku/demo__parser-1/attempt_1",
    ]


def test_fixture_cloud_tokens_placeholders_and_subagent_dag(tiny: LoadedTrace) -> None:
    wf = next(w for w in tiny.workflows if w.meta["subset"] == "haiku")
    assert wf.meta["model"] == "claude-3-5-haiku-20241022"
    assert wf.meta["subagent_model"] == "claude-sonnet-4-5-20250929"
    assert wf.meta["task"] == "demo__parser-1" and wf.meta["attempt"] == "attempt_1"
    a, s1, s2, b = wf.turns
    # call A: prompt = 3 + 1000 + 5000; output 2 is a placeholder → chars ÷ 4
    chars_a = len("I will run the tests first, then look.") + _tool_input_chars(
        {"command": "pytest -x"},
        {"description": "find bug", "prompt": "Find where the parser drops the last token."},
    )
    assert (a.context_tokens, a.input_tokens, a.output_tokens) == (0, 6003, chars_a // 4)
    # the sub-agent is its own conversation: its first call starts from an empty context
    assert (s1.context_tokens, s1.input_tokens, s1.output_tokens) == (0, 803, 150)
    assert (s2.context_tokens, s2.input_tokens, s2.output_tokens) == (953, 150, 60)
    # B continues A's context and waits for both A and the sub-agent's last call
    assert b.context_tokens == 6003 + a.output_tokens
    assert b.prompt_tokens == 6503
    assert b.output_tokens == len("All tests pass now, the fix is complete.") // 4
    assert b.parents == (0, 2)
    assert s1.parents is None and s2.parents is None  # chained to the previous index
    assert wf.parents_of(1) == (0,)
    assert tiny.counts["placeholder_outputs"] == 2
    # tools: the Task is represented by the branch; Bash at 125 s is a timeout despite is_error
    assert [(t.name, t.duration_s, t.status, t.result_tokens) for t in a.tools] == [
        ("Bash", 125.0, "timeout", len("Command timed out after 2m 0.0s") // 4)
    ]
    assert [(t.name, t.duration_s, t.status, t.result_tokens) for t in s1.tools] == [
        ("Read", 0.4, "ok", 100)
    ]
    assert tiny.counts["task_as_subagent"] == 1
    assert validate_workflow(wf) == []


def test_fixture_local_tokens_and_latency_fallback(tiny: LoadedTrace) -> None:
    wf = next(w for w in tiny.workflows if w.meta["subset"] == "glm47flash_local")
    c1, c2 = wf.turns
    assert (c1.context_tokens, c1.input_tokens, c1.output_tokens) == (0, 1000, 50)
    assert (c2.context_tokens, c2.input_tokens, c2.output_tokens) == (1050, 50, 20)
    # no tool_calls.json: result timestamp − tool_use block timestamp
    assert [(t.name, t.duration_s, t.status, t.result_tokens) for t in c1.tools] == [
        ("Grep", 2.49, "ok", len("cli.py:3:import argparse") // 4)
    ]
    assert tiny.counts["latency_from_trace"] == 1
    assert any("without tool_calls.json" in n for n in tiny.notes)
    # arrivals: relative to the earliest session (the local one, two days and 2 h earlier)
    assert wf.arrival_s == 0.0
    haiku = next(w for w in tiny.workflows if w.meta["subset"] == "haiku")
    assert haiku.arrival_s == pytest.approx(2 * 86400 + 2 * 3600)


def test_subset_selection_and_folder_levels(fixtures_dir: Path) -> None:
    root = fixtures_dir / "agentcgroup"
    only = load_agentcgroup(root, subset="haiku")
    assert [w.id for w in only.workflows] == ["haiku/demo__parser-1/attempt_1"]
    assert only.name == "agentcgroup:haiku"
    assert only.workflows[0].arrival_s == 0.0
    assert len(load_agentcgroup(root / "haiku").workflows) == 1
    assert len(discover(root / "haiku" / "demo__parser-1")) == 1
    attempt = root / "haiku" / "demo__parser-1" / "attempt_1"
    assert load_agentcgroup(attempt).workflows[0].id == "haiku/demo__parser-1/attempt_1"
    with pytest.raises(ValueError, match="no subset"):
        load_agentcgroup(root, subset="nope")
    with pytest.raises(ValueError, match="not an AgentCgroup folder"):
        load_agentcgroup(fixtures_dir)


def test_progress_bar_runs(fixtures_dir: Path) -> None:
    lt = load_agentcgroup(fixtures_dir / "agentcgroup", progress=True)
    assert lt.counts["llm_calls"] == 6


# ------------------------------------------------------------------------- the real trace


@pytest.fixture(scope="module")
def real(traces_dir: Path) -> tuple[LoadedTrace, float]:
    t0 = time.perf_counter()
    lt = load_agentcgroup(traces_dir / AGENT)
    return lt, time.perf_counter() - t0


@pytest.mark.traces
def test_real_counts_match_source_md(real: tuple[LoadedTrace, float]) -> None:
    lt, seconds = real
    c = lt.counts
    assert (c["haiku.llm_calls"], c["haiku.sessions"]) == (1064, 55)
    assert (c["glm47flash_local.llm_calls"], c["glm47flash_local.sessions"]) == (5641, 111)
    assert c["haiku.attempts"] == 58 and c["glm47flash_local.attempts"] == 126
    assert c["synthetic"] == 3
    # every tool call with an end timestamp is either a tool or a sub-agent branch
    assert c["haiku.tool_calls"] + c["haiku.task_as_subagent"] == 1151
    assert c["glm47flash_local.tool_calls"] + c["glm47flash_local.task_as_subagent"] == 6473
    assert len(lt.workflows) == 166
    assert sum(len(w.turns) for w in lt.workflows) == 1064 + 5641
    assert (
        "glm47flash_local: mwouts__jupytext-372/attempt_1 has no trace.jsonl; skipped" in lt.notes
    )
    assert any(n.startswith("haiku: output_tokens are streaming placeholders") for n in lt.notes)
    assert seconds < 20, f"loading AgentCgroup took {seconds:.1f} s"


@pytest.mark.traces
def test_real_workflows_are_valid_and_plausible(real: tuple[LoadedTrace, float]) -> None:
    lt, _ = real
    for wf in lt.workflows:
        assert validate_workflow(wf) == [], wf.id
        assert wf.meta["subset"] in ("haiku", "glm47flash_local")
    glm = [w for w in lt.workflows if w.meta["subset"] == "glm47flash_local"]
    assert max(len(w.turns) for w in glm) == 145  # SOURCE.md's 146 counts one <synthetic>
    prompts = sorted(t.prompt_tokens for w in glm for t in w.turns)
    assert prompts[-1] == 127_260
    assert 40_000 < prompts[len(prompts) // 2] < 44_000  # SOURCE.md: p50 42,136
    # the local runs' outputs are real and untouched
    outs = sorted(t.output_tokens for w in glm for t in w.turns)
    assert outs[len(outs) // 2] == 144 and outs[-1] == 8977
    assert min(w.arrival_s for w in lt.workflows) == 0.0
    # 14 haiku sessions and 1 local one use sub-agents: those are DAGs, the rest chains
    assert sum(not w.is_chain for w in lt.workflows) == 15


@pytest.mark.traces
def test_real_single_subset(traces_dir: Path) -> None:
    lt = load_agentcgroup(traces_dir / AGENT / "haiku")
    assert lt.counts["llm_calls"] == 1064 and len(lt.workflows) == 55
    assert all(w.id.startswith("haiku/") for w in lt.workflows)
