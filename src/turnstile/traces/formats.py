"""The registry of trace formats: how each is recognised, and its loader.

:func:`load_trace` asks the registered formats in order (:data:`TRACE_FORMATS`) and loads the
path with the first that recognises it; when none does, the error lists every format's
description. A new format is one :func:`register_trace_format` call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnstile.traces.agentcgroup import is_agentcgroup_dir, load_agentcgroup
from turnstile.traces.azure import load_azure_conv
from turnstile.traces.base import LoadedTrace, open_text
from turnstile.traces.mooncake import load_mooncake
from turnstile.traces.mooncake_sessions import is_session_trace, load_mooncake_sessions
from turnstile.traces.requestlog import load_request_log, looks_like_request_log
from turnstile.traces.tracelab import load_tracelab
from turnstile.traces.trajectory import is_trajectory_path, load_trajectories
from turnstile.workload.jsonl import FORMAT_NAME, read_header, read_workload

_JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".ndjson")


class Probe:
    """What the formats look at: the path, and (read once, on demand) a JSON file's first
    record. An unreadable first record ends detection with the reason."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.is_dir = path.is_dir()
        self.name = path.name.lower()
        self._first: Any = None
        self._read = False

    @property
    def json_lines(self) -> bool:
        return not self.is_dir and self.name.endswith(_JSON_SUFFIXES)

    def first_record(self) -> dict[str, Any] | None:
        """A JSON Lines file's first record (None for other paths)."""
        if not self.json_lines:
            return None
        if not self._read:
            self._read = True
            try:
                with open_text(self.path) as f:
                    self._first = next((json.loads(line) for line in f if line.strip()), None)
            except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
                raise unsupported(self.path, f"first line is not JSON ({e})") from None
            if not isinstance(self._first, dict):
                raise unsupported(self.path, "first line is not a JSON object")
        return self._first

    def why_not(self) -> str:
        if self.is_dir:
            inside = self.traces_inside()
            if inside:
                return (f"a folder; the trace is a file inside it: give "
                        f"{' or '.join(str(self.path / n) for n in inside)}")
            return "a directory that holds no AgentCgroup sessions or trajectories"
        first = self.first_record()
        if first is not None:
            return f"JSON Lines records with unknown keys {sorted(first)[:8]}"
        return "unknown file type"


    def traces_inside(self, limit: int = 200) -> list[str]:
        """The names of the files directly in this folder that a format recognises."""
        names: list[str] = []
        try:
            children = sorted(self.path.iterdir())[:limit]
        except OSError:
            return names
        for child in children:
            if not child.is_file():
                continue
            probe = Probe(child)
            try:
                if any(f.matches(probe) for f in TRACE_FORMATS.values()):
                    names.append(child.name)
            except (ValueError, OSError):
                continue
        return names


@dataclass(frozen=True)
class TraceFormat:
    """One trace format: ``matches`` recognises a path, ``load(path, progress, **options)``
    loads it (``progress``: show a bar where loading takes long)."""

    name: str
    description: str
    matches: Callable[[Probe], bool]
    load: Callable[..., LoadedTrace]


#: the registered formats, in detection order
TRACE_FORMATS: dict[str, TraceFormat] = {}


def register_trace_format(fmt: TraceFormat) -> TraceFormat:
    if fmt.name in TRACE_FORMATS:
        raise ValueError(f"trace format {fmt.name!r} registered twice")
    TRACE_FORMATS[fmt.name] = fmt
    return fmt


def unsupported(path: Path, why: str) -> ValueError:
    listing = "\n  - ".join(f.description for f in TRACE_FORMATS.values())
    return ValueError(f"{path}: {why}. Supported trace formats:\n  - {listing}")


def load_trace(path: str | Path, progress: bool = False, **kw: Any) -> LoadedTrace:
    """Detect the trace format from ``path`` and load it; ``kw`` go to the chosen loader.

    ``progress`` shows a progress bar where loading takes long (AgentCgroup's many files) and
    is ignored by the single-file loaders, which load in well under a second.
    Raises :class:`ValueError` listing the supported formats when nothing matches.
    """
    p = Path(path)
    if not p.exists():
        raise unsupported(p, "no such file or directory")
    probe = Probe(p)
    for fmt in TRACE_FORMATS.values():
        if fmt.matches(probe):
            return fmt.load(p, progress, **kw)
    raise unsupported(p, probe.why_not())


def _without_progress(loader: Callable[..., LoadedTrace]) -> Callable[..., LoadedTrace]:
    return lambda path, progress, **kw: loader(path, **kw)


def _without_options(what: str, loader: Callable[[Path], LoadedTrace]
                     ) -> Callable[..., LoadedTrace]:
    def load(path: Path, progress: bool, **kw: Any) -> LoadedTrace:
        if kw:
            raise TypeError(f"{what} take no options, got {sorted(kw)}")
        return loader(path)

    return load


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


def _first_has(key: str, value: Any = None) -> Callable[[Probe], bool]:
    def matches(probe: Probe) -> bool:
        first = probe.first_record()
        if first is None:
            return False
        return key in first if value is None else first.get(key) == value

    return matches


for _fmt in (
    TraceFormat(
        "agentcgroup",
        "AgentCgroup directory (haiku/ and glm47flash_local/ subsets, <task>/attempt_<n> "
        "folders, or an attempt folder with trace.jsonl[.gz])",
        lambda probe: probe.is_dir and is_agentcgroup_dir(probe.path),
        lambda path, progress, **kw: load_agentcgroup(path, progress=progress, **kw),
    ),
    TraceFormat(
        "trajectory",
        "mini-swe-agent *.traj.json / SWE-agent *.traj trajectories (optionally .gz), or a folder",
        lambda probe: is_trajectory_path(probe.path),
        _without_progress(load_trajectories),
    ),
    TraceFormat(
        "azure",
        "Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)",
        lambda probe: (probe.name.endswith((".csv", ".csv.gz")) if not probe.is_dir else any(
            c.name.startswith("AzureLLMInferenceTrace") for c in probe.path.iterdir())),
        _without_progress(load_azure_conv),
    ),
    TraceFormat(
        "workload",
        f"turnstile workload JSON Lines ({FORMAT_NAME!r} header)",
        _first_has("format", FORMAT_NAME),
        _without_options("workload files", _load_workload_file),
    ),
    TraceFormat(
        "mooncake-sessions",
        "Mooncake-JSONL agent sessions, as AIPerf and Dynamo replay them (records with "
        "session_id, input_length / hash_ids, delay)",
        lambda probe: (first := probe.first_record()) is not None and is_session_trace(first),
        _without_progress(load_mooncake_sessions),
    ),
    TraceFormat(
        "mooncake",
        "Mooncake JSON Lines (records with hash_ids)",
        _first_has("hash_ids"),
        _without_progress(load_mooncake),
    ),
    TraceFormat(
        "tracelab",
        "TraceLab round_trace JSON Lines (records with round_index): Claude Code / Codex "
        "sessions",
        _first_has("round_index"),
        _without_options("TraceLab round traces", load_tracelab),
    ),
    TraceFormat(
        "request-log",
        "OpenAI-style request logs, JSON Lines (LiteLLM StandardLoggingPayload or spend logs, "
        "request/response pairs)",
        lambda probe: (first := probe.first_record()) is not None and looks_like_request_log(first),
        _without_progress(load_request_log),
    ),
):
    register_trace_format(_fmt)

#: one line per built-in format (what an unrecognised path's error lists)
SUPPORTED_FORMATS: tuple[str, ...] = tuple(f.description for f in TRACE_FORMATS.values())
