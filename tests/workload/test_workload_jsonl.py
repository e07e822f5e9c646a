"""Workload files: round trip, and schema errors that name the line and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnstile.traces import load_agentcgroup, load_mooncake
from turnstile.workload import (
    ToolCall,
    Turn,
    Workflow,
    WorkloadFormatError,
    read_workload,
    write_workload,
)
from turnstile.workload.jsonl import read_header


def _sample() -> list[Workflow]:
    return [
        Workflow(
            id="s1",
            arrival_s=1.5,
            tenant="t1",
            meta={"source": "test"},
            turns=(
                Turn(900, 120, tools=(ToolCall("Bash", 1.25, "ok", 40), ToolCall("Read", 0.03))),
                Turn(50, 30, context_tokens=1020, block_hashes=(1, 2, 3), think_s=2.5),
            ),
        ),
        Workflow(
            id="dag",
            arrival_s=0.0,
            turns=(Turn(10, 1), Turn(5, 2, parents=(0,)), Turn(5, 3, parents=(0,)),
                   Turn(1, 1, context_tokens=20, parents=(1, 2))),
        ),
    ]


def test_round_trip_exact(tmp_path: Path) -> None:
    p = tmp_path / "w.jsonl"
    wfs = _sample()
    assert write_workload(p, wfs, meta={"note": "x"}) == 2
    back = read_workload(p)
    assert back == wfs
    assert [w.meta for w in back] == [w.meta for w in wfs]  # meta is not part of ==
    assert back[1].parents_of(3) == (1, 2) and not back[1].is_chain
    assert read_header(p)["meta"] == {"note": "x"}


def _write_lines(p: Path, lines: list[dict[str, object]]) -> None:
    header = {"format": "turnstile-workload", "version": 1, "meta": {}}
    p.write_text("\n".join(json.dumps(x) for x in [header, *lines]) + "\n")


def _ok(i: int) -> dict[str, object]:
    return {"id": f"w{i}", "arrival_s": 0.0, "turns": [{"input_tokens": 5, "output_tokens": 2}]}


@pytest.mark.parametrize(
    ("bad_turn", "field"),
    [
        ({"input_tokens": 5, "output_tokens": -1}, "output_tokens"),
        ({"input_tokens": 5}, "output_tokens"),
        ({"input_tokens": "5", "output_tokens": 2}, "input_tokens"),
        ({"input_tokens": 5, "output_tokens": 2, "tools": [{"name": "x", "duration_s": -1}]},
         "duration_s"),
        ({"input_tokens": 5, "output_tokens": 2, "tools": [{"name": "x", "duration_s": 1,
                                                            "status": "weird"}]}, "status"),
        ({"input_tokens": 5, "output_tokens": 2, "block_hashes": [1, "a"]}, "block_hashes"),
    ],
)
def test_bad_line_named(tmp_path: Path, bad_turn: dict[str, object], field: str) -> None:
    p = tmp_path / "bad.jsonl"
    bad = {"id": "w2", "arrival_s": 0.0, "turns": [bad_turn]}
    _write_lines(p, [_ok(1), bad, _ok(3)])  # the bad workflow is on line 3
    with pytest.raises(WorkloadFormatError) as e:
        read_workload(p)
    msg = str(e.value)
    assert ":3:" in msg and field in msg
    assert e.value.line == 3


def test_bad_header_and_duplicate_ids(tmp_path: Path) -> None:
    p = tmp_path / "h.jsonl"
    p.write_text('{"format": "other"}\n')
    with pytest.raises(WorkloadFormatError, match=":1:"):
        read_workload(p)
    _write_lines(p, [_ok(1), _ok(1)])
    with pytest.raises(WorkloadFormatError, match=r":3: field 'id'"):
        read_workload(p)


def test_round_trip_loaded_fixture_traces(fixtures_dir: Path, tmp_path: Path) -> None:
    for lt in (load_agentcgroup(fixtures_dir / "agentcgroup"),
               load_mooncake(fixtures_dir / "mooncake_tiny.jsonl")):
        p = tmp_path / f"{lt.name.replace(':', '_')}.jsonl"
        write_workload(p, lt.workflows)
        assert read_workload(p) == lt.workflows


@pytest.mark.traces
def test_round_trip_real_agentcgroup(traces_dir: Path, tmp_path: Path) -> None:
    lt = load_agentcgroup(traces_dir / "agentcgroup_swerebench_claude_code")
    p = tmp_path / "agentcgroup.jsonl"
    write_workload(p, lt.workflows)
    back = read_workload(p)
    # durations are written with 6 decimals; the loader already rounds to µs, so == holds
    assert back == lt.workflows
    assert sum(len(w.turns) for w in back) == 1064 + 5641
