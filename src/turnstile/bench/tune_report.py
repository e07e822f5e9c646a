"""``turnstile tune``'s report: the candidate table, ``results.json`` and ``report.html``.

Every figure is simulated. The table has one row per candidate: its P95 gain over eager (the
geometric mean over the load cells of eager's P95 / the candidate's) on the tune half, and on
the report half that gain, its worst P95, mean and TTFT-P95 ratios over the load cells and
whether it stays within the no-harm bounds in every one of them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from turnstile.bench.html_report import html_table, write_html_report
from turnstile.bench.suite_report import NO_HARM, finite

__all__ = ["TABLE_HEADER", "candidate_rows", "render_tune", "write_tune"]

TABLE_HEADER = ("candidate", "tune P95 gain", "tune no harm", "report P95 gain",
                "worst P95", "worst mean", "worst TTFT P95", "report no harm")


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _worst(row: Mapping[str, Any], key: str) -> float | None:
    w = row.get("worst", {}).get(key)
    return None if w is None else float(w["ratio"])


def candidate_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    """One row per candidate (:data:`TABLE_HEADER`); the chosen one marked ``*``."""
    report = {r["spec"]: r for r in doc["report"]}
    rows = []
    for t in doc["tune"]:
        r = report[t["spec"]]
        mark = " *" if t["spec"] == doc["chosen"] else ""
        rows.append([t["spec"] + mark, _x(t["score"]), "yes" if t["ok"] else "no",
                     _x(r["score"]), _x(_worst(r, "p95")), _x(_worst(r, "mean")),
                     _x(_worst(r, "ttft_p95")), "yes" if r["ok"] else "no"])
    return rows


def _bounds() -> str:
    return (f"no harm: P95 and mean ≥ {1 / NO_HARM['p95']:.2f}×, TTFT P95 ≥ "
            f"{1 / NO_HARM['ttft_p95']:.2f}× of eager's in every load cell")


def render_tune(doc: Mapping[str, Any], console: Any) -> None:
    """Print the table, the warnings, the chosen spec and the line that deploys it."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"turnstile tune (simulated) on {doc['config']['cluster']}: eager / "
                  f"candidate; {_bounds()}")
    for i, col in enumerate(TABLE_HEADER):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in candidate_rows(doc):
        chosen = row[0].endswith(" *")
        table.add_row(*(escape(c) for c in row), style="bold green" if chosen else None)
    console.print(table)
    for w in doc["warnings"]:
        console.print(f"[bold yellow]warning:[/] {escape(w)}")
    console.print(f"chosen (on the tune half, {doc['sessions']['tune']} sessions; reported "
                  f"on the other {doc['sessions']['report']}): [bold]{escape(doc['chosen'])}[/]")
    console.print(f"deploy it:\n  {escape(doc['deploy'])}")


def _intro(doc: Mapping[str, Any]) -> str:
    import html

    warn = "".join(f'<p class="sim">warning: {html.escape(w)}</p>' for w in doc["warnings"])
    return (f"<h2>Choice</h2><p>Chosen on the tune half ({doc['sessions']['tune']} sessions), "
            f"reported on the report half ({doc['sessions']['report']}): "
            f"<b>{html.escape(doc['chosen'])}</b>. {html.escape(_bounds())}.</p>{warn}"
            f"<p>Deploy: <code>{html.escape(doc['deploy'])}</code></p>"
            "<h2>Candidates</h2>" + html_table(TABLE_HEADER, candidate_rows(doc)))


def write_tune(doc: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``results.json`` and ``report.html`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = out / "results.json"
    tmp = res.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(doc), indent=1, allow_nan=False, default=str) + "\n",
                   encoding="utf-8")
    tmp.replace(res)
    html = write_html_report(out, finite(doc), intro=_intro(doc),
                             title=f"turnstile tune: {doc.get('trace', {}).get('name', '')}")
    return {"results": res, "report": html}
