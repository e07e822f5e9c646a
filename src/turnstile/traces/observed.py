"""Observed LLM calls → a workflow: the shared back end of the gateway recorder and the importers
of request logs and agent trajectories.

Each source yields *threads* (an agent's conversation: calls one after another) of
:class:`ObservedCall` with wall-clock start and end, token counts and prefix block hashes. A
thread may name a parent thread (a sub-agent). :func:`build_workflow` turns them into one
:class:`Workflow`:

* **Tokens.** ``prompt`` = the engine's prompt tokens, ``output`` = its completion tokens (≥ 1).
  ``context_tokens`` = what the call reuses of the previous call of its thread: when its prompt
  text starts with the whole previous prompt text (``extends_previous``), the previous prompt +
  output (capped at prompt − 1) — the previous prompt alone when the client did not send that
  output back (``resends_reply`` False: an agent that drops a malformed reply); otherwise the
  leading hash blocks both share, converted to tokens with the call's own tokens per
  character. The first call of a thread has context 0.
* **Tool time.** The gap between a call's end and the start of the earliest call that waits for
  it, recorded as one ``ToolCall("gap", status="unknown")`` whose ``result_tokens`` is the next
  call's new input when that call extends this one. The gap holds tool time and the client's own
  think time; nothing tells them apart.
* **Sub-agents** (a thread with a parent) become a DAG branch (``Turn.parents``), as the
  AgentCgroup loader does: the branch's first call waits for the parent-thread call that last
  ended before it started; the first parent-thread call that starts after the branch's last
  call ended also waits for that call (the parent blocked on its sub-agent).
* **Arrival** = the first call's start − ``origin_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from turnstile.traces.prefix import BLOCK_CHARS, shared_blocks
from turnstile.workload.model import ToolCall, Turn, Workflow

GAP_TOOL = "gap"


@dataclass(slots=True)
class ObservedCall:
    """One LLM call as seen from outside the engine (never its content)."""

    start_s: float
    end_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None = None
    block_hashes: tuple[int, ...] = ()
    #: characters of the canonical prompt text the hashes were computed from (0: unknown)
    prompt_chars: int = 0
    #: this prompt's text starts with the previous call's whole prompt text (None: unknown)
    extends_previous: bool | None = None
    #: with ``extends_previous``: the message after the previous prompt is the reply to it
    #: (False: the client dropped that reply; None: unknown, taken as sent back)
    resends_reply: bool | None = None
    #: tool calls known from the source (trajectories); None: derived from the gap
    tools: tuple[ToolCall, ...] | None = None


@dataclass(slots=True)
class ObservedThread:
    calls: list[ObservedCall] = field(default_factory=list)
    #: index of the parent thread in the list given to :func:`build_workflow` (must be lower)
    parent: int | None = None


def _grown(prev: ObservedCall, call: ObservedCall) -> int:
    """The previous call's context as ``call`` re-sends it: its prompt, and its output unless
    the client dropped it."""
    if call.resends_reply is False:
        return prev.prompt_tokens
    return prev.prompt_tokens + prev.output_tokens


def _context(prev: ObservedCall | None, call: ObservedCall, block_chars: int) -> int:
    p = call.prompt_tokens
    if prev is None or p <= 1:
        return 0
    if call.extends_previous:
        return min(_grown(prev, call), p - 1)
    if call.extends_previous is None and not call.block_hashes:
        # nothing tells what is shared: assume the transcript grew (the common agent loop)
        grown = prev.prompt_tokens + prev.output_tokens
        return min(grown, p - 1) if p >= prev.prompt_tokens else 0
    k = shared_blocks(prev.block_hashes, call.block_hashes)
    if k == 0 or call.prompt_chars <= 0:
        return 0
    return min(p - 1, round(k * block_chars * p / call.prompt_chars))


def build_workflow(
    wid: str,
    threads: Sequence[ObservedThread],
    *,
    origin_s: float = 0.0,
    tenant: str = "default",
    meta: dict[str, str] | None = None,
    block_chars: int = BLOCK_CHARS,
    with_hashes: bool = True,
) -> Workflow:
    """One workflow from threads of observed calls (rules in the module docstring)."""
    items: list[tuple[float, int, int, ObservedCall]] = [
        (c.start_s, ti, k, c) for ti, th in enumerate(threads) for k, c in enumerate(th.calls)
    ]
    if not items:
        raise ValueError(f"workflow {wid!r}: no calls")
    items.sort(key=lambda x: (x[0], x[1], x[2]))
    index = {(ti, k): i for i, (_, ti, k, _) in enumerate(items)}
    parents: list[list[int]] = [[] for _ in items]
    for i, (start, ti, k, _c) in enumerate(items):
        if k > 0:
            parents[i].append(index[(ti, k - 1)])
            continue
        pt = threads[ti].parent
        if pt is None:
            continue
        before = [(c.end_s, index[(pt, j)]) for j, c in enumerate(threads[pt].calls)
                  if c.end_s <= start and index[(pt, j)] < i]
        if not before:
            before = [(c.start_s, index[(pt, j)]) for j, c in enumerate(threads[pt].calls)
                      if index[(pt, j)] < i]
        if before:
            parents[i].append(max(before)[1])
    for ti, th in enumerate(threads):  # a parent thread waits for its finished sub-agent
        pt = th.parent
        if pt is None or not th.calls:
            continue
        last = index[(ti, len(th.calls) - 1)]
        end = th.calls[-1].end_s
        after = [index[(pt, j)] for j, c in enumerate(threads[pt].calls) if c.start_s >= end]
        if after:
            j = min(after)
            if last < j and last not in parents[j]:
                parents[j].append(last)
    children: list[list[int]] = [[] for _ in items]
    for i, ps in enumerate(parents):
        for p in ps:
            children[p].append(i)
    gaps: list[float | None] = []
    for i, (_, _, _, c) in enumerate(items):
        succ = children[i]
        gaps.append(max(0.0, min(items[j][3].start_s for j in succ) - c.end_s) if succ else None)
    turns: list[Turn] = []
    for i, (start, ti, k, c) in enumerate(items):
        prev = threads[ti].calls[k - 1] if k > 0 else None
        prompt = max(1, c.prompt_tokens)
        context = _context(prev, c, block_chars) if prompt > 1 else 0
        tools: tuple[ToolCall, ...] = ()
        if c.tools is not None:
            tools = c.tools
        elif gaps[i] is not None:
            nxt = [items[j][3] for j in children[i] if items[j][1] == ti]
            result = None
            if nxt and nxt[0].extends_previous:
                result = max(0, nxt[0].prompt_tokens - min(_grown(c, nxt[0]),
                                                           nxt[0].prompt_tokens - 1))
            tools = (ToolCall(GAP_TOOL, round(gaps[i] or 0.0, 6), "unknown", result),)
        think = 0.0
        ps = parents[i]
        if i > 0 and ps == [i - 1]:
            prev = items[i - 1][3]
            if prev.tools is not None:  # known tool time: the rest of the gap is think time
                known = sum(t.duration_s for t in prev.tools)
                think = round(max(0.0, start - prev.end_s - known), 6)
        turns.append(Turn(
            input_tokens=prompt - context,
            output_tokens=max(1, c.output_tokens),
            context_tokens=context,
            block_hashes=c.block_hashes if with_hashes and c.block_hashes else None,
            tools=tools,
            parents=None if ps == ([i - 1] if i else []) else tuple(sorted(ps)),
            think_s=think,
            cached_tokens=c.cached_tokens,
        ))
    return Workflow(id=wid, arrival_s=round(max(0.0, items[0][0] - origin_s), 6),
                    turns=tuple(turns), tenant=tenant, meta=dict(meta or {}))
