"""The robustness suite's report: cells with their ratios vs eager, the no-harm verdict per
policy, a markdown table, a heat map and ``results.json``.

Ratios are eager / policy (> 1: the policy is better than eager) for the P95 flow time, the
mean flow time and the TTFT P95. *No harm* (docs/design.md's goal): in every cell the policy's
P95 and mean flow time are at most 3% above eager's and its TTFT P95 at most 10% above, i.e. the
ratios are ≥ 1/1.03 and ≥ 1/1.10.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CONTENTION_SHARE",
    "NO_HARM",
    "cells_from_runs",
    "finite",
    "gains",
    "markdown_report",
    "no_harm",
    "plot_heatmap",
    "write_suite",
]

#: worst allowed policy / eager: P95 and mean flow time +3%, TTFT P95 +10%
NO_HARM = {"p95": 1.03, "mean": 1.03, "ttft_p95": 1.10}
#: a cell is *contended* where eager's queueing + recompute is at least this share of its flow
#: time; the goal there is >= 2x eager's P95 (issue 31)
CONTENTION_SHARE = 0.50
_METRIC = {"p95": "flow_p95_s", "mean": "flow_mean_s", "ttft_p95": "ttft_p95_s"}


def _ratio(base: float | None, value: float | None) -> float | None:
    if base is None or value is None:
        return None
    if value <= 0:
        return 1.0 if base <= 0 else None
    return base / value


def cells_from_runs(runs: Sequence[Mapping[str, Any]], policies: Sequence[str]
                    ) -> list[dict[str, Any]]:
    """Group runs by (family, cluster, load); per policy its summary and its ratios vs eager.
    Cells are ordered by family, cluster and load."""
    by: dict[tuple[str, str, str], dict[str, Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["family"], r["cluster"], r["load"]), {})[r["policy"]] = r
    cells = []
    for (fam, cl, load), per in sorted(by.items()):
        eager = per.get("eager")
        any_run = next(iter(per.values()))
        cell: dict[str, Any] = {
            "family": fam, "cluster": cl, "load": load, "basis": any_run["basis"],
            "factor": any_run["factor"], "intensity": any_run["intensity"],
            "workflows": any_run["workflows"], "policies": {},
        }
        if eager is not None:
            cell["eager_queue_share"] = eager["queue_share"]
            cell["eager_recompute_share_est"] = eager["recompute_share_est"]
            cell["contended"] = (eager["queue_share"] + eager["recompute_share_est"]
                                 >= CONTENTION_SHARE)
        for pol in policies:
            r = per.get(pol)
            if r is None:
                continue
            entry = {k: v for k, v in r.items()
                     if k not in ("family", "cluster", "load", "basis", "factor", "intensity",
                                  "policy", "workflows")}
            if eager is not None:
                entry["ratio"] = {k: _ratio(eager[m], r[m]) for k, m in _METRIC.items()}
            cell["policies"][pol] = entry
        cells.append(cell)
    return cells


def no_harm(cells: Sequence[Mapping[str, Any]], policy: str,
            splits: Mapping[str, str] | None = None, split: str | None = None
            ) -> dict[str, Any]:
    """The worst cell of ``policy`` per ratio, and the cells that break :data:`NO_HARM`
    (optionally only the families of one ``split``)."""
    worst: dict[str, Any] = {}
    misses: list[dict[str, Any]] = []
    for c in cells:
        if split is not None and splits is not None and splits.get(c["family"]) != split:
            continue
        entry = c["policies"].get(policy)
        if entry is None or "ratio" not in entry:
            continue
        bad = {}
        for k, r in entry["ratio"].items():
            if r is None:
                continue
            where = f"{c['family']} · {c['cluster']} · {c['load']}"
            if k not in worst or r < worst[k]["ratio"]:
                worst[k] = {"ratio": r, "cell": where}
            if r < 1.0 / NO_HARM[k] - 1e-12:
                bad[k] = r
        if bad:
            misses.append({"family": c["family"], "cluster": c["cluster"], "load": c["load"],
                           "ratios": bad})
    return {"policy": policy, "worst": worst, "misses": misses, "ok": not misses}


def gains(cells: Sequence[Mapping[str, Any]], policy: str, target: float = 2.0
          ) -> dict[str, Any]:
    """``policy``'s P95 ratio in the contended cells (eager's queueing + recompute >=
    :data:`CONTENTION_SHARE` of flow time): each cell's ratio, how many reach ``target``, and
    their geometric mean."""
    rows = []
    for c in cells:
        share = (c.get("eager_queue_share") or 0) + (c.get("eager_recompute_share_est") or 0)
        r = c["policies"].get(policy, {}).get("ratio", {}).get("p95")
        if share >= CONTENTION_SHARE and r:
            rows.append({"family": c["family"], "cluster": c["cluster"], "load": c["load"],
                         "share": share, "p95": r})
    geo = math.exp(sum(math.log(x["p95"]) for x in rows) / len(rows)) if rows else None
    return {"policy": policy, "cells": rows, "met": sum(x["p95"] >= target for x in rows),
            "geomean": geo}


def _fmt(r: float | None) -> str:
    if r is None:
        return "–"
    return f"{r:.2f}"


def not_reached(doc: Mapping[str, Any]) -> set[tuple[str, str]]:
    """(family, cluster) pairs whose saturation search never passed the threshold."""
    return {(s["family"], s["cluster"]) for s in doc.get("saturation", []) if not s["found"]}


def markdown_report(doc: Mapping[str, Any]) -> str:
    """Per split: one table row per cell (P95 / mean / TTFT-P95 ratios of each policy), then
    the no-harm table (the worst cell per policy and ratio)."""
    pols = [p for p in doc["config"]["policies"] if p != "eager"]
    splits = {f["name"]: f["split"] for f in doc["families"]}
    nr = not_reached(doc)
    lines = [f"# Robustness suite `{doc['suite']}` (simulated)", "",
             f"Ratios are eager / policy (> 1: better than eager): P95 flow / mean flow / TTFT "
             f"P95. **Bold**: worse than the no-harm bound (P95, mean > +3%, TTFT > +10%). "
             f"Loads: `sat×f` = f × the measured saturation point (eager's queueing + "
             f"recompute > {doc['config']['saturation_queue_share']:.0%} of flow time), "
             f"`est×f` = f × the capacity estimate. "
             f"Default policy: `{doc['config']['default_policy']}`. "
             f"Backend {doc['backend']}, {doc['wall_s']:.0f} s. `sat×f*`: the search never "
             f"saw eager saturate (the cell's sessions, all in flight at once, do not contend "
             f"enough): those loads are multiples of the highest rate probed, in effect a "
             f"batch arrival, not a measured point.", ""]
    for split in ("tune", "report"):
        cells = [c for c in doc["cells"] if splits.get(c["family"]) == split]
        if not cells:
            continue
        lines += [f"## {split} half", "",
                  "| family | cluster | load | eager P95 | eager queue+recompute | "
                  + " | ".join(pols) + " |",
                  "|---|---|---|---:|---:|" + "---:|" * len(pols)]
        for c in cells:
            eager = c["policies"].get("eager", {})
            share = (c.get("eager_queue_share") or 0) + (c.get("eager_recompute_share_est") or 0)
            star = "*" if c["basis"] == "measured" and (c["family"], c["cluster"]) in nr else ""
            row = [c["family"], c["cluster"], c["load"] + star,
                   f"{eager.get('flow_p95_s') or 0:.0f} s", f"{share:.0%}"]
            for p in pols:
                ratio = c["policies"].get(p, {}).get("ratio")
                if not ratio:
                    row.append("–")
                    continue
                parts = []
                for k in ("p95", "mean", "ttft_p95"):
                    r = ratio[k]
                    txt = _fmt(r)
                    parts.append(f"**{txt}**" if r is not None and r < 1 / NO_HARM[k] else txt)
                row.append(" / ".join(parts))
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", f"### No harm ({split} half): worst cell per policy", "",
                  "| policy | worst P95 ratio | worst mean ratio | worst TTFT-P95 ratio | "
                  "cells missing |", "|---|---|---|---|---:|"]
        for p in pols:
            nh = no_harm(cells, p)
            w = nh["worst"]
            cols = [f"{_fmt(w[k]['ratio'])} ({w[k]['cell']})" if k in w else "–"
                    for k in ("p95", "mean", "ttft_p95")]
            lines.append(f"| {p} | " + " | ".join(cols) + f" | {len(nh['misses'])} |")
        lines += ["", f"### Gains where contention is ({split} half): P95 ratio in the cells "
                  f"where eager's queueing + recompute >= {CONTENTION_SHARE:.0%} of flow", ""]
        if not any(gains(cells, p)["cells"] for p in pols):
            lines += ["No contended cell in this half.", ""]
            continue
        lines += ["| policy | cells >= 2x | geometric mean | worst |", "|---|---:|---:|---|"]
        for p in pols:
            g = gains(cells, p)
            if not g["cells"]:
                continue
            w = min(g["cells"], key=lambda x: x["p95"])
            lines.append(f"| {p} | {g['met']} of {len(g['cells'])} | {g['geomean']:.2f} | "
                         f"{w['p95']:.2f} ({w['family']} · {w['cluster']} · {w['load']}) |")
        lines.append("")
    if doc.get("skipped"):
        lines += ["Skipped (input absent): " + ", ".join(
            f"{s['family']} ({s['why']})" for s in doc["skipped"]), ""]
    lines += ["## Saturation points (eager, measured)", "",
              "| family | cluster | estimate | measured | unit | probes (intensity: eager's "
              "queue + recompute share of flow time) |",
              "|---|---|---:|---:|---|---|"]
    for s in doc["saturation"]:
        probes = ", ".join(f"{p['intensity']:.3g}: {p['queue_recompute_share']:.0%}"
                           for p in s["probes"])
        found = "" if s["found"] else " (not reached)"
        lines.append(f"| {s['family']} | {s['cluster']} | {s['estimate']:.3g} | "
                     f"{s['saturation']:.3g}{found} | {s['unit']} | {probes} |")
    return "\n".join(lines) + "\n"


def plot_heatmap(doc: Mapping[str, Any], path: str | Path) -> Path:
    """One panel per non-eager policy: rows (family · cluster), columns loads; colour = P95
    ratio vs eager on a log scale (green better, red worse), text = P95 / mean / TTFT ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    pols = [p for p in doc["config"]["policies"] if p != "eager"]
    splits = {f["name"]: f["split"] for f in doc["families"]}
    rows = sorted({(splits.get(c["family"], ""), c["family"], c["cluster"])
                   for c in doc["cells"]})
    loads = [lp["basis"] for lp in doc["config"]["loads"]]  # keep config order
    labels = [("sat" if lp["basis"] == "measured" else "est") + f"×{lp['factor']:g}"
              for lp in doc["config"]["loads"]]
    del loads
    index = {(c["family"], c["cluster"], c["load"]): c for c in doc["cells"]}
    nr = not_reached(doc)
    fig_h = max(3.0, 0.42 * len(rows) + 1.6)
    fig, axes = plt.subplots(1, max(1, len(pols)), figsize=(4.2 * max(1, len(pols)) + 2.5,
                                                             fig_h), squeeze=False)
    norm = TwoSlopeNorm(vmin=-1.5, vcenter=0.0, vmax=1.5)  # log2 of the P95 ratio
    for ax, pol in zip(axes[0], pols, strict=False):
        grid = np.full((len(rows), len(labels)), np.nan)
        for i, (_s, fam, cl) in enumerate(rows):
            for j, lab in enumerate(labels):
                c = index.get((fam, cl, lab))
                ratio = (c or {}).get("policies", {}).get(pol, {}).get("ratio")
                if not ratio:
                    continue
                p95 = ratio["p95"]
                if p95 is not None and p95 > 0 and math.isfinite(p95):
                    grid[i, j] = math.log2(p95)
                text = "\n".join(_fmt(ratio[k]) for k in ("p95", "mean", "ttft_p95"))
                ax.text(j, i, text, ha="center", va="center", fontsize=5.5)
        ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_yticks(range(len(rows)), [f"[{s[0]}] {f} · {c}" + (" (sat n/r)" if (f, c) in nr
                                                                    else "")
                                         for s, f, c in rows]
                      if ax is axes[0][0] else [], fontsize=6.5)
        ax.set_title(pol, fontsize=9)
    fig.suptitle(f"Robustness suite '{doc['suite']}' (simulated): eager / policy, "
                 "P95 · mean · TTFT-P95 per cell; colour = P95 ratio "
                 "(green better, red worse; [t]une / [r]eport half)", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def write_suite(doc: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``results.json``, ``robustness.md``, ``report.html`` (the heat map in one file, no
    extra needed) and, with the ``plots`` extra, ``heatmap.png`` in ``out_dir``."""
    from turnstile.bench.html_report import write_html_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = out / "results.json"
    res.write_text(json.dumps(finite(doc), separators=(",", ":"), allow_nan=False,
                              default=str) + "\n", encoding="utf-8")
    md = out / "robustness.md"
    md.write_text(markdown_report(doc), encoding="utf-8")
    paths = {"results": res, "markdown": md,
             "report": write_html_report(out, finite(doc), title="turnstile robustness suite "
                                         f"'{doc.get('suite', '')}'")}
    with contextlib.suppress(ImportError):  # matplotlib is the plots extra; report.html has
        paths["heatmap"] = plot_heatmap(doc, out / "heatmap.png")  # the heat map anyway
    return paths
