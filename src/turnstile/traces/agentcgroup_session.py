"""One AgentCgroup attempt (``trace.jsonl`` + ``tool_calls.json``) → one :class:`Workflow`.

Mapping to the normalized schema (finding and loading the attempts:
:mod:`turnstile.traces.agentcgroup`):

* **Turns.** One turn per LLM call = per distinct assistant ``message.id`` (every content block of a
  call is logged as its own event and repeats the call's usage). ``<synthetic>`` messages are Claude
  Code internals and are ignored.
* **Prompt.** Cloud calls: ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``;
  local calls report the full prompt in ``input_tokens``. ``context_tokens`` = the previous call's
  prompt + output in the same thread, capped at the current prompt; ``input_tokens`` = the rest
  (at least 1).
* **Output.** Local runs report real output counts. Cloud runs log a streaming placeholder
  (``output_tokens`` ≤ 32 while the call clearly wrote more): those are replaced by
  ``characters of text + thinking + tool_use input ÷ 4`` (at least 1).
* **Tools.** The call's ``tool_use`` blocks, in order. Latency = ``end_timestamp − timestamp`` from
  ``tool_calls.json`` (matched by id); without that file, the trace's ``tool_result`` timestamp −
  the ``tool_use`` block's timestamp. Status: ``timeout`` for Bash calls of ≥ 119.5 s (Claude
  Code's 120 s default; these also carry ``is_error``), else ``error`` when the result has
  ``is_error``, else ``ok`` (``unknown`` when no result was recorded). ``result_tokens`` =
  characters of the result content ÷ 4.
* **Sub-agents.** Events with ``isSidechain`` are a ``Task`` tool's sub-agent: a separate
  conversation (its own context) that runs while the ``Task`` call is pending. Its calls become a
  DAG branch (``Turn.parents``): the branch's first turn waits for the turn that emitted the
  ``Task``, the main thread's next turn waits for both its predecessor and the branch's last turn.
  The ``Task`` tool call itself is dropped from the spawning turn's tools (its wall time *is* the
  branch). Sessions without sub-agents are plain chains (``parents`` is ``None`` everywhere).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnstile.traces.base import open_text, parse_utc, tokens_from_chars
from turnstile.workload.model import ToolCall, ToolStatus, Turn, Workflow

#: a cloud call reporting at most this many output tokens is a streaming placeholder when its
#: content is longer than that (the message_start usage Claude Code logged shows 1–25)
PLACEHOLDER_MAX_OUTPUT = 32
#: Bash calls at least this long hit Claude Code's 120 s default timeout
BASH_TIMEOUT_S = 119.5
SYNTHETIC_MODEL = "<synthetic>"
MAIN = "main"


@dataclass
class _Call:
    id: str
    thread: str
    order: int
    model: str
    cloud: bool
    prompt: int
    output: int
    chars: int = 0
    usage_variants: int = 1
    tool_uses: list[tuple[str, str, float, Any]] = field(default_factory=list)


@dataclass
class _Thread:
    key: str
    root_ts: float
    root_prompt: str | None = None
    calls: list[_Call] = field(default_factory=list)
    spawned_by: str | None = None  # tool_use id of the Task that started it


@dataclass
class SessionStats:
    """Counters summed over sessions; turned into notes and counts."""

    c: Counter[str] = field(default_factory=Counter)
    ratios: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _prompt_of(usage: dict[str, Any]) -> tuple[int, bool]:
    cloud = "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage
    total = int(usage.get("input_tokens") or 0)
    if cloud:
        total += int(usage.get("cache_creation_input_tokens") or 0)
        total += int(usage.get("cache_read_input_tokens") or 0)
    return total, cloud


def _block_chars(block: dict[str, Any]) -> int:
    kind = block.get("type")
    if kind == "text":
        return len(block.get("text") or "")
    if kind == "thinking":
        return len(block.get("thinking") or "")
    if kind == "tool_use":
        return len(json.dumps(block.get("input"), ensure_ascii=False))
    return 0


def _result_chars(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        n = 0
        for x in content:
            if isinstance(x, dict):
                n += len(str(x.get("text") or x.get("content") or ""))
            else:
                n += len(str(x))
        return n
    return len(str(content))


def _load_tool_calls(path: Path | None) -> dict[str, float]:
    if path is None:
        return {}
    with open_text(path) as f:
        arr = json.load(f)
    out: dict[str, float] = {}
    for t in arr if isinstance(arr, list) else []:
        try:
            dur = parse_utc(t["end_timestamp"]) - parse_utc(t["timestamp"])
            out[str(t["id"])] = round(max(0.0, dur), 6)  # timestamps are in ms
        except (KeyError, TypeError, ValueError):
            continue
    return out


@dataclass
class _Trace:
    """What one ``trace.jsonl`` holds, grouped into conversation threads and LLM calls."""

    threads: dict[str, _Thread]
    calls: dict[str, _Call]
    #: tool_use id → (result time, is_error, result chars)
    results: dict[str, tuple[float, bool, int]]
    session_id: str
    first_ts: float


def _read_trace(trace_path: Path, st: SessionStats) -> _Trace | None:
    """Group the trace's events by thread and by LLM call; ``None`` when it holds no call."""
    threads: dict[str, _Thread] = {}
    uuid_thread: dict[str, str] = {}
    calls: dict[str, _Call] = {}
    results: dict[str, tuple[float, bool, int]] = {}
    session_id = ""
    first_ts: float | None = None
    with open_text(trace_path) as f:
        for line in f:
            if not line.strip():
                continue
            e = json.loads(line)
            ts_raw = e.get("timestamp")
            if ts_raw is None:
                continue  # "summary" records carry no time and no call
            ts = parse_utc(ts_raw)
            first_ts = ts if first_ts is None else min(first_ts, ts)
            session_id = session_id or str(e.get("sessionId") or "")
            uuid = str(e.get("uuid") or "")
            parent = e.get("parentUuid")
            if not e.get("isSidechain"):
                key = MAIN
            else:
                key = uuid_thread.get(str(parent), "") if parent else ""
                key = key if key.startswith("side:") else f"side:{uuid}"
            if uuid:
                uuid_thread[uuid] = key
            thread = threads.get(key)
            if thread is None:
                thread = threads[key] = _Thread(key=key, root_ts=ts)
            msg = e.get("message") or {}
            content = msg.get("content")
            if e.get("type") == "user":
                if isinstance(content, str) and thread.root_prompt is None:
                    thread.root_prompt = content
                elif isinstance(content, list):
                    for b in content:
                        if isinstance(b, dict) and b.get("type") == "tool_result":
                            results[str(b.get("tool_use_id"))] = (
                                ts, bool(b.get("is_error")), _result_chars(b.get("content"))
                            )
                continue
            if e.get("type") != "assistant":
                continue
            model = str(msg.get("model") or "")
            if model == SYNTHETIC_MODEL:
                st.c["synthetic"] += 1
                continue
            mid = str(msg.get("id") or uuid)
            usage = msg.get("usage") or {}
            prompt, cloud = _prompt_of(usage)
            output = int(usage.get("output_tokens") or 0)
            call = calls.get(mid)
            if call is None:
                call = calls[mid] = _Call(mid, key, len(calls), model, cloud, prompt, output)
                thread.calls.append(call)
            elif (prompt, output) != (call.prompt, call.output):
                call.usage_variants += 1
                call.prompt, call.output = max(call.prompt, prompt), max(call.output, output)
            for b in content if isinstance(content, list) else []:
                if not isinstance(b, dict):
                    continue
                call.chars += _block_chars(b)
                if b.get("type") == "tool_use":
                    call.tool_uses.append(
                        (str(b.get("id")), str(b.get("name") or "?"), ts, b.get("input"))
                    )
    if not calls or first_ts is None:
        return None
    return _Trace(threads, calls, results, session_id, first_ts)


def _match_subagents(
    trace: _Trace, st: SessionStats
) -> tuple[list[_Thread], dict[str, str], dict[str, _Thread]]:
    """Which ``Task`` call started which sub-agent thread.

    Returns the sub-agent threads, ``Task`` tool_use id → id of the call that emitted it, and
    ``Task`` tool_use id → the thread it started.
    """
    side = [t for t in trace.threads.values() if t.key != MAIN and t.calls]
    task_uses = [
        (tu[0], tu[2], c, tu[3])
        for c in trace.calls.values()
        for tu in c.tool_uses
        if tu[1] == "Task"
    ]
    claimed: set[str] = set()
    for t in sorted(side, key=lambda t: t.root_ts):
        match = None
        for tid, _ts, _c, inp in task_uses:
            prompt_text = inp.get("prompt") if isinstance(inp, dict) else None
            if tid not in claimed and prompt_text is not None and prompt_text == t.root_prompt:
                match = tid
                break
        if match is None:  # the latest unclaimed Task emitted before the sub-agent started
            before = [(ts, tid) for tid, ts, _c, _i in task_uses
                      if tid not in claimed and ts <= t.root_ts]
            match = max(before)[1] if before else None
        if match is None:
            st.c["sidechain_unmatched"] += 1
        else:
            claimed.add(match)
        t.spawned_by = match
    spawner: dict[str, str] = {tid: c.id for tid, _ts, c, _i in task_uses}
    threads_by_task = {t.spawned_by: t for t in side if t.spawned_by}
    return side, spawner, threads_by_task


def _tools_of(
    call: _Call,
    trace: _Trace,
    threads_by_task: dict[str, _Thread],
    tool_lat: dict[str, float],
    st: SessionStats,
) -> tuple[ToolCall, ...]:
    """The call's tool calls; a ``Task`` that started a sub-agent is the branch, not a tool."""
    tools: list[ToolCall] = []
    for tid, name, ts, _inp in call.tool_uses:
        if name == "Task" and tid in threads_by_task:
            st.c["task_as_subagent"] += 1
            continue
        res = trace.results.get(tid)
        if tid in tool_lat:
            dur: float | None = tool_lat[tid]
        elif res is not None:
            dur = round(max(0.0, res[0] - ts), 6)
            st.c["latency_from_trace"] += 1
        else:
            dur = None
        status: ToolStatus
        if dur is None:
            status, dur = "unknown", 0.0
            st.c["tools_without_result"] += 1
        elif name == "Bash" and dur >= BASH_TIMEOUT_S:
            status = "timeout"  # reported with is_error too; the more specific status wins
        elif res is not None and res[1]:
            status = "error"
        else:
            status = "ok"
        st.c[f"tool_{status}"] += 1
        tools.append(
            ToolCall(name, dur, status, res[2] // 4 if res is not None else None)
        )
    return tuple(tools)


def read_session(
    trace_path: Path,
    tool_path: Path | None,
    subset: str,
    task: str,
    attempt: str,
    st: SessionStats,
) -> tuple[float, Workflow] | None:
    """Map one attempt (see the module docstring); counts into ``st``.

    Returns ``(first event time, workflow at arrival 0)``, or ``None`` when the trace holds no
    LLM call.
    """
    trace = _read_trace(trace_path, st)
    if trace is None:
        return None
    side, spawner, threads_by_task = _match_subagents(trace, st)
    tool_lat = _load_tool_calls(tool_path)
    ordered = sorted(trace.calls.values(), key=lambda c: c.order)
    index = {c.id: i for i, c in enumerate(ordered)}
    prev_in_thread: dict[str, _Call] = {}
    prev_of: dict[str, _Call | None] = {}
    for c in ordered:
        prev_of[c.id] = prev_in_thread.get(c.thread)
        prev_in_thread[c.thread] = c
    out_of: dict[str, int] = {}
    turns: list[Turn] = []
    main_models: Counter[str] = Counter()
    side_models: Counter[str] = Counter()
    for i, c in enumerate(ordered):
        (main_models if c.thread == MAIN else side_models)[c.model] += 1
        if c.usage_variants > 1:
            st.c["multi_usage"] += 1
        est = tokens_from_chars(c.chars)
        output = c.output
        if c.cloud:
            st.c["cloud_calls"] += 1
            if output <= PLACEHOLDER_MAX_OUTPUT and est > output:
                output = est
                st.c["placeholder_outputs"] += 1
        elif c.output > 0 and c.chars > 0:
            st.ratios.append(c.output / est)
        output = max(1, output)
        out_of[c.id] = output
        prev = prev_of[c.id]
        prompt = c.prompt
        if prompt <= 0:  # no usage logged: assume the context carried over plus one token
            st.c["zero_prompt"] += 1
            prompt = (prev.prompt + out_of[prev.id] if prev is not None else 0) + 1
            c.prompt = prompt
        context = 0
        if prev is not None:
            context = prev.prompt + out_of[prev.id]
            if context >= prompt:
                st.c["context_capped"] += 1
                context = prompt - 1
        # --- DAG edges (sub-agent branches)
        parents: list[int] = []
        if prev is not None:
            parents.append(index[prev.id])
            for tid, *_ in prev.tool_uses:
                branch = threads_by_task.get(tid)
                if branch is not None and branch.calls:
                    parents.append(index[branch.calls[-1].id])
        elif c.thread != MAIN:
            thread = trace.threads[c.thread]
            src = spawner.get(thread.spawned_by or "")
            if src is None:  # unmatched: hang it on the latest main call before it
                mains = [index[x.id] for x in ordered[:i] if x.thread == MAIN]
                parents.extend(mains[-1:])
            else:
                parents.append(index[src])
        parents = sorted({p for p in parents if p < i})
        par: tuple[int, ...] | None = tuple(parents)
        if (i == 0 and not parents) or parents == [i - 1]:
            par = None
        tools = _tools_of(c, trace, threads_by_task, tool_lat, st)
        turns.append(
            Turn(
                input_tokens=prompt - context,
                output_tokens=output,
                context_tokens=context,
                tools=tools,
                parents=par,
            )
        )
    st.c["llm_calls"] += len(turns)
    st.c["tool_calls"] += sum(len(t.tools) for t in turns)
    st.c["sidechain_runs"] += len(side)
    st.c["sidechain_calls"] += sum(len(t.calls) for t in side)
    st.c["sessions_with_sidechains"] += bool(side)
    meta = {
        "source": "agentcgroup",
        "subset": subset,
        "task": task,
        "attempt": attempt,
        "model": main_models.most_common(1)[0][0] if main_models else "",
        "session_id": trace.session_id,
    }
    if side_models:
        meta["subagent_model"] = side_models.most_common(1)[0][0]
    wf = Workflow(id=f"{subset}/{task}/{attempt}", arrival_s=0.0, turns=tuple(turns), meta=meta)
    return trace.first_ts, wf
