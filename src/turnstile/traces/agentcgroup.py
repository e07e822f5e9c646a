"""AgentCgroup: Claude Code sessions on SWE-rebench tasks (``$TURNSTILE_TRACES/agentcgroup_*``).

Layout: ``<root>/<subset>/<task>/attempt_<n>/{trace.jsonl,tool_calls.json,...}``, each file
optionally gzipped on its own (``trace.jsonl.gz``). Subsets: ``haiku`` (cloud Anthropic API) and
``glm47flash_local`` (a local GLM-4.7-Flash behind an Anthropic-compatible endpoint).

One :class:`Workflow` per attempt folder that has a trace; how an attempt's events become turns,
tools and sub-agent branches: :mod:`turnstile.traces.agentcgroup_session`. Arrival: the session's
first event timestamp (UTC) relative to the earliest session of the load. The tasks ran one after
another, so this is batch order, not user arrivals.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from turnstile.traces.agentcgroup_session import (
    BASH_TIMEOUT_S,
    PLACEHOLDER_MAX_OUTPUT,
    SessionStats,
    read_session,
)
from turnstile.traces.base import LoadedTrace, find_variant, plural
from turnstile.workload.model import Workflow

SUBSETS: tuple[str, ...] = ("haiku", "glm47flash_local")
#: upstream folder names, mapped to ours
SUBSET_ALIASES: dict[str, str] = {
    "all_images_haiku": "haiku",
    "all_images_local": "glm47flash_local",
}


def _subset_name(folder: Path) -> str:
    return SUBSET_ALIASES.get(folder.name, folder.name)


def _attempt_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*/attempt_*") if p.is_dir())


def discover(path: str | Path, subset: str | None = None) -> list[tuple[str, Path]]:
    """``(subset, attempt folder)`` pairs under ``path``, in a stable order.

    ``path`` may be the trace root (holding ``haiku/`` and ``glm47flash_local/``), one subset
    folder, one task folder (holding ``attempt_*``), or one attempt folder.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    subs = [p for p in sorted(root.iterdir()) if p.is_dir() and _subset_name(p) in SUBSETS]
    if subs:
        if subset is not None and subset not in {_subset_name(p) for p in subs}:
            raise ValueError(f"{root}: no subset {subset!r} (have {[p.name for p in subs]})")
        return [
            (_subset_name(s), a)
            for s in subs
            if subset is None or _subset_name(s) == subset
            for a in _attempt_dirs(s)
        ]
    if _attempt_dirs(root):
        return [(subset or _subset_name(root), a) for a in _attempt_dirs(root)]
    if any(p.is_dir() for p in root.glob("attempt_*")):
        label = subset or _subset_name(root.parent)
        return [(label, a) for a in sorted(root.glob("attempt_*")) if a.is_dir()]
    if find_variant(root, "trace.jsonl") is not None:
        return [(subset or _subset_name(root.parent.parent), root)]
    raise ValueError(
        f"{root}: not an AgentCgroup folder (expected {'/'.join(SUBSETS)} subsets, "
        "<task>/attempt_<n> folders, or a trace.jsonl[.gz])"
    )


def is_agentcgroup_dir(path: str | Path) -> bool:
    try:
        return bool(discover(path))
    except ValueError:
        return False


def _progress_iter(
    items: list[tuple[str, Path]], enabled: bool
) -> Iterable[tuple[str, Path]]:
    if not enabled:
        return items
    from rich.progress import track

    return track(items, description="AgentCgroup sessions", transient=True)


def load_agentcgroup(
    path: str | Path, subset: str | None = None, progress: bool = False
) -> LoadedTrace:
    """Load AgentCgroup sessions (each mapping decision: :mod:`.agentcgroup_session`)."""
    attempts = discover(path, subset)
    loaded: list[tuple[float, Workflow]] = []
    notes: list[str] = []
    counts: Counter[str] = Counter()
    per_subset: dict[str, SessionStats] = {}
    for sub, att in _progress_iter(attempts, progress):
        st = per_subset.setdefault(sub, SessionStats())
        st.c["attempts"] += 1
        task, attempt = att.parent.name, att.name
        trace = find_variant(att, "trace.jsonl")
        if trace is None:
            st.c["skipped"] += 1
            st.notes.append(f"{sub}: {task}/{attempt} has no trace.jsonl; skipped")
            continue
        tools = find_variant(att, "tool_calls.json")
        if tools is None:
            st.c["no_tool_calls_file"] += 1
        got = read_session(trace, tools, sub, task, attempt, st)
        if got is None:
            st.c["skipped"] += 1
            st.notes.append(f"{sub}: {task}/{attempt} has no LLM call in its trace; skipped")
            continue
        st.c["sessions"] += 1
        loaded.append(got)
    t0 = min((ts for ts, _ in loaded), default=0.0)
    workflows = [wf.shifted(round(ts - t0, 6)) for ts, wf in loaded]
    workflows.sort(key=lambda w: (w.arrival_s, w.id))
    for sub, st in per_subset.items():
        c = st.c
        for k, v in c.items():
            counts[k] += v
            counts[f"{sub}.{k}"] = v
        notes.extend(st.notes)
        notes.extend(_notes(sub, st))
    notes.append(
        "arrival_s = the session's first event timestamp (UTC) relative to the earliest session "
        "loaded: batch order (tasks ran one at a time), not user arrivals; superimpose sessions "
        "on an arrival stream for multi-tenant load"
    )
    src = str(Path(path))
    name = "agentcgroup" if len(per_subset) != 1 else f"agentcgroup:{next(iter(per_subset))}"
    return LoadedTrace(name=name, source=src, workflows=workflows, notes=notes, counts=dict(counts))


def _notes(sub: str, st: SessionStats) -> list[str]:
    c = st.c
    out: list[str] = []
    if c["cloud_calls"]:
        out.append(
            f"{sub}: output_tokens are streaming placeholders (≤ {PLACEHOLDER_MAX_OUTPUT} tokens "
            f"while the call wrote more) in {c['placeholder_outputs']:,} of {c['cloud_calls']:,} "
            "calls; replaced by an estimate from assistant text/thinking/tool_use-input chars ÷ 4"
        )
    if st.ratios:
        out.append(
            f"{sub}: output_tokens are real; check of the chars ÷ 4 estimate on them: median "
            f"real/estimate = {statistics.median(st.ratios):.2f} over {len(st.ratios):,} calls"
        )
    if c["synthetic"]:
        n_syn = plural(c["synthetic"], "<synthetic> message")
        out.append(f"{sub}: {n_syn} ignored (not LLM calls)")
    if c["multi_usage"]:
        out.append(
            f"{sub}: {plural(c['multi_usage'], 'call')} logged different usage on different "
            "blocks; the largest prompt and output were used"
        )
    if c["zero_prompt"]:
        out.append(
            f"{sub}: {plural(c['zero_prompt'], 'call')} logged no prompt tokens; prompt set to the "
            "previous call's prompt + output + 1"
        )
    out.append(
        f"{sub}: context_tokens = previous call's prompt + output in the same thread, capped at "
        f"the current prompt − 1; the cap applied in {c['context_capped']:,} of "
        f"{c['llm_calls']:,} calls (the next prompt is smaller, e.g. thinking not re-sent)"
    )
    if c["sidechain_runs"]:
        runs = plural(c["sidechain_runs"], "sub-agent (Task) run")
        where = plural(c["sessions_with_sidechains"], "session")
        tasks = plural(c["task_as_subagent"], "Task tool call")
        out.append(
            f"{sub}: {runs} ({c['sidechain_calls']:,} calls) in {where} modelled as DAG branches "
            f"(Turn.parents); their {tasks} dropped from the spawning turn's tools because the "
            "branch's turns are that time"
            + (f"; {c['sidechain_unmatched']} branch(es) matched to no Task"
               if c["sidechain_unmatched"] else "")
        )
    if c["no_tool_calls_file"] or c["latency_from_trace"]:
        out.append(
            f"{sub}: {plural(c['no_tool_calls_file'], 'session')} without tool_calls.json; "
            f"{c['latency_from_trace']:,} tool "
            f"{'latency' if c['latency_from_trace'] == 1 else 'latencies'} taken from the trace's "
            "tool_result − tool_use timestamps instead"
        )
    if c["tools_without_result"]:
        out.append(
            f"{sub}: {plural(c['tools_without_result'], 'tool call')} never returned a result "
            "(session ended); duration 0, status 'unknown'"
        )
    out.append(
        f"{sub}: tool status: {c['tool_timeout']:,} timeout (Bash ≥ {BASH_TIMEOUT_S} s, "
        f"before is_error), {c['tool_error']:,} error (tool_result is_error), {c['tool_ok']:,} ok"
    )
    return out
