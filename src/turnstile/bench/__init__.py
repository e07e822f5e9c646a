"""Metrics, side-by-side reports, plots and evidence records, shared by every driver.

``compute_metrics`` turns a run's workflow records into one JSON-ready dict (plus private
``_flow_times_s`` samples for plots); ``render_table`` prints policies side by side;
``write_results`` writes ``results.json`` (private samples stripped); ``plot_*`` draw PNGs
(matplotlib is imported only when a plot is drawn).
"""

from turnstile.bench.metrics import (
    ENGINE_STAT_KEYS,
    PRIVATE_PREFIX,
    compute_metrics,
    public_metrics,
    summarize,
)
from turnstile.bench.plots import flow_times_of, plot_flow_cdf, plot_load_sweep
from turnstile.bench.report import (
    RESULTS_FILE,
    RESULTS_SCHEMA,
    RESULTS_VERSION,
    file_sha256,
    format_count,
    format_seconds,
    load_results,
    p95_ratio,
    path_sha256,
    render_table,
    tree_sha256,
    write_results,
)

__all__ = [
    "ENGINE_STAT_KEYS",
    "PRIVATE_PREFIX",
    "RESULTS_FILE",
    "RESULTS_SCHEMA",
    "RESULTS_VERSION",
    "compute_metrics",
    "file_sha256",
    "flow_times_of",
    "format_count",
    "format_seconds",
    "load_results",
    "p95_ratio",
    "path_sha256",
    "plot_flow_cdf",
    "plot_load_sweep",
    "public_metrics",
    "render_table",
    "summarize",
    "tree_sha256",
    "write_results",
]
