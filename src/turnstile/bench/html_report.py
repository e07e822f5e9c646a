"""``report.html``: one self-contained file beside ``results.json`` (``bench``, ``replay``).

Everything is inline — the tables, the CDFs as inline SVG (drawn here, no matplotlib needed), the
robustness heat map as a coloured table when the document has suite cells — so the file can be
mailed, attached to a CI run or opened offline. Simulated documents say "simulated" in the title
and above every figure.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from turnstile.bench.detailed import TTFT_KEY
from turnstile.bench.metrics import quantile
from turnstile.bench.report import (
    HARM_RATIO,
    RATIO_COLUMNS,
    axis_unit,
    format_count,
    format_ratio,
    format_seconds,
    ratios_vs_first,
)

__all__ = ["REPORT_FILE", "cdf_svg", "heatmap_html", "html_table", "render_html",
           "write_html_report"]

REPORT_FILE = "report.html"
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")
_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;
color:#222;max-width:1100px}h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}th,td{border:1px solid #ccc;
padding:.25em .6em;text-align:right;white-space:nowrap}
th{background:#f3f3f3;white-space:normal}td.l,th.l{text-align:left;white-space:normal}
.note{color:#555;font-size:.9em}.sim{color:#a33;font-weight:600}svg{background:#fff}
td.harm{color:#c00;font-weight:700}"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


class Harm(str):
    """A cell shown red and bold (a ratio below :data:`HARM_RATIO`, as the terminal shows)."""


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1,
           cls: str = "") -> str:
    def cell(tag: str, i: int, v: Any) -> str:
        names = " ".join(n for n, on in (("l", i < left), ("harm", isinstance(v, Harm))) if on)
        attr = "" if not names else f" class={names}" if " " not in names else f' class="{names}"'
        return f"<{tag}{attr}>{_e(v)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>"
                   for r in rows)
    return f'<table{f" class={cls}" if cls else ""}><tr>{head}</tr>{body}</table>'


def html_table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """An HTML table of ``rows`` (escaped); the first ``left`` columns left-aligned."""
    return _table(header, rows, left)


def _ratio(ratio: float | None) -> str:
    text = format_ratio(ratio)
    return Harm(text) if ratio is not None and ratio < HARM_RATIO else text


def summary_rows(policies: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row per policy: the terminal table's columns and ratios (see ``render_table``)."""
    rows = []
    for i, (r, ratios) in enumerate(zip(policies, ratios_vs_first(policies), strict=True)):
        m = r.get("metrics", {}) or {}
        flow = m.get("flow_time_s", {}) or {}
        rows.append([str(r.get("policy", f"#{i}")), str(m.get("workflows", "–")),
                     *(format_seconds(flow.get(k)) for k in ("p50", "p95", "p99", "mean")),
                     format_seconds((m.get("ttft_s") or {}).get("p95")),
                     _pct(m.get("prefix_hit_rate")),
                     format_count(m.get("recomputed_prefill_tokens")),
                     format_count((m.get("throughput") or {}).get("output_tokens_per_s")),
                     *(_ratio(x) for x in ratios)])
    return rows


SUMMARY_HEADER = ("policy", "workflows", "flow P50", "flow P95", "flow P99", "flow mean",
                  "TTFT P95", "hit rate", "recomputed tok", "out tok/s", *RATIO_COLUMNS)


def cdf_svg(series: Mapping[str, Sequence[float]], *, xlabel: str, title: str,
            width: int = 960, height: int = 380) -> str:
    """An empirical CDF per series as inline SVG; a log x axis when the data span > 2 decades."""
    data = {k: sorted(float(v) for v in vs if v is not None and math.isfinite(v))
            for k, vs in series.items()}
    data = {k: v for k, v in data.items() if v}
    if not data:
        return '<p class="note">no samples to plot</p>'
    lo = min(v[0] for v in data.values())
    hi = max(v[-1] for v in data.values())
    pos = [x for v in data.values() for x in v if x > 0]
    log = bool(pos) and max(pos) / min(pos) > 100
    if log:
        lo = min(pos)
    if hi <= lo:
        hi = lo + 1.0
    ml, mr, mt, mb = 60, 330, 30, 45
    pw, ph = width - ml - mr, height - mt - mb

    def fx(x: float) -> float:
        if log:
            x = max(x, lo)
            return ml + pw * (math.log10(x) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        return ml + pw * (x - lo) / (hi - lo)

    def fy(y: float) -> float:
        return mt + ph * (1.0 - y)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}">',
             f'<text x="{ml}" y="18" font-size="13" font-weight="600">{_e(title)}</text>',
             f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for y in (0.0, 0.25, 0.5, 0.75, 0.95, 1.0):
        parts.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{fy(y):.1f}" y2="{fy(y):.1f}" '
                     f'stroke="#eee"/><text x="{ml - 6}" y="{fy(y) + 4:.1f}" font-size="10" '
                     f'text-anchor="end">{y:g}</text>')
    unit, per = axis_unit(hi)  # one unit for every tick (ticks at round numbers of it)
    lo_u, hi_u = lo / per, hi / per
    ticks = ([10.0 ** e * per for e in range(math.floor(math.log10(lo_u)),
                                             math.ceil(math.log10(hi_u)) + 1)]
             if log else [lo + (hi - lo) * k / 5 for k in range(6)])
    for t in ticks:
        if t < lo * (1 - 1e-9) or t > hi * (1 + 1e-9):
            continue
        parts.append(f'<line x1="{fx(t):.1f}" x2="{fx(t):.1f}" y1="{mt}" y2="{mt + ph}" '
                     f'stroke="#eee"/><text x="{fx(t):.1f}" y="{mt + ph + 14}" font-size="10" '
                     f'text-anchor="middle">{t / per:.3g}</text>')
    parts.append(f'<text x="{ml + pw / 2}" y="{height - 8}" font-size="11" '
                 f'text-anchor="middle">{_e(xlabel)} ({_e(unit)}'
                 f'{", log scale" if log else ""})</text>')
    for i, (name, xs) in enumerate(data.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        n = len(xs)
        step = max(1, n // 2000)  # at most ~2,000 vertices per line
        pts = [f"{fx(xs[0]):.1f},{fy(0.0):.1f}"]
        for j in range(0, n, step):
            k = min(n - 1, j + step - 1)
            pts.append(f"{fx(xs[k]):.1f},{fy(j / n):.1f} {fx(xs[k]):.1f},{fy((k + 1) / n):.1f}")
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" '
                     f'points="{" ".join(pts)}"/>')
        p95 = quantile(xs, 95)  # the tables' rule, so the legend and the table agree
        ly = mt + 14 + 16 * i
        parts.append(f'<line x1="{ml + pw + 10}" x2="{ml + pw + 28}" y1="{ly - 4}" '
                     f'y2="{ly - 4}" stroke="{colour}" stroke-width="2"/>'
                     f'<text x="{ml + pw + 32}" y="{ly}" font-size="10">{_e(name)} '
                     f'(P95 {_e(format_seconds(p95))})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _heat_colour(ratio: float | None) -> str:
    """Green when the policy is better than eager (ratio > 1), red when worse; log2 scale."""
    if ratio is None or ratio <= 0 or not math.isfinite(ratio):
        return "#ffffff"
    v = max(-1.5, min(1.5, math.log2(ratio))) / 1.5
    if v >= 0:
        r, g, b = int(255 - 155 * v), int(255 - 40 * v), int(255 - 155 * v)
    else:
        r, g, b = int(255 + 20 * v), int(255 + 155 * v), int(255 + 155 * v)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap_html(doc: Mapping[str, Any]) -> str:
    """The robustness suite's heat map (``doc["cells"]``): per non-eager policy, rows family ·
    cluster, columns loads, each cell the P95 ratio eager / policy (mean and TTFT-P95 below),
    coloured green (better) to red (worse). Empty when the document has no cells."""
    cells = doc.get("cells")
    if not cells:
        return ""
    pols = [p for p in (doc.get("config", {}) or {}).get("policies", []) if p != "eager"]
    if not pols:
        pols = sorted({p for c in cells for p in c.get("policies", {}) if p != "eager"})
    loads = list(dict.fromkeys(str(c.get("load")) for c in cells))
    rows = sorted({(str(c.get("family")), str(c.get("cluster"))) for c in cells})
    index = {(str(c.get("family")), str(c.get("cluster")), str(c.get("load"))): c for c in cells}
    out = ['<h2>Robustness: eager / policy per workload family, cluster and load '
           '<span class="sim">(simulated)</span></h2><p class="note">Each cell: P95 flow-time '
           'ratio (mean, TTFT P95 below); &gt; 1 means the policy beats eager. Green better, '
           'red worse.</p>']
    for pol in pols:
        head = "".join(f"<th>{_e(ld)}</th>" for ld in loads)
        body = []
        for fam, cl in rows:
            tds = []
            for ld in loads:
                ratio = (index.get((fam, cl, ld)) or {}).get("policies", {}).get(pol, {})
                ratio = ratio.get("ratio") or {}
                p95 = ratio.get("p95")
                sub = " · ".join("–" if ratio.get(k) is None else f"{ratio[k]:.2f}"
                                 for k in ("mean", "ttft_p95"))
                txt = "–" if p95 is None else f"{p95:.2f}×"
                tds.append(f'<td style="background:{_heat_colour(p95)}">{_e(txt)}<br>'
                           f'<small>{_e(sub)}</small></td>')
            body.append(f'<tr><td class=l>{_e(fam)} · {_e(cl)}</td>{"".join(tds)}</tr>')
        out.append(f'<h3>{_e(pol)}</h3><table class="heatmap"><tr><th class=l>family · '
                   f'cluster</th>{head}</tr>{"".join(body)}</table>')
    return "".join(out)


def _flows_from(policies: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for i, r in enumerate(policies):
        m = r.get("metrics", {}) or {}
        samples = m.get("_flow_times_s")
        if samples is None:
            samples = ((r.get("detailed") or {}).get("workflows") or {}).get("flow_time_s")
        if samples:
            out[str(r.get("policy", f"#{i}"))] = list(samples)
    return out


def _ttfts_from(policies: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for i, r in enumerate(policies):
        samples = r.get(TTFT_KEY)  # a run's in-memory result; else ``--save-detailed``'s
        if samples is None:
            samples = ((r.get("detailed") or {}).get("turns") or {}).get("ttft_s")
        if samples:
            out[str(r.get("policy", f"#{i}"))] = [s for s in samples if s is not None]
    return out


def _config_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    trace = doc.get("trace") or {}
    shown = {"rate": lambda v: f"{v:.3g} workflows/s",
             "offered_load": lambda v: f"{v:.3g} × the estimated capacity"}
    for key in ("name", "path", "arrivals", "rate", "offered_load", "sha256"):
        if trace.get(key) is not None:
            value = trace[key]
            fmt = shown.get(key)
            text = fmt(value) if fmt and isinstance(value, int | float) else str(value)
            rows.append([f"trace {key.replace('_', ' ')}", text])
    config = doc.get("config") or {}
    for key, value in config.items():
        if key in ("policies",):
            continue
        if isinstance(value, Mapping):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
        elif isinstance(value, list):
            value = "; ".join(", ".join(f"{k}={v}" for k, v in x.items() if v is not None)
                              if isinstance(x, Mapping) else str(x) for x in value)
        rows.append([str(key), str(value)])
    return rows


def render_html(doc: Mapping[str, Any], *, title: str | None = None,
                policies: Sequence[Mapping[str, Any]] | None = None,
                intro: str = "") -> str:
    """The report of a ``results.json`` document. ``policies``: the in-memory results (with
    their private samples for the CDF) when they are at hand, else ``doc["policies"]``.
    ``intro``: HTML placed right below the title (a caller's own summary, already escaped)."""
    simulated = bool(doc.get("simulated", True))
    label = "simulated" if simulated else "real engines (not simulated)"
    pols = list(policies if policies is not None else doc.get("policies") or [])
    name = (doc.get("trace") or {}).get("name") or ""
    title = title or f"turnstile results{f': {name}' if name else ''}"
    parts = ["<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
             '<meta name="viewport" content="width=device-width,initial-scale=1">',
             f"<title>{_e(title)} ({_e(label)})</title><style>{_CSS}</style></head><body>",
             f'<h1>{_e(title)} <span class="sim">({_e(label)})</span></h1>',
             f'<p class="note">turnstile {_e(doc.get("turnstile_version", ""))}; schema '
             f'{_e(doc.get("schema", ""))} v{_e(doc.get("version", ""))}. Ratios are against '
             "the first policy (&gt; 1: better than it).</p>", intro]
    if pols:
        parts.append('<h2>Summary</h2>')
        parts.append(_table(SUMMARY_HEADER, summary_rows(pols), cls="summary"))
        flows = _flows_from(pols)
        if flows:
            parts.append("<h2>Workflow flow time</h2>")
            parts.append(cdf_svg(flows, xlabel="workflow flow time",
                                 title=f"Workflow flow time CDF ({label})"))
        ttfts = _ttfts_from(pols)
        if ttfts:
            parts.append("<h2>Time to first token</h2>")
            parts.append(cdf_svg(ttfts, xlabel="TTFT per turn",
                                 title=f"TTFT CDF ({label})"))
    parts.append(heatmap_html(doc))
    rows = _config_rows(doc)
    if rows:
        parts.append("<h2>Configuration</h2>")
        parts.append(_table(("setting", "value"), rows, left=2))
    parts.append("</body></html>\n")
    return "".join(parts)


def write_html_report(out_dir: str | os.PathLike[str], doc: Mapping[str, Any], *,
                      title: str | None = None,
                      policies: Sequence[Mapping[str, Any]] | None = None,
                      intro: str = "") -> Path:
    """Write ``out_dir/report.html`` (atomically) and return its path (``intro``: see
    :func:`render_html`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_FILE
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_html(doc, title=title, policies=policies, intro=intro), encoding="utf-8")
    tmp.replace(path)
    return path
