"""The long-context coding-agent family: sessions whose prompts are ~100k tokens and grow
towards 400k, in the regime where an engine's KV holds only a handful of sessions.

Each session (seeded, reproducible) is a lead agent's chain of turns on a large starting
context (system prompt, repository files: median ~110k tokens), to which every turn adds a small
new input (hundreds of tokens: a tool result, a user nudge) and a short output (a tool call, a
short edit). Between turns the agent thinks and its tools run: heavy-tailed gaps, median 6 s, up
to ten minutes. Mid-session the lead may spawn sub-agents (a ``Task`` tool call): 1–3 chains of
their own, each on a fresh, smaller context, run in parallel; the lead's next turn waits for
all of them and reads their summaries. Sessions are one DAG workflow each (``Turn.parents``).
Prompts that would pass :data:`MAX_PROMPT_TOKENS` compact back to the starting context.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from turnstile.workload.model import ToolCall, Turn, Workflow

__all__ = ["MAX_PROMPT_TOKENS", "long_context_sessions"]

#: a prompt never passes this (the session compacts); fits one 8B engine's KV on an H100
MAX_PROMPT_TOKENS = 400_000
#: chance that a lead turn (not its first or last) spawns sub-agents
SPAWN_PROB = 0.03


def _gap_s(rng: np.random.Generator) -> float:
    """A think + tool gap: lognormal, median 6 s, σ 1.4, within [0.2 s, 600 s]."""
    return float(min(max(rng.lognormal(math.log(6.0), 1.4), 0.2), 600.0))


def _small(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(max(rng.lognormal(math.log(median), sigma), lo), hi))


def _chain(rng: np.random.Generator, turns: list[Turn], first: int, length: int,
           parent: int) -> int:
    """Append a sub-agent's chain of ``length`` turns whose first waits for turn ``parent`` and
    starts on a fresh prompt of ``first`` tokens; returns the index of its last turn."""
    ctx, inp, prev = 0, first, parent
    for j in range(length):
        out = _small(rng, 150, 0.9, 8, 4_000)
        if ctx + inp + out > MAX_PROMPT_TOKENS:  # compact: back to the starting context
            ctx, inp = 0, first
        tools = () if j + 1 == length else (ToolCall("tool", round(_gap_s(rng), 4), "ok"),)
        turns.append(Turn(inp, out, ctx, tools=tools, parents=(prev,)))
        prev = len(turns) - 1
        ctx += inp + out
        inp = _small(rng, 400, 0.8, 20, 8_000)
    return prev


def _session(rng: np.random.Generator, name: str) -> Workflow:
    turns: list[Turn] = []
    n_lead = _small(rng, 30, 0.5, 6, 120)
    first = _small(rng, 110_000, 0.45, 30_000, 350_000)
    ctx, inp = 0, first
    waits: tuple[int, ...] | None = None  # what the lead's next turn waits for (None: a root)
    for j in range(n_lead):
        out = _small(rng, 150, 0.9, 8, 4_000)
        if ctx + inp + out > MAX_PROMPT_TOKENS:  # compact: back to the starting context
            ctx, inp = 0, first
        spawn = 0 < j < n_lead - 1 and rng.random() < SPAWN_PROB
        if j + 1 == n_lead:
            tools: tuple[ToolCall, ...] = ()
        elif spawn:
            tools = (ToolCall("task", 0.05, "ok"),)
        else:
            tools = (ToolCall("tool", round(_gap_s(rng), 4), "ok"),)
        turns.append(Turn(inp, out, ctx, tools=tools, parents=waits))
        me = len(turns) - 1
        ctx += inp + out
        inp = _small(rng, 400, 0.8, 20, 8_000)
        waits = (me,)
        if spawn:  # sub-agents on their own fresh contexts; the lead's next turn joins them
            ends = [_chain(rng, turns, _small(rng, 30_000, 0.5, 5_000, 100_000),
                           _small(rng, 6, 0.5, 3, 20), me)
                    for _ in range(int(rng.integers(1, 4)))]
            waits = (me, *ends)
            inp += sum(_small(rng, 800, 0.5, 100, 4_000) for _ in ends)  # their summaries
    return Workflow(name, 0.0, tuple(turns), meta={"source": "synth-long-context"})


def long_context_sessions(n: int, seed: int) -> tuple[list[Workflow], dict[str, Any]]:
    """``n`` long-context coding-agent sessions (the module docstring), arrivals at 0; the same
    ``seed`` gives the same sessions, and the first ``k`` do not depend on ``n``."""
    out = []
    for w in range(n):
        rng = np.random.default_rng([seed, 37, w])
        out.append(_session(rng, f"longctx-{seed}-{w:05d}"))
    return out, {"name": "synthetic: long-context coding agent (100k-token median prompts, "
                 "sub-agents)", "path": None}
