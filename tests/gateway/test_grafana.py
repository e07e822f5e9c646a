"""deploy/grafana/turnstile.json: every query names metrics the gateway really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from turnstile.testing.fake_engine import chat_body

pytestmark = pytest.mark.timeout(60)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "turnstile.json"
_NAME = re.compile(r"\bturnstile_[a-z0-9_]+")


def exported_names(text: str) -> set[str]:
    """Sample names in a Prometheus exposition, plus what a TYPE line declares (a family with
    no sample yet, e.g. a labelled counter nothing incremented): histograms' three series."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            if kind == "counter" and not name.endswith("_total"):
                names.add(name + "_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_dashboard_query_names_an_exported_metric(fake_engines: Any,
                                                         gateways: Any) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 10 and all(exprs)
    gw = gateways([fake_engines().url])
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True),
                      timeout=10).status_code == 200
    exported = exported_names(httpx.get(gw.url + "/metrics", timeout=10).text)
    used = set()
    for e in exprs:
        names = set(_NAME.findall(e))
        assert names, f"a query without a turnstile metric: {e}"
        used |= names
        missing = names - exported
        assert not missing, f"{e!r} names metrics the gateway does not export: {missing}"
    # the dashboard covers the gateway's own families (the engines' included)
    families = {n.removesuffix("_total") for n in exported if n.startswith("turnstile_")
                and not n.endswith(("_created", "_bucket", "_sum", "_count"))}
    covered = {n.removesuffix("_total").removesuffix("_bucket") for n in used}
    covered |= {n.removesuffix("_sum").removesuffix("_count") for n in used}
    assert families <= covered, families - covered
