"""Importers of users' own agent logs: mini-swe-agent / SWE-agent trajectories and OpenAI-style
request logs (fixtures written by ``tests/fixtures/traces/make_agent_log_fixtures.py``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from turnstile.cli import app
from turnstile.traces import (
    TraceFormatError,
    load_request_log,
    load_trace,
    load_trajectories,
)
from turnstile.traces.trajectory import DECODE_TOK_S, PREFILL_TOK_S
from turnstile.workload.jsonl import read_header, read_workload

FIX = Path(__file__).parents[1] / "fixtures" / "traces"
MINI = FIX / "mini_swe_agent"


def _mini(name: str) -> dict[str, Any]:
    p = MINI / name / f"{name}.traj.json"
    if p.exists():
        return json.loads(p.read_text())
    with gzip.open(str(p) + ".gz", "rt") as f:
        return json.load(f)


def test_mini_swe_agent_folder_one_workflow_per_file_one_turn_per_reply() -> None:
    loaded = load_trace(MINI)
    assert loaded.name.startswith("trajectories")
    one, two = loaded.workflows
    assert (one.id, two.id) == ("demo__proj-1", "demo__proj-2")
    assert one.arrival_s == 0.0 and two.arrival_s == pytest.approx(30.0, abs=1.0)
    data = _mini("demo__proj-1")
    replies = [m for m in data["messages"] if m["role"] == "assistant"]
    assert len(one.turns) == len(replies) == 4
    for turn, m in zip(one.turns, replies, strict=True):
        usage = m["extra"]["response"]["usage"]
        assert turn.prompt_tokens == usage["prompt_tokens"]
        assert turn.output_tokens == usage["completion_tokens"]
        assert turn.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]
    t0, t1, t2, t3 = one.turns
    # the agent appends: each prompt reuses the previous prompt and reply
    assert t1.context_tokens == t0.prompt_tokens + t0.output_tokens
    # the newer format stamps reply and observation: tool time is their difference
    assert [t.tools[0].duration_s for t in (t0, t1, t2)] == pytest.approx([0.4, 1.2, 6.0])
    assert [t.tools[0].status for t in (t0, t1, t2)] == ["ok", "ok", "error"]
    assert t0.tools[0].name == "bash" and t0.tools[0].result_tokens > 0
    assert t3.tools == ()
    assert one.meta["source"] == "mini-swe-agent-1" and one.meta["exit_status"] == "Submitted"
    # shared system prompt → shared leading prefix blocks across instances
    assert t0.block_hashes and two.turns[0].block_hashes
    assert t0.block_hashes[0] == two.turns[0].block_hashes[0]
    assert loaded.hash_block_tokens > 0 and loaded.hash_block_tokens % 16 == 0


def test_created_stamps_minus_the_llm_time_estimate_give_tool_time() -> None:
    (wf,) = load_trajectories(MINI / "demo__proj-2" / "demo__proj-2.traj.json.gz").workflows
    replies = [m for m in _mini("demo__proj-2")["messages"] if m["role"] == "assistant"]
    for k in range(2):
        created = [r["extra"]["response"]["created"] for r in replies[k:k + 2]]
        t = wf.turns[k]
        llm = ((t.prompt_tokens - (t.cached_tokens or 0)) / PREFILL_TOK_S
               + t.output_tokens / DECODE_TOK_S)
        assert t.tools[0].duration_s == pytest.approx(max(0.0, created[1] - created[0] - llm))


def test_swe_agent_steps_use_execution_time_and_scale_to_model_stats() -> None:
    loaded = load_trace(FIX / "swe_agent_tiny.traj")
    (wf,) = loaded.workflows
    assert [t.tools[0].duration_s for t in wf.turns] == [0.2, 0.4, 1.1]
    assert sum(t.prompt_tokens for t in wf.turns) == pytest.approx(900, abs=3)
    assert sum(t.output_tokens for t in wf.turns) == pytest.approx(60, abs=3)
    assert wf.turns[1].context_tokens > 0 and wf.meta["source"] == "swe-agent"


def test_litellm_log_without_session_field_groups_by_shared_prefixes() -> None:
    loaded = load_trace(FIX / "litellm_tiny.jsonl")
    assert loaded.counts["skipped"] == 1  # the failed call
    by_len = sorted(loaded.workflows, key=lambda w: len(w.turns))
    short, long = by_len
    assert [t.prompt_tokens for t in long.turns] == [400, 440, 470]
    assert [t.prompt_tokens for t in short.turns] == [402, 445]
    assert long.turns[1].context_tokens == 420 and long.turns[1].cached_tokens == 416
    recs = [json.loads(x) for x in (FIX / "litellm_tiny.jsonl").read_text().splitlines()]
    gap = recs[2]["startTime"] - recs[0]["endTime"]
    assert long.turns[0].tools[0].duration_s == pytest.approx(gap)
    assert short.arrival_s == pytest.approx(0.2)
    assert "shared message prefixes" in loaded.notes[0]


def _log(tmp_path: Path, recs: list[dict[str, Any]]) -> Path:
    p = tmp_path / "log.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def _pair(sid: str | None, start: str, latency_ms: float, prompt: int, text: str
          ) -> dict[str, Any]:
    req: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if sid is not None:
        req["user"] = sid
    return {"request": req, "timestamp": start, "latency_ms": latency_ms,
            "response": {"usage": {"prompt_tokens": prompt, "completion_tokens": 7}}}


def test_request_response_pairs_group_by_a_session_field(tmp_path: Path) -> None:
    p = _log(tmp_path, [
        _pair("alice", "2026-01-01T00:00:00Z", 500, 50, "a"),
        _pair("bob", "2026-01-01T00:00:01Z", 500, 60, "b"),
        _pair("alice", "2026-01-01T00:00:05Z", 500, 80, "c"),
    ])
    loaded = load_request_log(p)
    ids = {w.id: w for w in loaded.workflows}
    assert set(ids) == {"alice", "bob"}
    assert [t.prompt_tokens for t in ids["alice"].turns] == [50, 80]
    assert ids["alice"].turns[0].tools[0].duration_s == pytest.approx(4.5)
    assert ids["bob"].arrival_s == pytest.approx(1.0)
    # an explicit choice overrides auto; 'prefix' ignores the field (unrelated texts: 3 sessions)
    assert len(load_request_log(p, group_by="prefix").workflows) == 3


@pytest.mark.parametrize(("name", "content", "expect"), [
    ("bad.traj.json", {"messages": [{"role": "assistant", "content": "x", "extra": {
        "response": {"usage": {"prompt_tokens": "12"}}}}]},
     "$.messages[0].extra.response.usage.prompt_tokens: expected an integer or a number, "
     "got string"),
    ("norole.traj.json", {"messages": [{"content": "x"}]}, "$.messages[0].role: missing"),
    ("noreply.traj.json", {"messages": [{"role": "user", "content": "x"}]},
     "$.messages: no assistant message"),
    ("steps.traj", {"trajectory": {"not": "a list"}},
     "$.trajectory: expected an array, got object"),
    ("other.traj.json", {"hello": 1}, "neither 'messages'"),
])
def test_malformed_trajectories_name_file_path_and_field(tmp_path: Path, name: str,
                                                         content: Any, expect: str) -> None:
    p = tmp_path / name
    p.write_text(json.dumps(content))
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert str(p) in str(e.value) and expect in str(e.value)


def test_truncated_json_names_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "cut.traj.json"
    p.write_text('{"messages": [\n {"role": "assistant",')
    with pytest.raises(TraceFormatError, match=r"cut\.traj\.json: line 2 column \d+: not valid"):
        load_trace(p)


@pytest.mark.parametrize(("lines", "expect"), [
    ([{"startTime": 1.0, "prompt_tokens": 5, "response": {}}, "{not json"],
     "line 2: not valid JSON"),
    ([{"startTime": 1.0, "prompt_tokens": -3, "response": {}}],
     "line 1 $.prompt_tokens: expected a non-negative integer, got -3"),
    ([{"startTime": 1.0, "prompt_tokens": 5, "response": {}},
      {"startTime": "yesterday", "prompt_tokens": 5, "response": {}}],
     "line 2 $.startTime: not a time: 'yesterday'"),
    ([{"startTime": 1.0, "prompt_tokens": 5, "response": {}},
      {"prompt_tokens": 5, "response": {}}],
     "line 2 $: no start time"),
    ([{"request": {"messages": []}, "timestamp": 5.0, "end_time": 4.0}],
     "line 1 $: ends (4.0) before it starts (5.0)"),
])
def test_malformed_request_logs_name_file_line_and_field(tmp_path: Path, lines: list[Any],
                                                         expect: str) -> None:
    p = tmp_path / "log.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert str(e.value) == f"{p}: {expect}" or expect in str(e.value)
    assert str(p) in str(e.value)


def test_cli_convert_exits_2_on_malformed_input_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.traj.json"
    bad.write_text(json.dumps({"messages": [{"role": "assistant", "extra": {"response": {
        "usage": {"completion_tokens": 1.5}}}}]}))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(app, ["traces", "convert", str(bad), "-o", str(out)])
    assert r.exit_code == 2
    assert "usage.completion_tokens" in r.output and "bad.traj.json" in r.output
    assert not out.exists() and not list(tmp_path.glob(".out.jsonl*"))
    r = CliRunner().invoke(app, ["traces", "info", str(bad)])
    assert r.exit_code == 2


@pytest.mark.parametrize("src", [MINI, FIX / "swe_agent_tiny.traj", FIX / "litellm_tiny.jsonl"])
def test_convert_round_trips_and_bench_runs_on_the_result(tmp_path: Path, src: Path) -> None:
    out = tmp_path / "w.jsonl"
    r = CliRunner().invoke(app, ["traces", "convert", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    loaded = load_trace(src)
    assert read_workload(out) == loaded.workflows
    assert read_header(out)["meta"]["hash_block_tokens"] == loaded.hash_block_tokens
    r = CliRunner().invoke(app, ["bench", "--trace", str(out), "--policies", "eager,cvar",
                                 "--workflows", "10", "--engines", "1"])
    assert r.exit_code == 0, r.output


def test_litellm_spend_log_rows_with_iso_times_and_a_session_column(tmp_path: Path) -> None:
    def row(i: int, sid: str, start: str, end: str, msgs: list[dict[str, str]]) -> dict[str, Any]:
        return {"request_id": f"r{i}", "call_type": "acompletion", "session_id": sid,
                "startTime": start, "endTime": end, "prompt_tokens": 100 + 10 * i,
                "completion_tokens": 9, "model": "m", "user": "", "messages": [],
                "proxy_server_request": {"model": "m", "messages": msgs},
                "response": {"usage": {"prompt_tokens": 100 + 10 * i, "completion_tokens": 9,
                                       "prompt_tokens_details": {"cached_tokens": 64}}}}
    m1 = [{"role": "user", "content": "hello"}]
    m2 = [*m1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    p = _log(tmp_path, [
        row(0, "s-1", "2026-02-01T10:00:00.000Z", "2026-02-01T10:00:01.500Z", m1),
        row(1, "s-2", "2026-02-01T10:00:02+00:00", "2026-02-01T10:00:03+00:00", m1),
        row(2, "s-1", "2026-02-01T10:00:04.000Z", "2026-02-01T10:00:05.000Z", m2),
    ])
    loaded = load_trace(p)
    wfs = {w.id: w for w in loaded.workflows}
    assert set(wfs) == {"s-1", "s-2"} and "'session_id'" in loaded.notes[0]
    s1 = wfs["s-1"]
    assert [t.prompt_tokens for t in s1.turns] == [100, 120]
    assert s1.turns[0].tools[0].duration_s == pytest.approx(2.5)
    assert s1.turns[1].context_tokens == 109 and s1.turns[1].cached_tokens == 64
    assert wfs["s-2"].arrival_s == pytest.approx(2.0)


def test_mini_swe_agent_tool_call_messages_and_missing_usage(tmp_path: Path) -> None:
    """The tool-calling variant: replies carry ``tool_calls``, results come back as ``tool``
    messages; a reply without saved usage falls back to characters ÷ 4 (and says so)."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}
    data = {"trajectory_format": "mini-swe-agent-1", "info": {}, "messages": [
        {"role": "system", "content": "s" * 400}, {"role": "user", "content": "task"},
        {"role": "assistant", "content": None, "tool_calls": [call], "extra": {
            "response": {"created": 100, "usage": {"prompt_tokens": 120,
                                                   "completion_tokens": 15}}}},
        {"role": "tool", "tool_call_id": "c1", "content": "<returncode>2</returncode>",
         "extra": {"returncode": 2}},
        {"role": "assistant", "content": "done", "extra": {"response": {"created": 104}}},
    ]}
    p = tmp_path / "x.traj.json"
    p.write_text(json.dumps(data))
    loaded = load_trace(p)
    t0, t1 = loaded.workflows[0].turns
    assert (t0.prompt_tokens, t0.output_tokens) == (120, 15)
    assert t0.tools[0].status == "error"
    llm = 120 / PREFILL_TOK_S + 15 / DECODE_TOK_S
    assert t0.tools[0].duration_s == pytest.approx(4 - llm)
    assert t1.prompt_tokens > 100 and loaded.counts["prompt_estimated"] == 1
    assert any("without usage.prompt_tokens" in n for n in loaded.notes)


@pytest.mark.parametrize("first", [
    {"session_id": "s", "round_index": 0},  # TraceLab
    {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]},  # Mooncake
])
def test_a_broken_line_in_the_older_loaders_names_file_and_line(tmp_path: Path,
                                                               first: dict[str, Any]) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(first) + "\n" + '{"session_id": "s", "round_index": 1,\n')
    r = CliRunner().invoke(app, ["traces", "info", str(p)])
    assert r.exit_code == 2
    assert "t.jsonl: line 2: not valid JSON" in " ".join(r.output.split())
