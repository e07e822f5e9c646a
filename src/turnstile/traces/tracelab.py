"""TraceLab per-LLM-round traces (``round_trace.jsonl``; UW SyFI Lab, Claude Code and Codex).

One JSON object per LLM round. Rounds are grouped by ``session_id`` and ordered by
``round_index``; each round becomes one turn:

* ``context_tokens`` ← ``prefix_tokens`` (prompt served from the provider's cache),
  ``input_tokens`` ← ``newly_append_tokens``; when either is null the round falls back to
  ``input_tokens_total`` as new input (context 0), and when the three disagree the total wins
  (``input = total − context``).
* ``output_tokens`` ← ``output_tokens`` (includes Codex's reasoning tokens); null or 0 → 1.
* tools ← ``tools[]`` in ``tool_index`` order: duration = ``tool_wall_latency_ms / 1000``, else
  ``result_at − emitted_at``, else 0 with status ``unknown``; status ``error`` / ``ok`` from
  ``is_error`` (``unknown`` when null); ``result_tokens`` = ``result_chars ÷ 4`` when present.
* ``think_s`` ← for a round after the first whose input starts with a ``user_message``: that
  message's timestamp − the previous round's last event (human think time).
* arrival ← the session's first event timestamp relative to the earliest session of the file.

Every fallback is counted and reported in :attr:`LoadedTrace.notes`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from turnstile.traces.base import (
    LoadedTrace,
    TraceFormatError,
    counted_notes,
    iter_json_lines,
    parse_utc,
)
from turnstile.workload.model import ToolCall, ToolStatus, Turn, Workflow


def _num(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _ts(v: Any) -> float | None:
    if not isinstance(v, str) or not v:
        return None
    try:
        return parse_utc(v)
    except ValueError:
        return None


def _event_times(r: dict[str, Any]) -> list[float]:
    times = [_ts(e.get("timestamp")) for e in r.get("timing_events") or [] if isinstance(e, dict)]
    for t in r.get("tools") or []:
        if isinstance(t, dict):
            times.extend((_ts(t.get("emitted_at")), _ts(t.get("result_at"))))
    return [t for t in times if t is not None]


def _tool(t: dict[str, Any], c: Counter[str]) -> ToolCall:
    name = str(t.get("tool_name") or "?")
    wall = t.get("tool_wall_latency_ms")
    dur: float | None = None
    if isinstance(wall, int | float) and not isinstance(wall, bool) and wall >= 0:
        dur = wall / 1000.0
    else:
        a, b = _ts(t.get("emitted_at")), _ts(t.get("result_at"))
        if a is not None and b is not None:
            dur = round(max(0.0, b - a), 6)
            c["latency_from_timestamps"] += 1
    is_error = t.get("is_error")
    status: ToolStatus
    if dur is None:
        c["latency_missing"] += 1
        dur, status = 0.0, "unknown"
    elif is_error is True:
        status = "error"
    elif is_error is False:
        status = "ok"
    else:
        c["status_null"] += 1
        status = "unknown"
    chars = _num(t, "result_chars")
    if chars is None:
        c["result_chars_null"] += 1
    return ToolCall(name, dur, status, chars // 4 if chars is not None else None)


def load_tracelab(path: str | Path) -> LoadedTrace:
    """Load TraceLab rounds (see the module docstring for every mapping and fallback)."""
    p = Path(path)
    rounds: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for lineno, r in iter_json_lines(p):
        if not isinstance(r, dict):
            raise TraceFormatError(f"{p}:{lineno}", "", "expected a JSON object")
        sid = r.get("session_id")
        if sid is None:
            raise TraceFormatError(f"{p}:{lineno}", "", "field 'session_id': missing")
        idx = _num(r, "round_index")
        rounds.setdefault(str(sid), []).append((idx if idx is not None else lineno, lineno, r))
    c: Counter[str] = Counter()
    starts: list[tuple[float | None, Workflow]] = []
    for sid, rs in rounds.items():
        rs.sort(key=lambda x: (x[0], x[1]))
        turns: list[Turn] = []
        prev_end: float | None = None
        first_ts: float | None = None
        models: Counter[str] = Counter()
        for _, _lineno, r in rs:
            c["rounds"] += 1
            models[str(r.get("model") or "")] += 1
            total = _num(r, "input_tokens_total")
            prefix, append = _num(r, "prefix_tokens"), _num(r, "newly_append_tokens")
            if prefix is None or append is None:
                c["prefix_or_append_null"] += 1
                context, new = 0, (total if total is not None else (append or 0))
            else:
                context, new = prefix, append
                if total is not None and prefix + append != total:
                    c["total_mismatch"] += 1
                    context = min(prefix, total)
                    new = total - context
            if new < 1:
                c["input_clamped"] += 1
                if context > 0:
                    context -= 1 - new
                new = 1
            out = _num(r, "output_tokens")
            if out is None or out < 1:
                c["output_clamped"] += 1
                out = 1
            tools_raw = [t for t in r.get("tools") or [] if isinstance(t, dict)]
            tools_raw.sort(key=lambda t: _num(t, "tool_index") or 0)
            tools = tuple(_tool(t, c) for t in tools_raw)
            times = _event_times(r)
            think = 0.0
            if turns and r.get("first_input_event_type") == "user_message" and prev_end:
                um = [
                    _ts(e.get("timestamp"))
                    for e in r.get("timing_events") or []
                    if isinstance(e, dict) and e.get("event_type") == "user_message"
                ]
                um_t = [t for t in um if t is not None]
                if um_t:
                    think = round(max(0.0, min(um_t) - prev_end), 6)
                    c["think_times"] += 1
            if times:
                first_ts = min(times) if first_ts is None else min(first_ts, min(times))
                prev_end = max(times)
            turns.append(
                Turn(
                    input_tokens=new,
                    output_tokens=out,
                    context_tokens=max(0, context),
                    tools=tools,
                    think_s=think,
                )
            )
        if first_ts is None:
            c["sessions_without_timestamps"] += 1
        meta = {
            "source": "tracelab",
            "session_id": sid,
            "provider": str(rs[0][2].get("provider") or ""),
            "model": models.most_common(1)[0][0],
        }
        starts.append((first_ts, Workflow(id=sid, arrival_s=0.0, turns=tuple(turns), meta=meta)))
    t0 = min((t for t, _ in starts if t is not None), default=0.0)
    workflows = [wf.shifted(round(t - t0, 6) if t is not None else 0.0) for t, wf in starts]
    workflows.sort(key=lambda w: (w.arrival_s, w.id))
    notes = [
        "tracelab: context_tokens = prefix_tokens (provider cache hits), input_tokens = "
        "newly_append_tokens; tool duration = tool_wall_latency_ms; think_s = gap before a "
        "user_message that starts a later round",
        "tracelab: arrival_s = session's first event relative to the earliest session "
        "(collected segments, not multi-tenant arrivals)",
    ]
    explain = {
        "prefix_or_append_null": "rounds with null prefix/append tokens: whole prompt taken as new "
        "input (context 0)",
        "total_mismatch": "rounds where prefix + append ≠ input_tokens_total: total kept",
        "input_clamped": "rounds with no new input: input set to 1 token",
        "output_clamped": "rounds with null/zero output_tokens: set to 1",
        "latency_from_timestamps": "tool calls without tool_wall_latency_ms: result_at − "
        "emitted_at used",
        "latency_missing": "tool calls with no latency at all: duration 0, status 'unknown'",
        "status_null": "tool calls with is_error null: status 'unknown'",
        "result_chars_null": "tool calls with result_chars null: result_tokens None",
        "sessions_without_timestamps": "sessions without any timestamp: arrival 0",
    }
    notes.extend(counted_notes("tracelab", c, explain))
    counts = dict(c)
    counts.update(
        llm_calls=c["rounds"],
        sessions=len(workflows),
        tool_calls=sum(len(t.tools) for w in workflows for t in w.turns),
        skipped=0,
    )
    return LoadedTrace(
        name=f"tracelab:{p.stem}", source=str(p), workflows=workflows, notes=notes, counts=counts
    )
