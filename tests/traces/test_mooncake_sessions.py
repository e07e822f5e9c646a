"""Mooncake-JSONL sessions (AIPerf's and Dynamo's agent trace format): written from workloads
and from a ``serve --record`` recording, read back, round-tripped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from turnstile.cli import app
from turnstile.gateway.recorder import SessionRecorder
from turnstile.traces import load_trace
from turnstile.traces.base import TraceFormatError
from turnstile.traces.mooncake_sessions import (
    load_mooncake_sessions,
    mooncake_records,
    write_mooncake_sessions,
)
from turnstile.workload.model import ToolCall, Turn, Workflow, validate_workflow
from turnstile.workload.synth import default_spec, generate


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_chain_workloads_round_trip(tmp_path: Path) -> None:
    wfs = generate(default_spec(), 25, seed=3, arrivals=0.5)
    path = tmp_path / "agents.jsonl"
    n = write_mooncake_sessions(path, wfs)
    assert n == sum(len(w.turns) for w in wfs)
    recs = _records(path)
    # the fields AIPerf reads: a timestamp on each session's first call, delays after
    firsts = {r["session_id"]: r for r in reversed(recs)}
    assert all("timestamp" in r and "delay" not in r for r in firsts.values())
    assert all(("delay" in r) != (r is firsts[r["session_id"]]) for r in recs)
    assert all({"input_length", "output_length", "session_id"} <= set(r) for r in recs)
    loaded = load_trace(path)  # detected by its fields
    assert loaded.name.startswith("mooncake-sessions")
    back = {w.id: w for w in loaded.workflows}
    assert set(back) == {w.id for w in wfs}
    for w in wfs:
        b = back[w.id]
        assert validate_workflow(b) == []
        assert b.arrival_s == pytest.approx(w.arrival_s, abs=1e-3)
        assert [t.input_tokens for t in b.turns[1:]] == [t.input_tokens for t in w.turns[1:]]
        assert b.turns[0].prompt_tokens == w.turns[0].prompt_tokens
        assert [t.output_tokens for t in b.turns] == [t.output_tokens for t in w.turns]
        # a later call's context is the history AIPerf sends: exact until the original
        # transcript was compacted (the format cannot say that)
        for i in range(1, len(w.turns)):
            prev = w.turns[i - 1]
            if w.turns[i].context_tokens != prev.prompt_tokens + prev.output_tokens:
                break
            assert b.turns[i].context_tokens == w.turns[i].context_tokens
        for x, y in zip(w.turns[:-1], b.turns[:-1], strict=True):
            nxt_think = 0.0  # synth turns have no think time
            assert y.tool_duration_s == pytest.approx(x.tool_duration_s + nxt_think, abs=1e-3)
    # and the file itself is a fixed point of read → write
    again = tmp_path / "again.jsonl"
    write_mooncake_sessions(again, loaded.workflows)
    assert _records(again) == recs


def _dag() -> Workflow:
    """A main agent (turns 0, 2, 4) that spawns a sub-agent (turns 1, 3) after turn 0 and waits
    for it at turn 4; each call extends its thread's previous transcript (prompt + output)."""
    def t(prompt: int, ctx: int, hashes: tuple[int, ...], tool_s: float = 0.0,
          parents: tuple[int, ...] | None = None) -> Turn:
        tools = (ToolCall("gap", tool_s, "unknown"),) if tool_s else ()
        return Turn(prompt - ctx, 10, ctx, hashes, tools, parents)

    return Workflow("main", 12.5, (
        t(1500, 0, (901, 902), 0.25, ()),
        t(600, 0, (905,), 1.5, (0,)),
        t(1800, 1510, (901, 902, 903), 0.75, (0,)),
        t(900, 610, (905, 906), 0.0, (1,)),
        t(2100, 1810, (901, 902, 903, 904), 0.0, (2, 3)),
    ))


def test_a_dag_becomes_sessions_with_parents_and_comes_back(tmp_path: Path) -> None:
    wf = _dag()
    recs = mooncake_records([wf])
    by = {}
    for r in recs:
        by.setdefault(r["session_id"], []).append(r)
    assert set(by) == {"main", "main.1"}
    # the first call whole, the later ones their new input (AIPerf adds it to the history)
    assert [r["input_length"] for r in by["main"]] == [1500, 290, 290]
    assert [r["input_length"] for r in by["main.1"]] == [600, 290]
    sub0 = by["main.1"][0]
    assert sub0["parent_session_id"] == "main" and sub0["parent_turn"] == 0
    assert sub0["delay"] == 250.0  # after the parent call it forks from
    assert by["main"][2]["wait_for"] == ["main.1"]
    # the blocks each call adds, renumbered densely
    assert [r["hash_ids"] for r in by["main"]] == [[0, 1], [2], [3]]
    assert [r["hash_ids"] for r in by["main.1"]] == [[4], [5]]
    path = tmp_path / "dag.jsonl"
    write_mooncake_sessions(path, [wf])
    (back,) = load_mooncake_sessions(path).workflows
    assert validate_workflow(back) == []
    assert back.id == "main" and back.meta["subagents"] == "1"
    # the same DAG (turn order among independent branches may differ): each call, the calls it
    # waits for, its context and its tool time
    def shape(w: Workflow) -> set[tuple[int, tuple[int, ...], int, float]]:
        return {(t.prompt_tokens, tuple(sorted(w.turns[p].prompt_tokens
                                               for p in w.parents_of(i))),
                 t.context_tokens, round(t.tool_duration_s, 3))
                for i, t in enumerate(w.turns)}

    assert shape(back) == shape(wf)
    # tool times: the parent's before its fork, the sub-agent's between its calls (a sub-agent's
    # time after its last call has no field in the format)
    tools = {x[0]: x[3] for x in shape(back)}
    assert tools[1500] == 0.25 and tools[600] == 1.5 and tools[1800] == 0.75
    assert mooncake_records([back]) == recs


def test_a_serve_recording_exports_to_mooncake(tmp_path: Path) -> None:
    rec_path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(rec_path)

    def body(*texts: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": x} for x in texts]}

    def usage(p: int, o: int) -> dict[str, Any]:
        return {"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}

    system = "You are a careful coding agent. " * 60
    rec.turn_finished("main", "t", body(system, "task"), 0.0, 1.0, usage(500, 10), None)
    rec.note_parent("sub", "main")
    rec.turn_finished("sub", "t", body("explore the repository " * 30), 1.2, 2.0,
                      usage(180, 5), None)
    rec.session_closed("sub")
    second = body(system, "task", "tool output " * 100)
    second["messages"].insert(2, {"role": "assistant", "content": "run the tool"})  # re-sent
    rec.turn_finished("main", "t", second, 2.5, 3.0, usage(800, 10), None)
    rec.turn_finished("solo", "t", body("another agent"), 5.0, 5.5, usage(40, 4), None)
    rec.close()
    out = tmp_path / "agents.mooncake.jsonl"
    r = CliRunner().invoke(app, ["traces", "convert", str(rec_path), "-o", str(out),
                                 "--to", "mooncake"])
    assert r.exit_code == 0, r.output
    recs = _records(out)
    sessions = [x["session_id"] for x in recs]
    assert sessions.count("main") == 2 and sessions.count("solo") == 1
    (sub,) = [x for x in recs if x.get("parent_session_id") == "main"]
    assert sub["input_length"] == 180 and sub["output_length"] == 5
    assert sub["delay"] == pytest.approx(200.0)  # the sub-agent started 0.2 s after main's call
    (join,) = [x for x in recs if x.get("wait_for")]
    assert join["session_id"] == "main" and join["input_length"] == 800 - 510  # new input only
    # the main session's second call extends its first: it adds blocks the first did not have
    m0, m1 = [x for x in recs if x["session_id"] == "main"]
    assert m1["hash_ids"] and not set(m1["hash_ids"]) & set(m0["hash_ids"])
    solo = next(x for x in recs if x["session_id"] == "solo")
    assert solo["timestamp"] == pytest.approx(5000.0)
    # back to a workload: the same calls, the same DAG
    back = {w.id: w for w in load_trace(out).workflows}
    assert [t.prompt_tokens for t in back["main"].turns] == [500, 180, 800]
    assert back["main"].parents_of(2) == (0, 1)


def test_bad_records_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"session_id": "a", "timestamp": 0, "input_length": 5, "output_length": 1}\n'
                    '{"session_id": "b", "input_length": 5, "output_length": 1, '
                    '"parent_session_id": "zz"}\n')
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2"):
        load_mooncake_sessions(path)
    path.write_text('{"session_id": "a", "input_length": 5, "output_length": 1}\n')
    with pytest.raises(TraceFormatError, match="timestamp"):
        load_mooncake_sessions(path)
