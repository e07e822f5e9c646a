"""Simulator fidelity, the comparing half: latencies of a run, relative errors, the report.

* :class:`Observed` / :func:`observe`: per-turn TTFT and E2E and per-workflow flow time of one run
  (real or simulated), from scheduler records;
* :func:`compare` pairs turns and workflows of two runs and returns relative errors;
* :func:`render_markdown`, :func:`plot_scatter` and :func:`write_report` report them.

:mod:`turnstile.calibrate.fidelity` produces the runs (real replays and simulations).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.core.state import WorkflowRecord

__all__ = [
    "Observed",
    "compare",
    "observe",
    "plot_scatter",
    "render_markdown",
    "strip_pairs",
    "write_report",
]


@dataclass
class Observed:
    """Per-turn and per-workflow latencies of one run (real or simulated)."""

    ttft: dict[tuple[str, int], float] = field(default_factory=dict)
    e2e: dict[tuple[str, int], float] = field(default_factory=dict)
    flow: dict[str, float] = field(default_factory=dict)


def observe(records: Sequence[WorkflowRecord]) -> Observed:
    """Latencies from scheduler records (docs/design.md's definitions: TTFT and E2E from ready)."""
    o = Observed()
    for wf in records:
        last = -1.0
        complete = bool(wf.turns)
        for t in wf.turns:
            if t.finished_s < 0 or t.ready_s < 0:
                complete = False
                continue
            if t.first_token_s >= 0:
                o.ttft[(wf.id, t.index)] = t.first_token_s - t.ready_s
            o.e2e[(wf.id, t.index)] = t.finished_s - t.ready_s
            last = max(last, t.finished_s)
        if complete:
            o.flow[wf.id] = last - wf.arrival_s
    return o


def _stats(errs: Sequence[float]) -> dict[str, float | int | None]:
    if not errs:
        return {"n": 0, "median": None, "p90": None}
    a = np.asarray(errs)
    return {"n": int(a.size), "median": float(np.median(a)), "p90": float(np.percentile(a, 90))}


def compare(real: Observed, pred: Observed) -> dict[str, Any]:
    """Relative errors ``|pred − real| / real`` of TTFT, E2E (per turn) and flow time, with the
    pairs for plots (``pairs[metric] = [(real, pred), ...]``) and the signed median bias."""
    out: dict[str, Any] = {"pairs": {}}
    for name in ("ttft", "e2e", "flow"):
        r: Mapping[Any, float] = getattr(real, name)
        p: Mapping[Any, float] = getattr(pred, name)
        keys = [k for k in r if k in p and r[k] > 0]
        pairs = [(r[k], p[k]) for k in keys]
        errs = [abs(b - a) / a for a, b in pairs]
        st = _stats(errs)
        st["bias"] = float(np.median([(b - a) / a for a, b in pairs])) if pairs else None
        st["real_p50_s"] = float(np.median([a for a, _ in pairs])) if pairs else None
        st["pred_p50_s"] = float(np.median([b for _, b in pairs])) if pairs else None
        out[name] = st
        out["pairs"][name] = pairs
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{100 * v:.1f}%"


def _sec(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def render_markdown(rows: Sequence[Mapping[str, Any]], *, goal: float = 0.10) -> str:
    """A table: one row per (perf model, rate), median / P90 relative error per metric.

    ``rows`` items: ``{"model": str, "rate": float | "all", "errors": compare(...)}``.
    """
    head = (
        "| perf model | rate (sessions/s) | turns | TTFT med | TTFT P90 | E2E med | E2E P90 "
        "| workflows | flow med | flow P90 | TTFT p50 real / pred | E2E p50 real / pred |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for row in rows:
        e = row["errors"]
        rate = row["rate"]
        rate_s = rate if isinstance(rate, str) else f"{rate:g}"
        lines.append(
            f"| {row['model']} | {rate_s} | {e['ttft']['n']} | {_pct(e['ttft']['median'])} "
            f"| {_pct(e['ttft']['p90'])} | {_pct(e['e2e']['median'])} | {_pct(e['e2e']['p90'])} "
            f"| {e['flow']['n']} | {_pct(e['flow']['median'])} | {_pct(e['flow']['p90'])} "
            f"| {_sec(e['ttft']['real_p50_s'])} / {_sec(e['ttft']['pred_p50_s'])} "
            f"| {_sec(e['e2e']['real_p50_s'])} / {_sec(e['e2e']['pred_p50_s'])} |"
        )
    text = head + "\n".join(lines) + "\n"
    met = [
        r
        for r in rows
        if r["rate"] == "all"
        and all(
            r["errors"][m]["median"] is not None and r["errors"][m]["median"] <= goal
            for m in ("ttft", "e2e")
        )
    ]
    names = sorted({str(r["model"]) for r in met})
    verdict = ", ".join(names) if names else "none"
    text += (
        f"\nGoal: median TTFT and E2E error ≤ {100 * goal:.0f}% over all rates. "
        f"Met by: {verdict}.\n"
    )
    return text


_OTHER_COLORS = ("tab:red", "0.45", "tab:orange")


def plot_scatter(
    results: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    title: str = "Simulator vs real engine",
) -> Path:
    """Predicted vs measured, one panel per metric, log-log: the first model one series per
    rate, every other model (the roofline, the real rerun) one series."""
    from turnstile.bench.plots import pyplot

    plt = pyplot()
    metrics = (("ttft", "TTFT per turn (s)"), ("e2e", "E2E per turn (s)"),
               ("flow", "workflow flow time (s)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    markers = {0: "o", 1: "x", 2: "^", 3: "s"}
    models = list(dict.fromkeys(str(r["model"]) for r in results))
    cmap = plt.get_cmap("viridis")
    rates = sorted({float(r["rate"]) for r in results if not isinstance(r["rate"], str)})
    for ax, (key, metric_label) in zip(axes, metrics, strict=True):
        lo, hi = math.inf, 0.0
        for r in results:
            if isinstance(r["rate"], str):
                continue
            pairs = r["errors"]["pairs"][key]
            if not pairs:
                continue
            a = np.array(pairs, dtype=float)
            a = a[(a[:, 0] > 0) & (a[:, 1] > 0)]
            if a.size == 0:
                continue
            lo, hi = min(lo, a.min()), max(hi, a.max())
            m = models.index(str(r["model"]))
            color: Any
            label: str | None
            if m == 0:  # the fitted model: one colour per rate
                ci = rates.index(float(r["rate"])) / max(1, len(rates) - 1)
                color, label = cmap(0.85 * ci), f"{r['model']} @ {r['rate']:g}/s"
            else:  # comparisons: one colour per model, labelled once
                color = _OTHER_COLORS[(m - 1) % len(_OTHER_COLORS)]
                label = str(r["model"]) if float(r["rate"]) == rates[0] else None
            ax.scatter(a[:, 0], a[:, 1], s=14, alpha=0.6, marker=markers.get(m, "o"),
                       color=color, label=label)
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], "k--", lw=1)
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85",
                            alpha=0.5, lw=0, label="±10%")
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"measured {metric_label}")
        ax.set_ylabel(f"predicted {metric_label}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def strip_pairs(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report without the per-sample pairs (for a compact JSON file)."""
    out = dict(report)
    out["rows"] = [
        {**r, "errors": {k: v for k, v in r["errors"].items() if k != "pairs"}}
        for r in report["rows"]
    ]
    return out


def write_report(out: Path, report: Mapping[str, Any], title: str) -> str:
    """Write ``fidelity.md``, ``fidelity.json``, ``fidelity_pairs.json`` (every measured /
    predicted pair, to redraw the plot or recompute other statistics) and the scatter plot into
    ``out``; returns the markdown table."""
    import json

    md = render_markdown(report["rows"])
    if report.get("steadiness"):  # whether the host was quiet enough to judge the model
        md += "\n" + report["steadiness"]["verdict"] + "\n"
    (out / "fidelity.md").write_text(md)
    (out / "fidelity.json").write_text(json.dumps(strip_pairs(report), indent=2, default=str))
    (out / "fidelity_pairs.json").write_text(json.dumps(
        [{"model": r["model"], "rate": r["rate"], "pairs": r["errors"]["pairs"]}
         for r in report["rows"]]))
    plot_scatter(report["rows"], out / "fidelity_scatter.png", title=title)
    return md
