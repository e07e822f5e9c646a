"""Real-trace loaders: every supported trace → :class:`LoadedTrace` of normalized workflows.

:func:`load_trace` picks the loader from the path, asking the registered formats in order
(:mod:`turnstile.traces.formats`; an unrecognised path's error lists them all):

* a directory of AgentCgroup sessions (``haiku/`` / ``glm47flash_local/`` subsets, a subset
  folder of ``<task>/attempt_<n>``, a task folder or one attempt folder) → :func:`load_agentcgroup`
* ``*.csv`` (Azure LLM inference trace columns), or a folder holding
  ``AzureLLMInferenceTrace_*.csv`` → :func:`load_azure_conv` (named ``azure:conv`` or
  ``azure:code`` after the file)
* ``*.jsonl[.gz]`` whose first line is a turnstile workload header → the workload file itself
* ``*.jsonl[.gz]`` whose records have ``session_id`` and ``input_length`` (AIPerf's and Dynamo's
  agent traces) → :func:`load_mooncake_sessions`
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

from turnstile.traces.agentcgroup import load_agentcgroup
from turnstile.traces.azure import arrival_times, load_azure_conv
from turnstile.traces.base import LoadedTrace, TraceFormatError, default_traces_dir
from turnstile.traces.formats import (
    SUPPORTED_FORMATS,
    TRACE_FORMATS,
    TraceFormat,
    load_trace,
    register_trace_format,
)
from turnstile.traces.mooncake import load_mooncake
from turnstile.traces.mooncake_sessions import load_mooncake_sessions
from turnstile.traces.requestlog import load_request_log
from turnstile.traces.tracelab import load_tracelab
from turnstile.traces.trajectory import load_trajectories

__all__ = [
    "SUPPORTED_FORMATS",
    "TRACE_FORMATS",
    "LoadedTrace",
    "TraceFormat",
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
    "register_trace_format",
]
