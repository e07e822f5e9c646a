"""The command line, end to end through typer's runner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from turnstile.cli import app
from turnstile.workload import read_workload

runner = CliRunner()


@pytest.mark.traces
def test_traces_info_json_counts_match_source_md(traces_dir):
    path = traces_dir / "agentcgroup_swerebench_claude_code"
    res = runner.invoke(app, ["traces", "info", str(path), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["workflows"] == 166 and d["turns"] == 6705
    assert d["counts"]["glm47flash_local.llm_calls"] == 5641
    assert d["counts"]["haiku.llm_calls"] == 1064
    for key in ("prompt_tokens", "output_tokens", "tool_latency_s"):
        assert {"p50", "p90", "p99"} <= set(d[key])
    assert d["tool_latency_s"]["p99"] > d["tool_latency_s"]["p50"] > 0


def test_traces_convert_and_info_on_a_fixture(tmp_path, fixtures_dir):
    out = tmp_path / "w.jsonl"
    res = runner.invoke(app, ["traces", "convert", str(fixtures_dir / "mooncake_tiny.jsonl"),
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    wfs = read_workload(out)
    assert wfs and all(w.turns for w in wfs)
    res = runner.invoke(app, ["traces", "info", str(out), "--json"])
    assert res.exit_code == 0
    assert json.loads(res.output)["workflows"] == len(wfs)


def test_traces_synth_is_reproducible(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        res = runner.invoke(app, ["traces", "synth", "-o", str(p), "-n", "20", "--seed", "3"])
        assert res.exit_code == 0, res.output
    assert read_workload(a) == read_workload(b)


def test_unknown_path_and_bad_policy_fail_cleanly(tmp_path):
    res = runner.invoke(app, ["traces", "info", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = runner.invoke(app, ["bench", "--policies", "eager,nonsense"])
    assert res.exit_code == 2 and "valid names" in res.output
