"""Mooncake FAST'25 request traces (``conversation_trace.jsonl``, ``synthetic_trace.jsonl``).

Each record ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` becomes one turn
with ``block_hashes = hash_ids`` (512-token prefix blocks, chained: a block id fixes its whole
prefix), prompt = ``input_length``, output = ``output_length``, arrival = ``timestamp / 1000``.

The trace has no session ids. Sessions are **inferred from shared prefixes** with this rule,
applied to the records in arrival order (file order among equal timestamps):

1. ``k`` = the number of leading blocks of the request already seen in an earlier request (block
   ids are chained hashes, so the seen blocks always form a prefix).
2. The candidate parent ``p`` is the *most recent* earlier request holding block ``k − 1``.
3. The request continues ``p``'s session iff ``k ≥ full(p)`` (it reuses every complete
   512-token block of ``p``'s prompt; ``full(p) = input_length(p) // block_size``) **and**
   ``k > c``, where ``c`` is the number of *common* leading blocks: positions whose prefix heads
   more than half of all requests, which then branch into at least 3 different next blocks (a
   shared system prompt; ``c = 1`` in the conversation trace, ``0`` in the synthetic one).
   Otherwise the request opens a new session.

Because the newest owner of a block wins, once a request extends ``p`` a later request that only
shares ``p``'s prefix is a *fork* and opens a new session (its ``block_hashes`` still tell a
prefix cache what it can reuse). On the conversation trace this gives 12,031 turns in 8,072
sessions (2,041 multi-turn, up to 43 turns); 3,508 of the 3,959 continuations have a prompt at
least as long as the parent's prompt + output, as a real follow-up turn should. On the synthetic
trace: 3,993 turns in 2,628 sessions (357 multi-turn, up to 24 turns).

Within an inferred session ``context_tokens = min(k × block_size, prompt − 1)`` and the rest is
``input_tokens``. Nothing is known about service time, so the time between two turns of a session
is recorded as one ``ToolCall(name="gap", status="unknown")`` on the earlier turn whose duration is
the whole inter-arrival time (next arrival − previous arrival): an upper bound on tool/think time
that also contains the earlier turn's own service time.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from turnstile.traces.base import LoadedTrace, TraceFormatError, iter_json_lines
from turnstile.workload.model import ToolCall, Turn, Workflow

BLOCK_SIZE = 512
GAP_TOOL = "gap"


def _read(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for lineno, d in iter_json_lines(path):
        if not isinstance(d, dict):
            raise TraceFormatError(f"{path}:{lineno}", "", "expected a JSON object")
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in d:
                raise TraceFormatError(f"{path}:{lineno}", "", f"field '{key}': missing")
        d["_line"] = lineno
        out.append(d)
    return out


def common_prefix_blocks(
    hash_lists: list[list[int]], share: float = 0.5, min_branches: int = 3
) -> int:
    """Leading block positions shared like a system prompt: the prefix heads more than ``share``
    of all requests **and** those requests branch into at least ``min_branches`` different next
    blocks (so one long conversation alone is never mistaken for a shared system prompt)."""
    n = len(hash_lists)
    c = 0
    while n:
        heads: Counter[tuple[int, ...]] = Counter(
            tuple(h[: c + 1]) for h in hash_lists if len(h) > c
        )
        if not heads:
            break
        top, count = heads.most_common(1)[0]
        if count <= share * n:
            break
        nxt = {h[c + 1] if len(h) > c + 1 else None for h in hash_lists if tuple(h[: c + 1]) == top}
        if len(nxt) < min_branches:
            break
        c += 1
    return c


def infer_sessions(
    records: list[dict[str, Any]], block_size: int = BLOCK_SIZE
) -> tuple[list[int], list[int], int]:
    """Session rule of the module docstring.

    Returns ``(session_of, shared_blocks, common)``: for each record (in the given order) the index
    of the record that opened its session, the number of leading blocks it shares with its parent
    (0 for a session's first turn), and the number of common system-prompt blocks.
    """
    hashes = [list(r["hash_ids"]) for r in records]
    common = common_prefix_blocks(hashes)
    owner: dict[int, int] = {}
    session_of: list[int] = []
    shared: list[int] = []
    for i, h in enumerate(hashes):
        k = 0
        while k < len(h) and h[k] in owner:
            k += 1
        sess, share = i, 0
        if k > common:
            p = owner[h[k - 1]]
            if k >= int(records[p]["input_length"]) // block_size:
                sess, share = session_of[p], k
        session_of.append(sess)
        shared.append(share)
        for x in h:
            owner[x] = i
    return session_of, shared, common


def load_mooncake(path_to_jsonl: str | Path, block_size: int = BLOCK_SIZE) -> LoadedTrace:
    """Load a Mooncake trace and infer sessions (rule in the module docstring)."""
    path = Path(path_to_jsonl)
    raw = _read(path)
    order = sorted(range(len(raw)), key=lambda i: (raw[i]["timestamp"], i))
    was_sorted = order == list(range(len(raw)))
    recs = [raw[i] for i in order]
    session_of, shared, common = infer_sessions(recs, block_size)
    members: dict[int, list[int]] = {}
    for i, s in enumerate(session_of):
        members.setdefault(s, []).append(i)
    clamped_out = clamped_in = capped = 0
    workflows: list[Workflow] = []
    stem = path.name.split(".")[0]
    for s, idx in members.items():
        turns: list[Turn] = []
        for j, i in enumerate(idx):
            r = recs[i]
            prompt = int(r["input_length"])
            if prompt < 1:
                clamped_in += 1
                prompt = 1
            out = int(r["output_length"])
            if out < 1:
                clamped_out += 1
                out = 1
            context = min(shared[i] * block_size, prompt - 1)
            if shared[i] * block_size > prompt - 1:
                capped += 1
            tools: tuple[ToolCall, ...] = ()
            if j + 1 < len(idx):
                gap = (recs[idx[j + 1]]["timestamp"] - r["timestamp"]) / 1000.0
                tools = (ToolCall(GAP_TOOL, max(0.0, gap), "unknown"),)
            turns.append(
                Turn(
                    input_tokens=prompt - context,
                    output_tokens=out,
                    context_tokens=context,
                    block_hashes=tuple(int(x) for x in r["hash_ids"]),
                    tools=tools,
                )
            )
        first = recs[s]
        workflows.append(
            Workflow(
                id=f"{stem}-{first['_line']}",
                arrival_s=first["timestamp"] / 1000.0,
                turns=tuple(turns),
                meta={"source": "mooncake", "file": path.name, "first_line": str(first["_line"])},
            )
        )
    workflows.sort(key=lambda w: (w.arrival_s, int(w.meta["first_line"])))
    lens = [len(w.turns) for w in workflows]
    multi = sum(n > 1 for n in lens)
    continuations = sum(1 for x in shared if x)
    notes = [
        f"mooncake: sessions inferred by shared prefixes: a request continues the most recent "
        f"earlier request p holding its deepest already-seen block when it reuses every complete "
        f"{block_size}-token block of p's prompt (k ≥ input_length(p) // {block_size}) and more "
        f"than the {common} common system-prompt block(s); otherwise it opens a new session "
        f"→ {len(recs):,} turns in {len(workflows):,} sessions ({multi:,} multi-turn, "
        f"max {max(lens, default=0)} turns, {continuations:,} continuations)",
        f"mooncake: context_tokens = shared blocks × {block_size}, capped at prompt − 1 "
        f"({capped:,} capped); a session's first turn has context 0 even when it shares common "
        "blocks (block_hashes carry that reuse)",
        "mooncake: no service times: the time between two turns of a session is one "
        "ToolCall(name='gap', status='unknown') = next arrival − previous arrival, which also "
        "contains the earlier turn's own service time (an upper bound on tool/think time)",
        "mooncake: arrival_s = timestamp / 1000 (real production arrivals, relative to the "
        "start of the trace)",
    ]
    if not was_sorted:
        notes.append("mooncake: records were not sorted by timestamp; sorted (stable) first")
    if clamped_in or clamped_out:
        notes.append(
            f"mooncake: {clamped_in} zero prompts and {clamped_out} zero outputs set to 1 token"
        )
    counts = {
        "requests": len(recs),
        "llm_calls": len(recs),
        "sessions": len(workflows),
        "multi_turn_sessions": multi,
        "continuations": continuations,
        "common_blocks": common,
        "tool_calls": sum(len(t.tools) for w in workflows for t in w.turns),
        "skipped": 0,
    }
    return LoadedTrace(
        name=f"mooncake:{stem}", source=str(path), workflows=workflows, notes=notes, counts=counts,
        hash_block_tokens=block_size,
    )
