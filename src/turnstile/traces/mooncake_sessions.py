"""Mooncake-style JSON Lines *with sessions*: AIPerf's multi-turn trace format.

AIPerf (``aiperf synthesize agentic-code``, and its ``mooncake_trace`` dataset type) writes one
record per turn: ``{"session_id", "input_length", "output_length", "hash_ids"}`` plus
``"timestamp"`` (ms) on a session's first turn and ``"delay"`` (ms, the wait after the previous
turn's reply before this turn is sent) on later ones. Unlike the FAST'25 Mooncake trace
(:mod:`.mooncake`), sessions are explicit and a later turn's ``input_length`` and ``hash_ids``
cover only its *new* tokens: the client resends the conversation so far.

Mapping: turns of a session in file order; ``context_tokens`` = previous prompt + previous output,
``input_tokens`` = ``input_length``; the delay before turn ``k + 1`` is one ``ToolCall("delay",
delay / 1000, "unknown")`` after turn ``k`` (AIPerf models agent tool time and human think time
this way); arrival = the first turn's ``timestamp`` / 1000 (0 when absent). Prefix blocks
(``block_size`` = 512 tokens): a prompt of ``P`` tokens has ``ceil(P / 512)`` blocks, the first
turn's complete blocks keep AIPerf's ids (so sessions that share a system prompt share those
blocks) and every later block gets an id unique to its session and position (a session's
context only grows, so each turn's blocks extend the previous turn's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnstile.traces.base import LoadedTrace, TraceFormatError, iter_json_lines
from turnstile.workload.model import ToolCall, Turn, Workflow

__all__ = ["BLOCK_SIZE", "load_mooncake_sessions"]

BLOCK_SIZE = 512
DELAY_TOOL = "delay"
_UNIQUE_BASE = 1 << 40  # above any id AIPerf writes


def _records(path: Path) -> dict[str, list[dict[str, Any]]]:
    sessions: dict[str, list[dict[str, Any]]] = {}
    for lineno, d in iter_json_lines(path):
        if not isinstance(d, dict):
            raise TraceFormatError(f"{path}:{lineno}", "", "expected a JSON object")
        for key in ("session_id", "input_length", "output_length", "hash_ids"):
            if key not in d:
                raise TraceFormatError(f"{path}:{lineno}", "", f"field '{key}': missing")
        sessions.setdefault(str(d["session_id"]), []).append(d)
    return sessions


def load_mooncake_sessions(path: str | Path, block_size: int = BLOCK_SIZE) -> LoadedTrace:
    """Load an AIPerf-style multi-turn Mooncake JSONL file (rules in the module docstring)."""
    p = Path(path)
    sessions = _records(p)
    workflows: list[Workflow] = []
    delays = 0
    for s_idx, (sid, recs) in enumerate(sessions.items()):
        first_full = int(recs[0]["input_length"]) // block_size
        shared = [int(x) for x in recs[0]["hash_ids"][:first_full]]
        turns: list[Turn] = []
        ctx = 0
        for k, r in enumerate(recs):
            inp = max(1, int(r["input_length"]))
            out = max(1, int(r["output_length"]))
            prompt = ctx + inp
            n_blocks = -(-prompt // block_size)
            hashes = tuple(shared[j] if j < len(shared)
                           else _UNIQUE_BASE + s_idx * 1_000_000 + j for j in range(n_blocks))
            tools: tuple[ToolCall, ...] = ()
            if k + 1 < len(recs):
                delay_ms = float(recs[k + 1].get("delay") or 0.0)
                delays += 1
                tools = (ToolCall(DELAY_TOOL, max(0.0, delay_ms / 1000.0), "unknown"),)
            turns.append(Turn(inp, out, ctx, block_hashes=hashes, tools=tools))
            ctx = prompt + out
        ts = recs[0].get("timestamp")
        workflows.append(Workflow(
            id=sid, arrival_s=float(ts) / 1000.0 if isinstance(ts, int | float) else 0.0,
            turns=tuple(turns), meta={"source": "mooncake-sessions", "file": p.name}))
    workflows.sort(key=lambda w: (w.arrival_s, w.id))
    n_turns = sum(len(w.turns) for w in workflows)
    notes = [
        f"mooncake sessions (AIPerf format): {n_turns:,} turns in {len(workflows):,} explicit "
        "sessions; a later turn's input_length and hash_ids are its new tokens only, its context "
        "is the previous prompt + output",
        f"mooncake sessions: the delay before each later turn ({delays:,}) is a "
        "ToolCall('delay', status='unknown'): AIPerf's agent tool time or human think time",
        f"mooncake sessions: {block_size}-token prefix blocks; the first turn's complete blocks "
        "keep the file's ids (shared system prompts), later blocks are unique to their session",
    ]
    counts = {"sessions": len(workflows), "llm_calls": n_turns, "tool_calls": delays,
              "skipped": 0}
    return LoadedTrace(name=f"mooncake-sessions:{p.name.split('.')[0]}", source=str(p),
                       workflows=workflows, notes=notes, counts=counts,
                       hash_block_tokens=block_size)
