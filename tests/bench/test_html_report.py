"""``report.html``: one self-contained file with the tables, the CDFs (inline SVG) and, for a
robustness suite, the heat map; it renders in headless Chromium."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from turnstile.bench.html_report import cdf_svg, heatmap_html, render_html, write_html_report
from turnstile.bench.report import load_results, write_results
from turnstile.bench.runner import WorkloadSpec, build_workload, run_bench
from turnstile.sim.cluster import EngineGroup
from turnstile.testing.browser import browser_or_skip, dump_dom, screenshot


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A tiny real bench run (simulated), written as results.json and report.html."""
    out = tmp_path_factory.mktemp("bench")
    groups = [EngineGroup(count=2)]
    wfs, info = build_workload(WorkloadSpec(trace=None, workflows=12, load=0.7), groups)
    results = run_bench(wfs, ["eager", "cvar+least-loaded-shadow"], groups, detailed=True)
    path = write_results(out, results, {"policies": ["eager", "cvar"]}, info)
    write_html_report(out, load_results(path), policies=results, title="tiny bench")
    return out, results


def test_report_has_the_tables_and_cdfs(bench_out) -> None:
    out, results = bench_out
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "(simulated)" in page
    summary = re.search(r"<table class=summary>(.*?)</table>", page, re.S)
    assert summary is not None
    rows = re.findall(r"<tr>(.*?)</tr>", summary.group(1), re.S)
    assert len(rows) == 1 + len(results)  # header + one row per policy
    for r in results:
        assert f"<td class=l>{r['policy']}</td>" in summary.group(1)
    assert page.count("<svg") == 2  # flow time and TTFT (detailed samples) CDFs
    assert page.count("<polyline") == 2 * len(results)
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)


def test_the_ttft_cdf_needs_no_save_detailed(tmp_path: Path) -> None:
    """The TTFT CDF was drawn only from ``--save-detailed``'s samples; a run's per-turn TTFTs
    are at hand without it (a private key, never written to results.json)."""
    groups = [EngineGroup(count=2)]
    wfs, info = build_workload(WorkloadSpec(trace=None, workflows=8, load=0.7), groups)
    results = run_bench(wfs, ["eager"], groups)
    doc = load_results(write_results(tmp_path, results, {"policies": ["eager"]}, info))
    assert "detailed" not in doc["policies"][0] and "_ttft_s" not in doc["policies"][0]
    page = write_html_report(tmp_path, doc, policies=results).read_text(encoding="utf-8")
    assert page.count("<svg") == 2 and "TTFT CDF (simulated)" in page
    (detailed,) = run_bench(wfs, ["eager"], groups, detailed=True)
    ttfts = [x for x in detailed["detailed"]["turns"]["ttft_s"] if x is not None]
    assert results[0]["_ttft_s"] == ttfts and len(ttfts) >= len(wfs)  # the same curve


def test_cdf_svg_log_axis_and_empty() -> None:
    svg = cdf_svg({"a": [0.01, 1.0, 100.0], "b": [0.5, 2.0]}, xlabel="x", title="t")
    assert "x (s, log scale)" in svg and svg.count("<polyline") == 2
    assert "no samples" in cdf_svg({"a": []}, xlabel="x", title="t")


def test_heatmap_of_suite_cells() -> None:
    doc = {"simulated": True, "config": {"policies": ["eager", "cvar"]},
           "cells": [{"family": "agentcgroup", "cluster": "4xH100", "load": "sat×1",
                      "policies": {"cvar": {"ratio": {"p95": 2.5, "mean": 2.0,
                                                      "ttft_p95": 1.1}}}},
                     {"family": "azure", "cluster": "4xH100", "load": "sat×1",
                      "policies": {"cvar": {"ratio": {"p95": 0.8, "mean": 0.9,
                                                      "ttft_p95": 1.0}}}}]}
    heat = heatmap_html(doc)
    assert "2.50×" in heat and "0.80×" in heat and "agentcgroup · 4xH100" in heat
    greens = re.findall(r'background:#([0-9a-f]{6})">2\.50', heat)
    reds = re.findall(r'background:#([0-9a-f]{6})">0\.80', heat)
    assert greens and int(greens[0][2:4], 16) > int(greens[0][0:2], 16)  # green > red
    assert reds and int(reds[0][0:2], 16) > int(reds[0][2:4], 16)
    assert "Robustness" in render_html(doc) and heatmap_html({"policies": []}) == ""


@pytest.mark.timeout(180)
def test_report_renders_in_headless_chromium(bench_out, tmp_path: Path) -> None:
    browser = browser_or_skip()
    out, results = bench_out
    dom = dump_dom(browser, out / "report.html", tmp_path / "profile")
    # the browser parsed the page into the tables and the SVG figures
    assert "<table class=\"summary\">" in dom or "<table class=summary>" in dom
    for r in results:
        assert r["policy"] in dom
    assert dom.count("<svg") == 2 and "polyline" in dom
    shot = screenshot(browser, out / "report.html", tmp_path / "report.png", tmp_path / "profile")
    assert shot.is_file() and shot.stat().st_size > 20_000  # drawn, not a blank page
