"""PNG plots for reports. matplotlib is imported inside each function (Agg backend), so
importing :mod:`turnstile.bench` (and starting the CLI) stays fast.

Simulated results must say so: with ``simulated=True`` (the default) every title gets a
"(simulated)" suffix unless it already mentions it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.bench.metrics import quantile
from turnstile.bench.report import axis_unit, format_seconds

__all__ = ["flow_times_of", "plot_flow_cdf", "plot_load_sweep", "pyplot"]

#: ``sweep[policy]`` = ``[(arrival rate, P95 flow time, mean flow time), ...]``
SweepPoint = tuple[float, float | None, float | None]


def _title(title: str, simulated: bool) -> str:
    if simulated and "simulated" not in title.lower():
        return f"{title} (simulated)"
    return title


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or an ImportError saying which extra to install
    (matplotlib is the optional ``plots`` extra: a gateway install does not need it)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("PNG plots need matplotlib: pip install 'turnstile[plots]' "
                          "(report.html has the same figures without it)") from None

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def flow_times_of(result: Mapping[str, Any]) -> list[float]:
    """Per-workflow flow times of a result (``metrics["_flow_times_s"]``); [] when absent."""
    metrics = result.get("metrics", {})
    samples = metrics.get("_flow_times_s", result.get("_flow_times_s"))
    return list(samples) if samples is not None else []


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out


def plot_flow_cdf(
    results: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    title: str = "Workflow flow time",
    *,
    simulated: bool = True,
    log_x: bool | None = None,
) -> Path:
    """One empirical CDF line of workflow flow time per policy; a dotted line marks P95.

    Needs the private ``_flow_times_s`` samples of :func:`compute_metrics` (results straight
    from a run, not re-read from ``results.json``); policies without samples are listed in the
    legend as "(no data)". ``log_x`` defaults to a log axis when the samples span > 2 decades.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lo, hi = np.inf, 0.0
    for i, result in enumerate(results):
        name = str(result.get("policy", f"#{i}"))
        x = np.sort(np.asarray(flow_times_of(result), dtype=np.float64))
        if x.size == 0:
            ax.plot([], [], label=f"{name} (no data)")
            continue
        y = np.arange(1, x.size + 1) / x.size
        ax.step(x, y, where="post", label=f"{name} (P95 {format_seconds(quantile(x, 95))})")
        positive = x[x > 0]
        if positive.size:
            lo, hi = min(lo, float(positive[0])), max(hi, float(positive[-1]))
    if log_x is None:
        log_x = np.isfinite(lo) and hi / lo > 100.0
    if log_x:
        ax.set_xscale("log")
    ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
    unit, per = axis_unit(hi)  # the axis in one unit, as report.html's
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v / per:.3g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda _v, _pos: ""))
    ax.set_xlabel(f"workflow flow time ({unit})")
    ax.set_ylabel("fraction of workflows")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(_title(title, simulated))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return _save(fig, path)


def plot_load_sweep(
    sweep: Mapping[str, Sequence[SweepPoint]],
    path: str | os.PathLike[str],
    metric_label: str = "workflow flow time (s)",
    *,
    title: str = "Flow time vs load",
    x_label: str = "arrival rate (workflows/s)",
    simulated: bool = True,
    log_y: bool = False,
) -> Path:
    """P95 (solid) and mean (dashed) vs load, one colour per policy. None values are skipped."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    for i, (policy, points) in enumerate(sweep.items()):
        color = colors[i % len(colors)]
        pts = sorted(points, key=lambda p: p[0])
        for col, style, label in ((1, "-", "P95"), (2, "--", "mean")):
            xs = [p[0] for p in pts if p[col] is not None]
            ys = [p[col] for p in pts if p[col] is not None]
            ax.plot(xs, ys, style, marker="o", markersize=3, color=color, label=f"{policy} {label}")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel(metric_label)
    ax.set_title(_title(title, simulated))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    return _save(fig, path)
