"""Side-by-side reports: a rich table on the terminal and ``results.json`` for the record.

A *result* is one policy's run: a dict with at least ``"policy"`` (its CLI name) and
``"metrics"`` (from :func:`turnstile.bench.metrics.compute_metrics`); any other keys (the
policy's parameters, wall time, …) are written as they are. Keys starting with ``_`` (plot
samples) are stripped, at every depth, before writing.

``results.json``::

    {"schema": "turnstile-results", "version": 1, "turnstile_version": "...",
     "simulated": true, "config": {...}, "trace": {"path": ..., "sha256": ..., ...},
     "policies": [{"policy": "eager", "metrics": {...}, ...}, ...]}

``trace.sha256`` is :func:`file_sha256` of a trace file or :func:`tree_sha256` of a trace
directory; :func:`write_results` fills it in from ``trace.path`` when the caller did not.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from turnstile import __version__
from turnstile.bench.metrics import public_metrics

__all__ = [
    "HARM_RATIO",
    "RESULTS_FILE",
    "RESULTS_SCHEMA",
    "RESULTS_VERSION",
    "file_sha256",
    "format_count",
    "format_seconds",
    "load_results",
    "p95_ratio",
    "path_sha256",
    "render_table",
    "tree_sha256",
    "write_results",
]

RESULTS_SCHEMA = "turnstile-results"
RESULTS_VERSION = 1
RESULTS_FILE = "results.json"
_CHUNK = 1 << 20


# ----------------------------------------------------------------------- formatting
def format_seconds(s: float | None) -> str:
    """``850 µs``, ``12.3 ms``, ``4.56 s``, ``12.5 min``, ``3.20 h``; ``–`` for None."""
    if s is None or not math.isfinite(s):
        return "–"
    a = abs(s)
    if a == 0:
        return "0 s"
    if a < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if a < 1.0:
        return f"{s * 1e3:.3g} ms"
    if a < 120.0:
        return f"{s:.3g} s"
    if a < 7200.0:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def format_count(x: float | None) -> str:
    """``950``, ``12.3k``, ``4.56M``, ``7.8G``; ``–`` for None."""
    if x is None or not math.isfinite(x):
        return "–"
    a = abs(x)
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _get(metrics: Mapping[str, Any], *path: str) -> Any:
    cur: Any = metrics
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur:
            return None
        cur = cur[key]
    return cur


def p95_ratio(first_p95: float | None, p95: float | None) -> float | None:
    """``first / this`` P95 flow time (> 1: this policy's tail is better); None if undefined."""
    if first_p95 is None or p95 is None or p95 <= 0:
        return None
    return first_p95 / p95


#: a ratio vs the first row below this is flagged (red): this policy is worse than the
#: baseline by more than the 3% the no-harm goal allows
HARM_RATIO = 0.97


def _ratio_cell(ratio: float | None) -> str:
    if ratio is None:
        return "–"
    text = f"{ratio:.2f}×"
    return f"[bold red]{text}[/]" if ratio < HARM_RATIO else text


def render_table(
    results: Sequence[Mapping[str, Any]],
    console: Console | None = None,
    *,
    title: str | None = None,
) -> Table:
    """Print one row per policy (in the given order) and return the table.

    "P95 vs first" is the first row's P95 flow time divided by this row's: > 1 means this
    policy's tail is better than the first (the baseline, by convention). "mean vs first" and
    "TTFT P95 vs first" are the same ratio for the mean flow time and the TTFT P95: a policy can
    keep the flow tail while its median or its first tokens suffer. A ratio below
    :data:`HARM_RATIO` is printed in red.
    """
    table = Table(title=title, header_style="bold")
    # the policy spec is never cut: the numeric columns' headers wrap instead
    width = max((len(str(r.get("policy", ""))) for r in results), default=6)
    table.add_column("policy", style="bold", no_wrap=True, min_width=width)
    for name in ("flow P50", "flow P95", "flow P99", "flow mean", "TTFT P95"):
        table.add_column(name, justify="right")
    table.add_column("hit rate", justify="right")
    table.add_column("recomputed tok", justify="right")
    table.add_column("out tok/s", justify="right")
    for name in ("P95 vs first", "mean vs first", "TTFT P95 vs first"):
        table.add_column(name, justify="right")
    first: tuple[Any, Any, Any] = (None, None, None)
    for i, result in enumerate(results):
        m = result.get("metrics", {})
        flow = m.get("flow_time_s", {}) or {}
        p95, mean, ttft = flow.get("p95"), flow.get("mean"), _get(m, "ttft_s", "p95")
        if i == 0:
            first = (p95, mean, ttft)
        table.add_row(
            str(result.get("policy", f"#{i}")),
            format_seconds(flow.get("p50")),
            format_seconds(p95),
            format_seconds(flow.get("p99")),
            format_seconds(mean),
            format_seconds(ttft),
            _pct(m.get("prefix_hit_rate")),
            format_count(m.get("recomputed_prefill_tokens")),
            format_count(_get(m, "throughput", "output_tokens_per_s")),
            *(_ratio_cell(p95_ratio(f, v)) for f, v in zip(first, (p95, mean, ttft),
                                                            strict=True)),
        )
    (console or Console()).print(table)
    return table


# --------------------------------------------------------------------------- hashing
def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tree_sha256(
    root: str | os.PathLike[str], *, exclude: Collection[str] = ("__pycache__", ".git")
) -> str:
    """Hex SHA-256 of a directory: every regular file, by sorted relative POSIX path.

    The digest covers each file's relative path and contents (a rename or a moved byte changes
    it; timestamps and permissions do not). Names in ``exclude`` are skipped at any depth.
    Symlinks to files are followed; directory symlinks are not descended.
    """
    base = Path(root)
    files: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in exclude]
        for name in filenames:
            if name in exclude:
                continue
            full = os.path.join(dirpath, name)
            if os.path.isfile(full):
                files.append((Path(full).relative_to(base).as_posix(), full))
    files.sort()
    h = hashlib.sha256()
    for rel, full in files:
        rel_bytes = rel.encode()
        h.update(len(rel_bytes).to_bytes(8, "little"))
        h.update(rel_bytes)
        h.update(bytes.fromhex(file_sha256(full)))
    return h.hexdigest()


def path_sha256(path: str | os.PathLike[str]) -> str:
    """:func:`file_sha256` of a file, :func:`tree_sha256` of a directory."""
    return tree_sha256(path) if os.path.isdir(path) else file_sha256(path)


# --------------------------------------------------------------------------- results
def _jsonable(obj: Any) -> Any:
    """``json.dumps`` fallback: numpy scalars/arrays and paths."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def write_results(
    out_dir: str | os.PathLike[str],
    results: Sequence[Mapping[str, Any]],
    config: Mapping[str, Any],
    trace_info: Mapping[str, Any],
    *,
    simulated: bool = True,
) -> Path:
    """Write ``out_dir/results.json`` (see the module docstring) and return its path.

    ``simulated`` must be False for real-engine runs (the simulator's results are labelled).
    Private sample keys (``_…``) are dropped; the file is written atomically.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = dict(trace_info)
    trace_path = trace.get("path")
    if trace_path is not None:
        trace["path"] = os.fspath(trace_path)
        if "sha256" not in trace and os.path.exists(trace_path):
            trace["sha256"] = path_sha256(trace_path)
    doc = {
        "schema": RESULTS_SCHEMA,
        "version": RESULTS_VERSION,
        "turnstile_version": __version__,
        "simulated": simulated,
        "config": public_metrics(config),
        "trace": public_metrics(trace),
        "policies": [public_metrics(r) for r in results],
    }
    path = out / RESULTS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(
        json.dumps(doc, indent=2, default=_jsonable, allow_nan=False) + "\n", encoding="utf-8"
    )
    tmp.replace(path)
    return path


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``results.json`` (or the one in a directory), checking schema and version."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS_FILE
    doc: dict[str, Any] = json.loads(p.read_text(encoding="utf-8"))
    if doc.get("schema") != RESULTS_SCHEMA:
        raise ValueError(f"{p}: not a {RESULTS_SCHEMA} file (schema={doc.get('schema')!r})")
    if doc.get("version") != RESULTS_VERSION:
        raise ValueError(f"{p}: unsupported version {doc.get('version')!r}")
    return doc
