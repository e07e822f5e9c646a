"""The SWE-bench-like mini-swe-agent logs the suite imports (``bench.agent_logs``)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np

from turnstile.bench.agent_logs import write_mini_swe_agent_logs
from turnstile.traces import load_trace


def test_generated_logs_import_as_growing_hashed_sessions_with_tool_times(tmp_path: Path) -> None:
    root = write_mini_swe_agent_logs(tmp_path / "a", 40, seed=3)
    again = write_mini_swe_agent_logs(tmp_path / "b", 40, seed=3)
    first = sorted(p.read_bytes() for p in root.rglob("*.traj.json"))
    assert first == sorted(p.read_bytes() for p in again.rglob("*.traj.json"))  # deterministic
    t = load_trace(root)
    assert len(t.workflows) == 40 and t.hash_block_tokens > 0
    turns = np.array([len(w.turns) for w in t.workflows])
    assert turns.min() >= 3 and turns.max() <= 145 and 20 <= np.median(turns) <= 55
    for w in t.workflows:
        prompts = [x.prompt_tokens for x in w.turns]
        assert prompts[0] >= 2_500 and all(b > a for a, b in pairwise(prompts))
        assert all(x.block_hashes for x in w.turns)
        # a turn carries the previous prompt and reply as context
        for a, b in pairwise(w.turns):
            assert b.context_tokens >= a.prompt_tokens
    tools = np.array([x.tool_duration_s for w in t.workflows for x in w.turns[:-1]])
    assert 2.0 < float(np.median(tools)) < 8.0  # from the reply / observation stamps
    # the system prompt's blocks are shared by every session; the task's are not
    heads = {w.turns[0].block_hashes[0] for w in t.workflows}
    tails = {w.turns[0].block_hashes[-1] for w in t.workflows}
    assert len(heads) == 1 and len(tails) == 40
