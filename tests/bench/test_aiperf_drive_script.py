"""benchmarks/aiperf_drive.py's conversion of turnstile's Mooncake export to AIPerf's semantics."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from turnstile.traces.mooncake_sessions import mooncake_records
from turnstile.workload.model import ToolCall, Turn, Workflow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "aiperf_drive.py"
_spec = importlib.util.spec_from_file_location("aiperf_drive_bench", BENCH)
assert _spec is not None and _spec.loader is not None
drive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(drive)


def _session(wid: str, arrival: float) -> Workflow:
    turns = (Turn(input_tokens=300, output_tokens=10, context_tokens=0,
                  tools=(ToolCall("t", 0.25),)),
             Turn(input_tokens=40, output_tokens=12, context_tokens=310,
                  tools=(ToolCall("t", 0.5),)),
             Turn(input_tokens=25, output_tokens=8, context_tokens=362))
    return Workflow(wid, arrival, turns)


def test_rows_carry_new_tokens_per_turn_as_aiperf_reads_them() -> None:
    wfs = [_session("a", 0.0), _session("b", 1.5)]
    recs = mooncake_records(wfs)
    # turnstile's writer already uses AIPerf's semantics: the new tokens per later call
    assert [r["input_length"] for r in recs if r["session_id"] == "a"] == [300, 40, 25]
    rows = drive.to_aiperf_rows(recs)
    a = [r for r in rows if r["session_id"] == "a"]
    assert [r["input_length"] for r in a] == [300, 40, 25]
    assert [r["output_length"] for r in a] == [10, 12, 8]
    assert a[0]["timestamp"] == 0.0 and "delay" not in a[0]
    assert [r.get("delay") for r in a[1:]] == [250.0, 500.0]
    assert all("hash_ids" not in r for r in rows)
    # AIPerf accumulates history: first prompt + every earlier reply + new tokens = the prompt
    cum, prev_out = 0, 0
    for r, whole in zip(a, [300, 350, 387], strict=True):
        cum += prev_out + r["input_length"]
        prev_out = r["output_length"]
        assert cum == whole
    assert next(r for r in rows if r["session_id"] == "b")["timestamp"] == 1500.0


def test_a_turn_adding_nothing_still_sends_one_token() -> None:
    recs = [{"session_id": "s", "timestamp": 0, "input_length": 100, "output_length": 5},
            {"session_id": "s", "delay": 10, "input_length": 0, "output_length": 5}]
    assert [r["input_length"] for r in drive.to_aiperf_rows(recs)] == [100, 1]
