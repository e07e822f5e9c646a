"""Mooncake loader: the session-inference rule on a hand-made trace, and the real record counts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from turnstile.traces import load_mooncake
from turnstile.traces.mooncake import common_prefix_blocks, infer_sessions
from turnstile.workload.model import validate_workflow


def test_tiny_sessions_follow_the_rule(fixtures_dir: Path) -> None:
    lt = load_mooncake(fixtures_dir / "mooncake_tiny.jsonl")
    by_id = {w.id: w for w in lt.workflows}
    # line 3 reuses all complete blocks of line 1 (+ more) → same session; line 5 extends line 2
    assert sorted(by_id) == [f"mooncake_tiny-{i}" for i in (1, 2, 4, 6, 7)]
    a, b = by_id["mooncake_tiny-1"], by_id["mooncake_tiny-2"]
    assert [t.block_hashes for t in a.turns] == [(0, 1, 2), (0, 1, 2, 4)]
    assert (a.turns[1].context_tokens, a.turns[1].input_tokens) == (3 * 512, 1800 - 3 * 512)
    assert (b.turns[1].context_tokens, b.turns[1].input_tokens) == (2 * 512, 1600 - 2 * 512)
    # the inter-arrival time is recorded as an unknown "gap" tool on the earlier turn
    gap = a.turns[0].tools[0]
    assert (gap.name, gap.duration_s, gap.status) == ("gap", 5.0, "unknown")
    assert b.turns[0].tools[0].duration_s == 9.0
    assert a.turns[-1].tools == ()
    # line 4 only shares a prefix of line 3 (which already extended it): a fork, new session
    assert len(by_id["mooncake_tiny-4"].turns) == 1
    assert by_id["mooncake_tiny-4"].arrival_s == 6.0
    # line 7 shares just the common system block 0: new session
    assert len(by_id["mooncake_tiny-7"].turns) == 1
    assert lt.counts == {
        "requests": 7, "llm_calls": 7, "sessions": 5, "multi_turn_sessions": 2,
        "continuations": 2, "common_blocks": 1, "tool_calls": 2, "skipped": 0,
    }
    assert any("sessions inferred by shared prefixes" in n for n in lt.notes)
    assert any("gap" in n and "unknown" in n for n in lt.notes)


def test_common_prefix_and_unsorted_input(tmp_path: Path) -> None:
    # block 0 heads 4 of 5 requests that branch 3 ways: a system prompt
    assert common_prefix_blocks([[0, 1], [0, 2], [0, 3, 5], [0, 3], [4]]) == 1
    # [0, 3] heads only 2 of 5
    assert common_prefix_blocks([[0, 3], [0, 2], [0, 3, 5], [0, 1], [4]]) == 1
    # one conversation growing: shared by all, but never branching → not common
    assert common_prefix_blocks([[7, 8], [7, 8, 9], [7, 8, 9, 10]]) == 0
    assert common_prefix_blocks([[1], [2]]) == 0
    recs: list[dict[str, Any]] = [
        {"timestamp": 2000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1000, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    lt = load_mooncake(p)
    assert len(lt.workflows) == 1 and lt.workflows[0].arrival_s == 1.0
    assert [t.prompt_tokens for t in lt.workflows[0].turns] == [1000, 1100]
    assert any("not sorted" in n for n in lt.notes)
    session_of, shared, common = infer_sessions(sorted(recs, key=lambda r: r["timestamp"]))
    assert (session_of, shared, common) == ([0, 0], [0, 2], 0)


def test_missing_field_names_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": 1, "input_length": 5, "hash_ids": [2]}\n')
    with pytest.raises(ValueError, match=r":2: field 'output_length'"):
        load_mooncake(p)


@pytest.mark.traces
@pytest.mark.parametrize(
    ("name", "requests", "sessions", "multi"),
    [("conversation_trace", 12_031, 8_072, 2_041), ("synthetic_trace", 3_993, 2_628, 357)],
)
def test_real_counts(traces_dir: Path, name: str, requests: int, sessions: int,
                     multi: int) -> None:
    lt = load_mooncake(traces_dir / "mooncake_fast25" / f"{name}.jsonl")
    assert lt.counts["requests"] == requests
    assert sum(len(w.turns) for w in lt.workflows) == requests
    assert lt.counts["sessions"] == len(lt.workflows) == sessions
    assert lt.counts["multi_turn_sessions"] == multi
    arrivals = [w.arrival_s for w in lt.workflows]
    assert arrivals == sorted(arrivals)
    for wf in lt.workflows:
        assert validate_workflow(wf) == []
        for t in wf.turns:
            assert t.block_hashes is not None
            assert len(t.block_hashes) == math.ceil(t.prompt_tokens / 512)
        for prev, nxt in zip(wf.turns, wf.turns[1:], strict=False):
            # a continuation shares its context blocks with the previous turn
            k = nxt.context_tokens // 512
            assert prev.block_hashes is not None and nxt.block_hashes is not None
            assert nxt.block_hashes[:k] == prev.block_hashes[:k]
