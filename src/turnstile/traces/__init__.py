"""Real-trace loaders: every supported trace → :class:`LoadedTrace` of normalized workflows.

:func:`load_trace` picks the loader from the path:

* a directory of AgentCgroup sessions (``haiku/`` / ``glm47flash_local/`` subsets, a subset
  folder of ``<task>/attempt_<n>``, a task folder or one attempt folder) → :func:`load_agentcgroup`
* ``*.csv`` (Azure LLM inference trace columns), or a folder holding
  ``AzureLLMInferenceTrace_*.csv`` → :func:`load_azure_conv` (named ``azure:conv`` or
  ``azure:code`` after the file)
* ``*.jsonl[.gz]`` whose first line is a turnstile workload header → the workload file itself
* ``*.jsonl[.gz]`` whose records have ``hash_ids`` and ``session_id`` (AIPerf's multi-turn
  Mooncake format) → :func:`load_mooncake_sessions`
* ``*.jsonl[.gz]`` whose records have ``hash_ids`` → :func:`load_mooncake`
* ``*.jsonl[.gz]`` whose records have ``round_index`` → :func:`load_tracelab` (TraceLab's
  Claude Code and Codex session exports)
* ``*.jsonl[.gz]`` of OpenAI-style request logs (LiteLLM payloads or spend logs,
  request/response pairs) → :func:`load_request_log`
* ``*.traj.json[.gz]`` / ``*.traj[.gz]`` agent trajectories, or a folder holding some →
  :func:`load_trajectories` (mini-swe-agent, SWE-agent)

Malformed input raises :class:`TraceFormatError` (a ``ValueError``) naming the file, the line or
JSON path, and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from turnstile.traces.agentcgroup import is_agentcgroup_dir, load_agentcgroup
from turnstile.traces.azure import arrival_times, load_azure_conv
from turnstile.traces.base import LoadedTrace, TraceFormatError, default_traces_dir, open_text
from turnstile.traces.mooncake import load_mooncake
from turnstile.traces.mooncake_sessions import load_mooncake_sessions
from turnstile.traces.requestlog import load_request_log, looks_like_request_log
from turnstile.traces.tracelab import load_tracelab
from turnstile.traces.trajectory import is_trajectory_path, load_trajectories
from turnstile.workload.jsonl import FORMAT_NAME, read_header, read_workload

SUPPORTED_FORMATS: tuple[str, ...] = (
    "AgentCgroup directory (haiku/ and glm47flash_local/ subsets, <task>/attempt_<n> folders, or "
    "an attempt folder with trace.jsonl[.gz])",
    "Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)",
    "Mooncake JSON Lines (records with hash_ids)",
    "AIPerf multi-turn Mooncake JSON Lines (records with session_id, hash_ids, delay)",
    "TraceLab round_trace JSON Lines (records with round_index): Claude Code / Codex sessions",
    "OpenAI-style request logs, JSON Lines (LiteLLM StandardLoggingPayload or spend logs, "
    "request/response pairs)",
    "mini-swe-agent *.traj.json / SWE-agent *.traj trajectories (optionally .gz), or a folder",
    f"turnstile workload JSON Lines ({FORMAT_NAME!r} header)",
)


def _unsupported(path: Path, why: str) -> ValueError:
    listing = "\n  - ".join(SUPPORTED_FORMATS)
    return ValueError(f"{path}: {why}. Supported trace formats:\n  - {listing}")


def _first_record(path: Path) -> Any:
    with open_text(path) as f:
        for line in f:
            if line.strip():
                return json.loads(line)
    return None


def _load_workload_file(path: Path) -> LoadedTrace:
    workflows = read_workload(path)
    turns = sum(len(w.turns) for w in workflows)
    meta = read_header(path).get("meta")
    block_tokens = meta.get("hash_block_tokens") if isinstance(meta, dict) else None
    warnings = meta.get("warnings") if isinstance(meta, dict) else None
    return LoadedTrace(
        name=f"workload:{path.stem}",
        source=str(path),
        workflows=workflows,
        notes=["turnstile workload file: read as is (already normalized)"],
        counts={
            "sessions": len(workflows),
            "llm_calls": turns,
            "tool_calls": sum(len(t.tools) for w in workflows for t in w.turns),
            "skipped": 0,
        },
        hash_block_tokens=block_tokens if isinstance(block_tokens, int) else 0,
        warnings=[str(w) for w in warnings] if isinstance(warnings, list) else [],
    )


def load_trace(path: str | Path, progress: bool = False, **kw: Any) -> LoadedTrace:
    """Detect the trace format from ``path`` and load it; ``kw`` go to the chosen loader.

    ``progress`` shows a progress bar where loading takes long (AgentCgroup's many files) and
    is ignored by the single-file loaders, which load in well under a second.
    Raises :class:`ValueError` listing the supported formats when nothing matches.
    """
    p = Path(path)
    if not p.exists():
        raise _unsupported(p, "no such file or directory")
    if p.is_dir():
        if is_agentcgroup_dir(p):
            return load_agentcgroup(p, progress=progress, **kw)
        if is_trajectory_path(p):
            return load_trajectories(p, **kw)
        if any(c.name.startswith("AzureLLMInferenceTrace") for c in p.iterdir()):
            return load_azure_conv(p, **kw)
        raise _unsupported(p, "a directory that holds no AgentCgroup sessions or trajectories")
    name = p.name.lower()
    if is_trajectory_path(p):
        return load_trajectories(p, **kw)
    if name.endswith((".csv", ".csv.gz")):
        return load_azure_conv(p, **kw)
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".ndjson")):
        try:
            first = _first_record(p)
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise _unsupported(p, f"first line is not JSON ({e})") from None
        if not isinstance(first, dict):
            raise _unsupported(p, "first line is not a JSON object")
        if first.get("format") == FORMAT_NAME:
            if kw:
                raise TypeError(f"workload files take no options, got {sorted(kw)}")
            return _load_workload_file(p)
        if "hash_ids" in first and "session_id" in first:
            return load_mooncake_sessions(p, **kw)
        if "hash_ids" in first:
            return load_mooncake(p, **kw)
        if "round_index" in first:
            if kw:
                raise TypeError(f"load_tracelab takes no options, got {sorted(kw)}")
            return load_tracelab(p)
        if looks_like_request_log(first):
            return load_request_log(p, **kw)
        raise _unsupported(p, f"JSON Lines records with unknown keys {sorted(first)[:8]}")
    raise _unsupported(p, "unknown file type")


__all__ = [
    "SUPPORTED_FORMATS",
    "LoadedTrace",
    "TraceFormatError",
    "arrival_times",
    "default_traces_dir",
    "load_agentcgroup",
    "load_azure_conv",
    "load_mooncake",
    "load_mooncake_sessions",
    "load_request_log",
    "load_trace",
    "load_tracelab",
    "load_trajectories",
]
