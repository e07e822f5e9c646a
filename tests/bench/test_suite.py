"""The robustness suite (issue 31): families, the saturation search, the report, local and Ray
backends, and the quick suite's no-harm check of the default policy."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from turnstile.bench import suite as S
from turnstile.bench.families import FAMILIES, get_family
from turnstile.bench.suite_backends import init_ray
from turnstile.bench.suite_report import NO_HARM, markdown_report, no_harm, write_suite
from turnstile.sim.closed_loop import run_closed_loop
from turnstile.sim.cluster import EngineGroup
from turnstile.workload import synth


def _tiny(policies: list[str] | None = None) -> S.SuiteConfig:
    return S.SuiteConfig("tiny", [("syn-few-turns", "1xH100-8B")],
                         [S.LoadPoint("measured", 0.5), S.LoadPoint("estimate", 1.2)],
                         policies or ["eager", "cvar"], workflows_per_engine=40,
                         min_workflows=40, max_workflows=40, search_runs=3)


@pytest.fixture(scope="module")
def tiny_doc() -> dict:
    return S.run_suite(_tiny(), workers=1)


def test_the_default_policy_is_the_policies_package_default(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    from turnstile import policies

    monkeypatch.setitem(policies.DEFAULTS, "release", "plas")
    assert S.default_policy_spec() == "plas"
    monkeypatch.setattr(policies, "DEFAULT_SPEC", "cvar+kv-affinity", raising=False)
    assert S.default_policy_spec() == "cvar+kv-affinity"
    assert S.suite_config("quick").policies == ["eager", "plas", "cvar", "cvar+kv-affinity"]


def test_families_cover_the_issue_and_split_in_two_halves() -> None:
    kinds = {f.kind for f in FAMILIES}
    assert kinds == {"real", "importer", "synthetic", "generator"}
    assert {f.split for f in FAMILIES} == {"tune", "report"}
    assert {"open", "closed"} == {f.arrivals for f in FAMILIES}
    for f in FAMILIES:
        if f.kind in ("synthetic", "generator", "importer"):
            wfs, info = f.sessions(12, 3)
            assert len(wfs) == 12 and info["name"]
            assert wfs == f.sessions(12, 3)[0]  # seeded
    fan, _ = get_family("syn-fanout").sessions(3, 0)
    assert all(not w.is_chain for w in fan)
    turns = [len(w.turns) for w in get_family("syn-many-turns").sessions(30, 0)[0]]
    assert min(turns) >= 60 and max(turns) <= 150
    first = [w.turns[0].prompt_tokens for w in get_family("syn-start-100k").sessions(20, 0)[0]]
    assert min(first) >= 60_000
    with pytest.raises(ValueError, match="valid"):
        get_family("nope")


def test_closed_loop_keeps_at_most_the_pool_in_flight() -> None:
    wfs = synth.generate(synth.DEFAULT_SPEC, 12, 0)[:12]
    res = run_closed_loop(wfs, 3, "eager", [EngineGroup(gpu="H100", count=1)], think_s=2.0)
    assert len(res.workflows) == 12
    spans = sorted((w.arrival_s, w.finished_s) for w in res.workflows)
    for t, _ in spans:
        assert sum(a <= t < f for a, f in spans) <= 3
    # every later session starts think_s after some session finished
    finishes = [f for _, f in spans]
    for a, _ in spans[3:]:
        assert any(abs(a - (f + 2.0)) < 1e-6 for f in finishes)


def test_suite_document_structure_and_ratios(tiny_doc: dict, tmp_path: Path) -> None:
    doc = tiny_doc
    assert doc["simulated"] is True and doc["schema"] == "turnstile-robustness"
    sat = doc["saturation"][0]
    assert sat["unit"] == "workflows/s" and len(sat["probes"]) <= 3
    if sat["found"]:  # the point found passes the threshold, the bracket's low end does not
        hi = next(p for p in sat["probes"] if p["intensity"] == sat["saturation"])
        assert hi["queue_recompute_share"] >= S.SATURATION_QUEUE_SHARE
    assert [c["load"] for c in doc["cells"]] == ["est×1.2", "sat×0.5"]
    assert {c["basis"] for c in doc["cells"]} == {"measured", "estimate"}
    for c in doc["cells"]:
        assert set(c["policies"]) == {"eager", "cvar"}
        assert c["policies"]["eager"]["ratio"] == {"p95": 1.0, "mean": 1.0, "ttft_p95": 1.0}
        cv = c["policies"]["cvar"]
        assert cv["ratio"]["p95"] == pytest.approx(
            c["policies"]["eager"]["flow_p95_s"] / cv["flow_p95_s"])
        assert 0.0 <= c["eager_queue_share"] <= 1.0
    paths = write_suite(doc, tmp_path)
    back = json.loads(paths["results"].read_text())
    assert back["cells"][0]["policies"]["cvar"]["ratio"]
    md = paths["markdown"].read_text()
    assert "## report half" in md and "No harm (report half)" in md and "(simulated)" in md
    assert paths["heatmap"].stat().st_size > 5_000
    assert back["kind"] == "robustness" and back["schema"] == "turnstile-robustness"
    page = paths["report"].read_text(encoding="utf-8")
    assert "Robustness" in page and "(simulated)" in page


def test_suite_report_without_matplotlib(tiny_doc: dict, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway-only install (no plots extra) still gets the heat map, in report.html."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_suite(tiny_doc, tmp_path)
    assert "heatmap" not in paths and not (tmp_path / "heatmap.png").exists()
    assert paths["results"].is_file() and paths["markdown"].is_file()
    assert "Robustness" in paths["report"].read_text(encoding="utf-8")


@pytest.mark.timeout(300)
def test_suite_report_renders_in_headless_chromium(tiny_doc: dict, tmp_path: Path) -> None:
    from turnstile.testing.browser import browser_or_skip, dump_dom

    browser = browser_or_skip()
    paths = write_suite(tiny_doc, tmp_path / "suite")
    dom = dump_dom(browser, paths["report"], tmp_path / "profile")
    assert "Robustness" in dom and "×" in dom and "<td style=" in dom


def test_no_harm_names_the_worst_cell_and_every_miss() -> None:
    def cell(load: str, p95: float, ttft: float) -> dict:
        return {"family": "f", "cluster": "c", "load": load, "policies": {
            "x": {"ratio": {"p95": p95, "mean": 1.0, "ttft_p95": ttft}}}}
    cells = [cell("a", 1.5, 1.0), cell("b", 0.98, 0.92), cell("c", 0.96, 0.80)]
    nh = no_harm(cells, "x")
    assert nh["worst"]["p95"] == {"ratio": 0.96, "cell": "f · c · c"}
    assert [m["load"] for m in nh["misses"]] == ["c"] and not nh["ok"]
    assert nh["misses"][0]["ratios"] == {"p95": 0.96, "ttft_p95": 0.80}
    assert no_harm(cells[:2], "x")["ok"]  # 0.98 ≥ 1/1.03 and 0.92 ≥ 1/1.10


def test_gains_counts_only_contended_cells() -> None:
    from turnstile.bench.suite_report import gains

    def cell(load: str, queue: float, p95: float) -> dict:
        return {"family": "f", "cluster": "c", "load": load, "eager_queue_share": queue,
                "eager_recompute_share_est": 0.05,
                "policies": {"x": {"ratio": {"p95": p95, "mean": 1.0, "ttft_p95": 1.0}}}}
    g = gains([cell("a", 0.6, 2.5), cell("b", 0.45, 1.6), cell("c", 0.3, 9.0)], "x")
    assert [r["load"] for r in g["cells"]] == ["a", "b"]  # 0.45 + 0.05 >= 50%; 35% is not
    assert g["met"] == 1 and abs(g["geomean"] - (2.5 * 1.6) ** 0.5) < 1e-12


def test_markdown_bolds_harm(tiny_doc: dict) -> None:
    doc = json.loads(json.dumps(tiny_doc))
    doc["cells"][0]["policies"]["cvar"]["ratio"]["p95"] = 0.5
    assert "**0.50**" in markdown_report(doc)


def test_ray_backend_gives_the_local_results(tiny_doc: dict) -> None:
    ray = pytest.importorskip("ray")
    init_ray("local", num_cpus=2)  # light start, retried if the busy host is slow to start it
    try:
        doc = S.run_suite(_tiny(), ray="local")
    finally:
        ray.shutdown()
    assert doc["backend"].startswith("ray")
    strip = ("sim_wall_s",)
    for a, b in zip(doc["cells"], tiny_doc["cells"], strict=True):
        for pol in a["policies"]:
            pa = {k: v for k, v in a["policies"][pol].items() if k not in strip}
            pb = {k: v for k, v in b["policies"][pol].items() if k not in strip}
            assert pa == pb  # the simulator is deterministic wherever it runs


# --------------------------------------------------------------------------------------
# The quick suite, as CI runs it. ISSUE 31 NO-HARM CHECK (read by the policy room): the
# default policy (turnstile.policies.DEFAULT_SPEC when declared, else the default release
# policy DEFAULTS["release"]; S.default_policy_spec) is at most 3%
# worse than eager in P95 and mean flow time and at most 10% worse in TTFT P95 in every
# cell of the quick suite (NO_HARM in turnstile.bench.suite_report).
# No cell misses since the gate holds only on evidence of evictions (2026-12-07; before it,
# syn-tools-heavy at est x1.2 had TTFT P95 0.886x eager). A measured miss would be listed
# here as (family, metric) -> its measured floor (the simulator is deterministic): held to
# that level, not waived; a cell outside this list, or worse than its floor, fails.
# With the gateway-facing cells' ends unannounced (issue 36 item 2) the default misses three
# cells (measured at f2c61ee, simulated); issue 36 item 1 (the stall fix) owns them.
KNOWN_MISSES: dict[tuple[str, str], float] = {
    ("aiperf-agentic-code", "mean"): 0.931, ("aiperf-agentic-code", "ttft_p95"): 0.895,
    ("syn-closed-pool", "p95"): 0.930, ("syn-long-context", "p95"): 0.964,
}


@pytest.mark.slow
def test_quick_suite_structure_and_the_default_policy_does_no_harm(tmp_path: Path) -> None:
    default = S.default_policy_spec()
    config = S.suite_config("quick", policies=[default])
    doc = S.run_suite(config, workers=os.cpu_count() or 1)
    write_suite(doc, tmp_path)
    families = {c["family"] for c in doc["cells"]}
    assert families | {s["family"] for s in doc["skipped"]} == {
        f.name for f in FAMILIES if f.quick}
    assert {"syn-agentcgroup-fit", "syn-closed-pool", "aiperf-agentic-code"} <= families
    assert len(doc["cells"]) == len(families) * len(config.loads)
    assert {f["split"] for f in doc["families"]} == {"tune", "report"}
    nh = no_harm(doc["cells"], default)
    unexplained = [
        m for m in nh["misses"]
        if any(r < KNOWN_MISSES.get((m["family"], k), 2.0) for k, r in m["ratios"].items())]
    assert not unexplained, (f"default policy {default!r} harms cells (bounds {NO_HARM}, "
                             f"known misses {KNOWN_MISSES}): {unexplained}")
    # and it gains where sessions contend for KV (measured 2.03x / 1.54x eager's P95 at
    # est x1.2 / sat x2 on the AgentCgroup fit, simulated)
    for c in doc["cells"]:
        if c["family"] == "syn-agentcgroup-fit" and c["load"] in ("est×1.2", "sat×2"):
            assert c["policies"][default]["ratio"]["p95"] >= 1.3, c


def test_bench_suite_cli_writes_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    from typer.testing import CliRunner

    from turnstile.cli import app

    seen: dict = {}

    def tiny(name: str, policies=None, families=None, seed: int = 0, **_ends) -> S.SuiteConfig:
        seen.update(name=name, policies=policies)
        return _tiny(["eager", *(policies or [])])

    monkeypatch.setattr(S, "suite_config", tiny)
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--suite", "quick", "--policies", "eager,cvar",
                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen == {"name": "quick", "policies": ["eager", "cvar"]}
    assert "worst cell vs eager" in res.output and "cvar" in res.output
    assert {p.name for p in tmp_path.iterdir()} >= {"results.json", "robustness.md",
                                                    "heatmap.png"}
    default = runner.invoke(app, ["bench", "--suite", "quick", "--out", str(tmp_path)])
    assert default.exit_code == 0 and seen["policies"] is None  # the suite's own set
    bad = runner.invoke(app, ["bench", "--suite", "huge"])
    assert bad.exit_code == 2 and "quick or full" in bad.output
