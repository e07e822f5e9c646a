"""Azure LLM inference trace 2023 (conversation service, Splitwise): a plain request stream.

CSV columns ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``, sorted), ``ContextTokens`` (prompt),
``GeneratedTokens`` (output). Every row becomes a single-turn workflow arriving at its timestamp
relative to the first row. There is no session, prefix or tool information, so the trace is best
used as an **arrival stream**: :func:`arrival_times` returns it as a numpy array to superimpose
agent sessions on (see :func:`turnstile.workload.synth.superimpose`).
"""

from __future__ import annotations

import csv
import re
from calendar import timegm
from itertools import pairwise
from pathlib import Path

import numpy as np

from turnstile.traces.base import LoadedTrace, open_text
from turnstile.workload.model import Turn, Workflow

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TS = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?$")


def _split_timestamp(ts: str) -> tuple[int, float]:
    m = _TS.match(ts.strip())
    if m is None:
        raise ValueError(f"bad TIMESTAMP {ts!r}")
    y, mo, d, h, mi, s, frac = m.groups()
    whole = timegm((int(y), int(mo), int(d), int(h), int(mi), int(s), 0, 0, 0))
    return whole, (float("0." + frac) if frac else 0.0)


def parse_timestamp(ts: str) -> float:
    """``2023-11-16 18:15:46.6805900`` → Unix seconds (the trace has no zone; read as UTC).

    Parsed by hand because the trace has 7 fractional digits (``datetime`` takes at most 6).
    """
    whole, frac = _split_timestamp(ts)
    return whole + frac


def _rows(csv_path: Path) -> list[tuple[float, int, int, int]]:
    """``(seconds since the first row's whole second, prompt, output, line)`` per row.

    Kept relative to an early whole second so that float64 keeps sub-microsecond precision.
    """
    out: list[tuple[float, int, int, int]] = []
    base: int | None = None
    with open_text(csv_path) as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{csv_path}: not an Azure LLM trace (missing columns {missing})")
        for lineno, row in enumerate(reader, start=2):
            try:
                whole, frac = _split_timestamp(row["TIMESTAMP"])
                base = whole if base is None else base
                out.append(
                    (
                        (whole - base) + frac,
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                        lineno,
                    )
                )
            except (TypeError, ValueError) as e:
                raise ValueError(f"{csv_path}:{lineno}: {e}") from None
    return out


def arrival_times(path: str | Path) -> np.ndarray:
    """Arrival times (s) of every request, relative to the first, sorted ascending."""
    t = np.array([r[0] for r in _rows(Path(path))], dtype=np.float64)
    if t.size == 0:
        return t
    t.sort()
    out: np.ndarray = t - t[0]
    return out


def service_of(path: Path) -> str:
    """``code`` for the code-completion trace (``AzureLLMInferenceTrace_code*.csv``), else
    ``conv`` (the conversation service)."""
    return "code" if "code" in path.name.lower() else "conv"


def find_azure_csv(folder: Path) -> Path:
    """The Azure trace CSV in ``folder``: the only ``AzureLLMInferenceTrace*.csv[.gz]`` (or the
    only ``*.csv``); the conversation trace when both services are there."""
    cands = sorted(p for p in folder.iterdir() if p.is_file()
                   and p.name.lower().endswith((".csv", ".csv.gz")))
    named = [p for p in cands if p.name.startswith("AzureLLMInferenceTrace")] or cands
    if len(named) > 1:
        conv = [p for p in named if service_of(p) == "conv"]
        if len(conv) == 1:
            return conv[0]
    if len(named) != 1:
        raise ValueError(f"{folder}: expected one Azure trace CSV, found "
                         f"{[p.name for p in named] or 'none'}; name the file")
    return named[0]


def load_azure_conv(csv_path: str | Path) -> LoadedTrace:
    """Every row → a one-turn workflow (prompt = ContextTokens, output = GeneratedTokens).

    ``csv_path`` may be the CSV or the folder holding it (:func:`find_azure_csv`); the trace is
    named after its service (``azure:conv`` or ``azure:code``)."""
    path = Path(csv_path)
    if path.is_dir():
        path = find_azure_csv(path)
    service = service_of(path)
    rows = _rows(path)
    t0 = min((r[0] for r in rows), default=0.0)
    was_sorted = all(a[0] <= b[0] for a, b in pairwise(rows))
    zero_in = zero_out = 0
    workflows: list[Workflow] = []
    for ts, ctx, gen, lineno in rows:
        if ctx < 1:
            zero_in += 1
        if gen < 1:
            zero_out += 1
        workflows.append(
            Workflow(
                id=f"azure-{service}-{lineno - 1}",
                arrival_s=ts - t0,
                turns=(Turn(input_tokens=max(1, ctx), output_tokens=max(1, gen)),),
                meta={"source": f"azure_llm_2023_{service}", "row": str(lineno - 1)},
            )
        )
    workflows.sort(key=lambda w: w.arrival_s)
    span = workflows[-1].arrival_s if workflows else 0.0
    notes = [
        "azure: no session structure (each row is a one-turn workflow, context_tokens 0, no "
        "prefix or tool information); best used as an arrival stream (arrival_times())",
        f"azure: arrival_s = TIMESTAMP relative to the first row (zone-less, read as UTC); "
        f"{len(rows):,} requests over {span:,.0f} s",
    ]
    if not was_sorted:
        notes.append("azure: rows were not sorted by TIMESTAMP; sorted")
    if zero_in or zero_out:
        notes.append(f"azure: {zero_in} zero prompts and {zero_out} zero outputs set to 1 token")
    counts = {
        "requests": len(rows),
        "llm_calls": len(rows),
        "sessions": len(rows),
        "tool_calls": 0,
        "skipped": 0,
    }
    return LoadedTrace(
        name=f"azure:{service}", source=str(path), workflows=workflows, notes=notes,
        counts=counts
    )
