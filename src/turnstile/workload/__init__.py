"""Workload model: workflows, turns and tool calls, and their on-disk format."""

from turnstile.workload.jsonl import (
    FORMAT_VERSION,
    WorkloadFormatError,
    iter_workload,
    read_workload,
    write_workload,
)
from turnstile.workload.model import ToolCall, Turn, Workflow, validate_workflow

__all__ = [
    "FORMAT_VERSION",
    "ToolCall",
    "Turn",
    "Workflow",
    "WorkloadFormatError",
    "iter_workload",
    "read_workload",
    "validate_workflow",
    "write_workload",
]
