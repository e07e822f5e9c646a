"""Summary statistics of a workload (one pass over the turns, numpy for the percentiles)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from turnstile.workload.model import Workflow

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
DIST_KEYS: tuple[str, ...] = (
    "turns_per_workflow",
    "prompt_tokens",
    "input_tokens",
    "context_tokens",
    "output_tokens",
    "tool_latency_s",
)


def describe(values: Any) -> dict[str, float]:
    """``{"p50", "p90", "p95", "p99", "mean", "max"}`` of ``values`` (all 0.0 when empty)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {**{f"p{p}": 0.0 for p in PERCENTILES}, "mean": 0.0, "max": 0.0}
    qs = np.percentile(a, PERCENTILES)
    out = {f"p{p}": float(q) for p, q in zip(PERCENTILES, qs, strict=True)}
    out["mean"] = float(a.mean())
    out["max"] = float(a.max())
    return out


def summarize(workflows: Iterable[Workflow], top_tools: int = 10) -> dict[str, Any]:
    """Counts and distributions of a workload.

    Keys: ``workflows``, ``turns``, ``tool_calls``; percentile dicts (``p50``, ``p90``, ``p95``,
    ``p99``, ``mean``, ``max``) for ``turns_per_workflow``, ``prompt_tokens``, ``input_tokens``
    (new tokens per turn), ``context_tokens``, ``output_tokens`` and ``tool_latency_s``;
    ``tools_by_name`` (the ``top_tools`` most used names → count), ``tool_status`` (status →
    count) and ``arrival_span_s`` (last arrival − first arrival).
    """
    n_turns: list[int] = []
    inp: list[int] = []
    ctx: list[int] = []
    out: list[int] = []
    lat: list[float] = []
    names: Counter[str] = Counter()
    status: Counter[str] = Counter()
    arrivals: list[float] = []
    for wf in workflows:
        arrivals.append(wf.arrival_s)
        n_turns.append(len(wf.turns))
        for t in wf.turns:
            inp.append(t.input_tokens)
            ctx.append(t.context_tokens)
            out.append(t.output_tokens)
            for tool in t.tools:
                lat.append(tool.duration_s)
                names[tool.name] += 1
                status[tool.status] += 1
    a_in = np.asarray(inp, dtype=np.int64)
    a_ctx = np.asarray(ctx, dtype=np.int64)
    return {
        "workflows": len(n_turns),
        "turns": int(a_in.size),
        "tool_calls": len(lat),
        "turns_per_workflow": describe(n_turns),
        "prompt_tokens": describe(a_in + a_ctx),
        "input_tokens": describe(a_in),
        "context_tokens": describe(a_ctx),
        "output_tokens": describe(out),
        "tool_latency_s": describe(lat),
        "tools_by_name": dict(names.most_common(top_tools)),
        "tool_status": dict(status.most_common()),
        "arrival_span_s": float(max(arrivals) - min(arrivals)) if arrivals else 0.0,
    }
