"""Mooncake-JSONL with sessions: the trace format AIPerf and Dynamo replay agents from.

One JSON object per LLM call, grouped by ``session_id``, in order within a session:

``session_id``
    the conversation (an agent session); every record of a session shares it.
``timestamp``
    milliseconds: when the session's first call arrives (first record of a root session only).
``delay``
    milliseconds the client waits after the session's previous call finished before sending this
    one (its tool calls and think time); on a sub-agent's first record, after the parent call it
    forks from finished.
``input_length`` / ``output_length``
    tokens in and out. A session's first record carries its whole prompt; a later record only
    the *new* input: AIPerf's multi-turn replay sends the session's history (earlier prompts and
    replies) and adds the record's input as the next user message, so a later call's prompt is
    the previous call's prompt + reply + ``input_length`` (a transcript a client compacted is
    written as if it kept growing).
``hash_ids``
    block ids of the tokens the record adds (the whole prompt on a first record; AIPerf
    synthesizes each block's text from its id, ``--isl-block-size`` tokens a block), renumbered
    densely from 0 in order of first use: equal ids are equal text, so a system prompt shared
    by many sessions is the same first ids. A workload without hashes gets fresh ids of
    ``BLOCK_SIZE`` (512) tokens for each record's new input.
``parent_session_id``
    on every record of a sub-agent's session: the session that spawned it.

turnstile adds two fields AIPerf ignores, so a DAG survives the round trip: ``parent_turn`` (on
a sub-agent's first record: the parent session's call it forks from, 0-based) and ``wait_for``
(on a call that waited for sub-agents to finish: their session ids).

Writing (:func:`write_mooncake_sessions`): a chain workflow is one session; a DAG workflow (the
recorder's sub-agents, AgentCgroup's Task calls) is split into threads — a turn continues the
thread whose last turn it waits for (the oldest such thread) unless it starts a context of its
own (no context tokens, a different first block), otherwise it opens a sub-agent session.
Reading (:func:`load_mooncake_sessions`): the inverse — a later call's ``context_tokens`` is
the previous call's prompt + output, its prefix hashes the previous call's followed by its own.
Times are kept to the millisecond.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from turnstile.traces.base import LoadedTrace, TraceFormatError, iter_json_lines
from turnstile.workload.model import ToolCall, Turn, Workflow

__all__ = ["BLOCK_SIZE", "is_session_trace", "load_mooncake_sessions", "mooncake_records",
           "write_mooncake_sessions"]

BLOCK_SIZE = 512
DELAY_TOOL = "delay"
_PARENT_KEYS = ("parent_session_id", "parent_id")


def is_session_trace(first: dict[str, Any]) -> bool:
    """A Mooncake record of an agent trace (sessions), not a bare request stream."""
    return "session_id" in first and ("input_length" in first or "hash_ids" in first)


# ----------------------------------------------------------------------------- writing
def _threads(wf: Workflow) -> tuple[list[list[int]], list[int | None], list[int | None]]:
    """Split a workflow into threads: the turn indices of each, each thread's parent thread and
    the parent turn its first turn forks from (None for the root thread)."""
    threads: list[list[int]] = []
    parent: list[int | None] = []
    fork: list[int | None] = []
    thread_of: dict[int, int] = {}
    dag = not wf.is_chain
    for i in range(len(wf.turns)):
        ps = wf.parents_of(i)
        cont = [thread_of[p] for p in ps if threads[thread_of[p]][-1] == p
                and not (dag and _fresh(wf.turns[i], wf.turns[p]))]
        if not ps:
            t = len(threads)
            threads.append([i])
            parent.append(None)
            fork.append(None)
        elif cont:
            t = min(cont)
            threads[t].append(i)
        else:
            t = len(threads)
            src = max(ps)
            threads.append([i])
            parent.append(thread_of[src])
            fork.append(src)
        thread_of[i] = t
    return threads, parent, fork


def _fresh(t: Turn, prev: Turn) -> bool:
    """``t`` starts a context of its own (a sub-agent), not the transcript of ``prev``."""
    if t.context_tokens > 0:
        return False
    return not (t.block_hashes and prev.block_hashes
                and t.block_hashes[0] == prev.block_hashes[0])


def mooncake_records(workflows: Iterable[Workflow]) -> list[dict[str, Any]]:
    """The records of the module docstring for ``workflows`` (sessions in arrival order)."""
    out: list[dict[str, Any]] = []
    ids: dict[Any, int] = {}
    for wf in sorted(workflows, key=lambda w: (w.arrival_s, w.id)):
        threads, parent, fork = _threads(wf)
        names = [wf.id if k == 0 else f"{wf.id}.{k}" for k in range(len(threads))]
        waits: dict[int, list[str]] = {}
        chains: dict[int, list[Any]] = {}  # each turn's prompt blocks, as the file implies
        for k, turns in enumerate(threads):
            if k:
                last = turns[-1]
                for j in range(last + 1, len(wf.turns)):
                    if last in wf.parents_of(j):
                        waits.setdefault(j, []).append(names[k])
        for k, turns in enumerate(threads):
            for pos, i in enumerate(turns):
                t = wf.turns[i]
                rec: dict[str, Any] = {"session_id": names[k]}
                if pos == 0 and k == 0:
                    rec["timestamp"] = round(wf.arrival_s * 1000.0, 3)
                else:
                    prev = turns[pos - 1] if pos else fork[k]
                    assert prev is not None
                    gap = wf.turns[prev].tool_duration_s + t.think_s
                    rec["delay"] = round(gap * 1000.0, 3)
                first_of_thread = pos == 0
                # AIPerf's multi-turn replay sends the history (earlier prompts and replies)
                # and adds each later record's input as the new user message: a later record
                # carries the new input only (``input_tokens``), the first the whole prompt
                rec["input_length"] = t.prompt_tokens if first_of_thread else t.input_tokens
                rec["output_length"] = t.output_tokens
                before = [] if first_of_thread else chains[turns[pos - 1]]
                full: list[Any]
                new_ids: list[Any]
                if t.block_hashes:
                    full = list(t.block_hashes)
                    m = 0
                    while m < min(len(full), len(before)) and full[m] == before[m]:
                        m += 1
                    new_ids = full[m:]
                else:  # blocks of BLOCK_SIZE tokens, the new input's
                    n = max(-(-rec["input_length"] // BLOCK_SIZE), 1)
                    new_ids = [("synth", wf.id, i, b) for b in range(n)]
                    full = before + new_ids
                chains[i] = full
                rec["hash_ids"] = [ids.setdefault(h, len(ids)) for h in new_ids]
                pk = parent[k]
                if pk is not None:
                    rec["parent_session_id"] = names[pk]
                    if pos == 0:
                        rec["parent_turn"] = threads[pk].index(fork[k])  # type: ignore[arg-type]
                if i in waits:
                    rec["wait_for"] = waits[i]
                out.append(rec)
    dense: dict[int, int] = {}  # renumbered in order of first use in the file
    for rec in out:
        if "hash_ids" in rec:
            rec["hash_ids"] = [dense.setdefault(h, len(dense)) for h in rec["hash_ids"]]
    return out


def write_mooncake_sessions(path: str | Path, workflows: Iterable[Workflow]) -> int:
    """Write ``workflows`` as Mooncake-JSONL sessions; returns the number of records."""
    recs = mooncake_records(workflows)
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return len(recs)


# ----------------------------------------------------------------------------- reading
def _num(d: dict[str, Any], key: str, where: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise TraceFormatError(where, "", f"field '{key}': expected a number >= 0, got {v!r}")
    return float(v)


def load_mooncake_sessions(path: str | Path, block_size: int = BLOCK_SIZE) -> LoadedTrace:
    """Read a Mooncake-JSONL agent trace (see the module docstring) into workflows: a root
    session and its sub-agent sessions (``parent_session_id``) become one workflow (a DAG)."""
    p = Path(path)
    sessions: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for lineno, d in iter_json_lines(p):
        if not isinstance(d, dict):
            raise TraceFormatError(f"{p}:{lineno}", "", "expected a JSON object")
        sid = d.get("session_id")
        if sid is None:
            raise TraceFormatError(f"{p}:{lineno}", "", "field 'session_id': missing")
        for key in ("input_length", "output_length"):
            if not isinstance(d.get(key), int) or isinstance(d.get(key), bool):
                raise TraceFormatError(f"{p}:{lineno}", "", f"field '{key}': expected an int")
        sessions.setdefault(str(sid), []).append((lineno, d))
    parent_of: dict[str, str | None] = {}
    for sid, recs in sessions.items():
        parent_sid = None
        for key in _PARENT_KEYS:
            if recs[0][1].get(key) is not None:
                parent_sid = str(recs[0][1][key])
                break
        if parent_sid is not None and parent_sid not in sessions:
            raise TraceFormatError(f"{p}:{recs[0][0]}", "",
                                   f"parent session {parent_sid!r} not found")
        parent_of[sid] = parent_sid

    def root(sid: str) -> str:
        seen = set()
        while parent_of[sid] is not None:
            if sid in seen:
                raise TraceFormatError(str(p), "", f"sessions form a cycle at {sid!r}")
            seen.add(sid)
            sid = parent_of[sid]  # type: ignore[assignment]
        return sid

    families: dict[str, list[str]] = {}
    for sid in sessions:  # file order: a parent's records come before its children's
        families.setdefault(root(sid), []).append(sid)
    workflows = []
    clamped = 0
    for rid, members in families.items():
        first = sessions[rid][0]
        ts = _num(first[1], "timestamp", f"{p}:{first[0]}")
        if ts is None:
            raise TraceFormatError(f"{p}:{first[0]}", "", "a root session's first record "
                                   "needs 'timestamp'")
        turns: list[Turn] = []
        parents: list[tuple[int, ...] | None] = []
        gaps: list[float] = []  # delay before each turn (seconds)
        index: dict[tuple[str, int], int] = {}
        joins: list[tuple[int, str]] = []  # (turn, sub-agent session it waits for)
        for sid in _parents_first(members, parent_of):
            prev_rec: dict[str, Any] | None = None
            prev: Turn | None = None
            for pos, (lineno, d) in enumerate(sessions[sid]):
                where = f"{p}:{lineno}"
                new, out = int(d["input_length"]), int(d["output_length"])
                if new < 1 or out < 1:
                    clamped += 1
                    new, out = max(new, 1), max(out, 1)
                ids = tuple(int(x) for x in d.get("hash_ids") or ())
                if prev is None:  # a session's first call: its whole prompt
                    context, hashes = 0, ids
                else:  # a later call: the history (previous prompt and reply) plus new input
                    context = prev.prompt_tokens + prev.output_tokens
                    hashes = (prev.block_hashes or ()) + ids
                delay = _num(d, "delay", where)
                if delay is None and pos and prev_rec is not None:
                    t_now, t_prev = _num(d, "timestamp", where), _num(prev_rec, "timestamp",
                                                                       where)
                    delay = max((t_now or 0.0) - (t_prev or 0.0), 0.0)
                gaps.append((delay or 0.0) / 1000.0)
                me = len(turns)
                if pos:
                    par: tuple[int, ...] | None = (index[(sid, pos - 1)],)
                elif parent_of[sid] is not None:
                    ptn = d.get("parent_turn")
                    psess = sessions[parent_of[sid]]  # type: ignore[index]
                    ptn = int(ptn) if isinstance(ptn, int) else len(psess) - 1
                    par = (index[(parent_of[sid], ptn)],)  # type: ignore[index]
                else:
                    par = ()
                for child in d.get("wait_for") or ():
                    if str(child) not in sessions:
                        raise TraceFormatError(where, "", f"wait_for: no session {child!r}")
                    joins.append((me, str(child)))
                index[(sid, pos)] = me
                parents.append(par)
                turn = Turn(input_tokens=new, output_tokens=out, context_tokens=context,
                            block_hashes=hashes or None)
                turns.append(turn)
                prev, prev_rec = turn, d
        for me, child in joins:  # the sub-agents' last calls, now that every session is read
            parents[me] = (*(parents[me] or ()), index[(child, len(sessions[child]) - 1)])
        # each turn's delay is the tool time of the turn it waits for (its first parent)
        tool_s: dict[int, float] = {}
        for i, par in enumerate(parents):
            if par:
                tool_s[par[0]] = max(tool_s.get(par[0], 0.0), gaps[i])
        order = _topological(parents)
        renumber = {old: k for k, old in enumerate(order)}
        chain = all(parents[old] == ((order[k - 1],) if k else ()) for k, old in enumerate(order))
        final = []
        for old in order:
            t = turns[old]
            tools = (ToolCall(DELAY_TOOL, tool_s[old], "unknown"),) if old in tool_s else ()
            par = None if chain else tuple(sorted({renumber[q] for q in parents[old] or ()}))
            final.append(Turn(t.input_tokens, t.output_tokens, t.context_tokens,
                              t.block_hashes, tools, par))
        meta = {"source": "mooncake-sessions", "file": p.name, "session_id": rid}
        if len(members) > 1:
            meta["subagents"] = str(len(members) - 1)
        workflows.append(Workflow(rid, ts / 1000.0, tuple(final), meta=meta))
    workflows.sort(key=lambda w: (w.arrival_s, w.id))
    n = sum(len(r) for r in sessions.values())
    notes = [f"mooncake sessions: {n:,} calls in {len(sessions):,} sessions grouped by "
             f"session_id into {len(workflows):,} workflows (sub-agent sessions, named by "
             "parent_session_id, are DAG branches of their root's workflow)",
             "mooncake sessions: a later call's context = the previous call's prompt + output "
             "(AIPerf's multi-turn history); its input = input_length",
             "mooncake sessions: each 'delay' is the tool/think time after the call it waits "
             "for: one ToolCall(name='delay', status='unknown') on that call"]
    if clamped:
        notes.append(f"mooncake sessions: {clamped} zero-length prompts or outputs set to 1")
    counts = {"requests": n, "llm_calls": n, "sessions": len(sessions),
              "workflows": len(workflows), "skipped": 0,
              "tool_calls": sum(len(t.tools) for w in workflows for t in w.turns)}
    return LoadedTrace(name=f"mooncake-sessions:{p.name.split('.')[0]}", source=str(p),
                       workflows=workflows, notes=notes, counts=counts,
                       hash_block_tokens=block_size)


def _topological(parents: list[tuple[int, ...] | None]) -> list[int]:
    """Turn indices ordered so that every turn comes after the turns it waits for (the reading
    order otherwise)."""
    import heapq

    waiting = [len(set(p or ())) for p in parents]
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        for q in set(p or ()):
            children.setdefault(q, []).append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(i)
        for c in children.get(i, ()):
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, c)
    if len(out) != len(parents):
        raise TraceFormatError("mooncake sessions", "", "wait_for forms a cycle")
    return out


def _parents_first(members: list[str], parent_of: dict[str, str | None]) -> list[str]:
    """Sessions ordered so that every parent comes before its children (file order otherwise)."""
    out: list[str] = []
    done: set[str] = set()

    def visit(s: str) -> None:
        if s in done:
            return
        par = parent_of[s]
        if par is not None:
            visit(par)
        done.add(s)
        out.append(s)

    for s in members:
        visit(s)
    return out
