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
    "RATIO_COLUMNS",
    "RESULTS_FILE",
    "RESULTS_SCHEMA",
    "RESULTS_VERSION",
    "axis_unit",
    "file_sha256",
    "format_count",
    "format_ratio",
    "format_seconds",
    "load_results",
    "p95_ratio",
    "path_sha256",
    "ratios_vs_first",
    "render_table",
    "results_header",
    "tree_sha256",
    "workload_line",
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


#: (unit, seconds per unit) of :func:`format_seconds`, from the largest down
_UNITS = (("h", 3600.0, 7200.0), ("min", 60.0, 120.0), ("s", 1.0, 1.0), ("ms", 1e-3, 1e-3),
          ("µs", 1e-6, 0.0))


def axis_unit(largest_s: float) -> tuple[str, float]:
    """One unit for a whole time axis whose largest value is ``largest_s`` seconds: the unit
    :func:`format_seconds` gives that value; returns ``(unit, seconds per unit)``."""
    a = abs(largest_s) if math.isfinite(largest_s) else 0.0
    if a == 0:
        return "s", 1.0
    for unit, per, from_s in _UNITS:
        if a >= from_s:
            return unit, per
    return "s", 1.0


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


#: the three ratio columns of every summary (terminal, report.html)
RATIO_COLUMNS = ("P95 vs first", "mean vs first", "TTFT P95 vs first")


def ratios_vs_first(results: Sequence[Mapping[str, Any]]) -> list[list[float | None]]:
    """Per result: first / this for the P95 flow time, the mean flow time and the TTFT P95
    (:data:`RATIO_COLUMNS`); a ratio below :data:`HARM_RATIO` is a harm (shown red)."""
    def key(m: Mapping[str, Any]) -> tuple[Any, Any, Any]:
        flow = m.get("flow_time_s", {}) or {}
        return flow.get("p95"), flow.get("mean"), _get(m, "ttft_s", "p95")

    rows = [key(r.get("metrics", {}) or {}) for r in results]
    if not rows:
        return []
    return [[p95_ratio(f, v) for f, v in zip(rows[0], row, strict=True)] for row in rows]


def format_ratio(ratio: float | None) -> str:
    """``1.04×``; ``–`` for None."""
    return "–" if ratio is None else f"{ratio:.2f}×"


def _ratio_cell(ratio: float | None) -> str:
    text = format_ratio(ratio)
    return f"[bold red]{text}[/]" if ratio is not None and ratio < HARM_RATIO else text


def workload_line(n: int, trace_info: Mapping[str, Any]) -> str:
    """What was simulated, in one line: ``200 workflows from NAME (0.5 workflows/s, synthetic
    sessions ... on seeded Poisson arrivals ...)``."""
    rate = trace_info.get("rate")
    rate_txt = f"{rate:.3g} workflows/s; " if rate else ""
    return f"{n} workflows from {trace_info.get('name')} ({rate_txt}{trace_info.get('arrivals')})"


def _min_width(name: str, cells: Sequence[str]) -> int:
    """The widest word of a header or its cells: a column wraps between words only."""
    from rich.text import Text

    words = [*name.split(), *(w for c in cells for w in Text.from_markup(c).plain.split())]
    return max(len(w) for w in words)


def _fitting(names: Sequence[str], widths: Sequence[int], room: int) -> list[list[int]]:
    """Column indices in consecutive groups that each fit ``room`` characters (3 a column
    for padding and rule)."""
    groups: list[list[int]] = [[]]
    used = 0
    for j, w in enumerate(widths):
        if groups[-1] and used + w + 3 > room:
            groups.append([])
            used = 0
        groups[-1].append(j)
        used += w + 3
    return groups


def render_table(
    results: Sequence[Mapping[str, Any]],
    console: Console | None = None,
    *,
    title: str | None = None,
) -> Table:
    """Print one row per policy (in the given order) and return the (whole) table.

    "P95 vs first" is the first row's P95 flow time divided by this row's: > 1 means this
    policy's tail is better than the first (the baseline, by convention). "mean vs first" and
    "TTFT P95 vs first" are the same ratio for the mean flow time and the TTFT P95: a policy can
    keep the flow tail while its median or its first tokens suffer. A ratio below
    :data:`HARM_RATIO` is printed in red. On a console too narrow for one table (80 columns)
    the columns come as several tables (the ratios in their own), so that no header or number
    is cut.
    """
    from rich.measure import Measurement

    con = console or Console()
    names = ("flow P50", "flow P95", "flow P99", "flow mean", "TTFT P95", "hit rate",
             "recomputed tok", "out tok/s", *RATIO_COLUMNS)
    rows = []
    for i, (result, ratios) in enumerate(zip(results, ratios_vs_first(results), strict=True)):
        m = result.get("metrics", {})
        flow = m.get("flow_time_s", {}) or {}
        rows.append([
            str(result.get("policy", f"#{i}")),
            *(format_seconds(flow.get(k)) for k in ("p50", "p95", "p99", "mean")),
            format_seconds(_get(m, "ttft_s", "p95")),
            _pct(m.get("prefix_hit_rate")),
            format_count(m.get("recomputed_prefill_tokens")),
            format_count(_get(m, "throughput", "output_tokens_per_s")),
            *(_ratio_cell(r) for r in ratios),
        ])
    # the policy spec is never cut: the numeric columns' headers wrap instead
    width = max((len(str(r.get("policy", ""))) for r in results), default=6)
    widths = [_min_width(n, [row[1 + j] for row in rows]) for j, n in enumerate(names)]

    def table_of(cols: Sequence[int], with_title: bool) -> Table:
        table = Table(title=title if with_title else None, header_style="bold")
        table.add_column("policy", style="bold", no_wrap=True, min_width=width)
        for j in cols:
            table.add_column(names[j], justify="right", min_width=widths[j])
        for row in rows:
            table.add_row(row[0], *(row[1 + j] for j in cols))
        return table

    whole = table_of(range(len(names)), True)
    if Measurement.get(con, con.options.update_width(10**6), whole).maximum <= con.width:
        con.print(whole)
        return whole
    room = con.width - width - 5
    n_values = len(names) - len(RATIO_COLUMNS)
    groups = [[j for j in g] for g in _fitting(names[:n_values], widths[:n_values], room)]
    groups += [[n_values + j for j in g]
               for g in _fitting(RATIO_COLUMNS, widths[n_values:], room)]
    for k, cols in enumerate(groups):
        con.print(table_of(cols, k == 0))
    return whole


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


def results_header(kind: str, *, simulated: bool) -> dict[str, Any]:
    """The header every ``results.json`` starts with (``bench``, ``replay``, ``rollout sim``):
    schema, version, the turnstile that wrote it, what wrote it and whether it is simulated."""
    return {"schema": RESULTS_SCHEMA, "version": RESULTS_VERSION, "turnstile_version": __version__,
            "kind": kind, "simulated": simulated}


def write_results(
    out_dir: str | os.PathLike[str],
    results: Sequence[Mapping[str, Any]],
    config: Mapping[str, Any],
    trace_info: Mapping[str, Any],
    *,
    simulated: bool = True,
    kind: str = "bench",
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
        **results_header(kind, simulated=simulated),
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
