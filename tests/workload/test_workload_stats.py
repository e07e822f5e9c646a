"""summarize(): exact values on a hand-made workload, empty input, and speed on 10^5 turns."""

from __future__ import annotations

import time

import numpy as np
import pytest

from turnstile.workload import ToolCall, Turn, Workflow
from turnstile.workload.stats import DIST_KEYS, describe, summarize


def _wfs() -> list[Workflow]:
    return [
        Workflow("a", 10.0, (
            Turn(100, 10, tools=(ToolCall("Bash", 2.0, "ok"), ToolCall("Read", 0.5, "error"))),
            Turn(20, 5, context_tokens=110, tools=(ToolCall("Bash", 4.0, "timeout"),)),
            Turn(30, 7, context_tokens=135),
        )),
        Workflow("b", 25.0, (Turn(50, 1),)),
    ]


def test_summary_values() -> None:
    s = summarize(_wfs())
    assert (s["workflows"], s["turns"], s["tool_calls"]) == (2, 4, 3)
    assert s["turns_per_workflow"]["max"] == 3.0 and s["turns_per_workflow"]["mean"] == 2.0
    assert s["input_tokens"]["mean"] == pytest.approx((100 + 20 + 30 + 50) / 4)
    assert s["context_tokens"]["max"] == 135.0
    assert s["prompt_tokens"]["max"] == 165.0
    assert s["prompt_tokens"]["p50"] == pytest.approx(np.percentile([100, 130, 165, 50], 50))
    assert s["output_tokens"]["p50"] == pytest.approx(6.0)
    assert s["tool_latency_s"]["max"] == 4.0 and s["tool_latency_s"]["p50"] == 2.0
    assert s["tools_by_name"] == {"Bash": 2, "Read": 1}
    assert list(s["tools_by_name"]) == ["Bash", "Read"]  # most used first
    assert s["tool_status"] == {"ok": 1, "error": 1, "timeout": 1}
    assert s["arrival_span_s"] == 15.0
    for key in DIST_KEYS:
        assert set(s[key]) == {"p50", "p90", "p95", "p99", "mean", "max"}
        d = s[key]
        assert d["p50"] <= d["p90"] <= d["p95"] <= d["p99"] <= d["max"]


def test_top_tools_limit_and_empty() -> None:
    many = [Workflow(f"w{i}", 0.0, (Turn(1, 1, tools=tuple(
        ToolCall(f"t{j}", 0.1) for j in range(i + 1))),)) for i in range(12)]
    s = summarize(many)
    assert len(s["tools_by_name"]) == 10
    assert s["tools_by_name"]["t0"] == 12
    e = summarize([])
    assert (e["workflows"], e["turns"], e["tool_calls"], e["arrival_span_s"]) == (0, 0, 0, 0.0)
    assert e["tool_latency_s"] == describe([])
    assert describe([]) == {"p50": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0,
                            "max": 0.0}


def test_fast_on_1e5_turns() -> None:
    tools = (ToolCall("Bash", 1.0, "ok"),)
    turn = Turn(100, 10, context_tokens=1000, tools=tools)
    wfs = [Workflow(f"w{i}", float(i), (turn,) * 50) for i in range(2000)]  # 100k turns
    t0 = time.perf_counter()
    s = summarize(wfs)
    took = time.perf_counter() - t0
    assert s["turns"] == 100_000 and s["tool_calls"] == 100_000
    assert took < 1.0, f"summarize took {took:.2f} s on 1e5 turns"
