"""``turnstile replay`` writes report.html beside results.json, and ``--save-detailed`` adds every
turn's samples (a fake engine: only the files are checked here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from turnstile.cli import main

pytestmark = pytest.mark.timeout(60)


def test_replay_writes_report_and_detailed_samples(fake_engines: Any, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    eng = fake_engines(count_prompt=True, tpot_s=0.001)
    out = tmp_path / "replay"
    with pytest.raises(SystemExit) as e:
        main(["replay", "--target", eng.url, "--workflows", "3", "--rate", "50",
              "--time-scale", "0.001", "--max-turns", "2", "--max-context", "1024",
              "--max-tokens", "8", "--save-detailed", "-o", str(out)])
    assert e.value.code == 0, capsys.readouterr()
    from turnstile.bench.report import load_results

    doc = load_results(out)
    assert doc["kind"] == "replay" and doc["simulated"] is False
    (res,) = doc["policies"]
    turns = res["detailed"]["turns"]
    assert len(turns["ttft_s"]) == res["metrics"]["turns"] > 0
    assert all(t is not None and t >= 0 for t in turns["ttft_s"])
    assert len(res["detailed"]["workflows"]["flow_time_s"]) == 3
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "real engines (not simulated)" in page and "<table class=summary>" in page
    assert page.count("<svg") == 2  # flow time and TTFT


@pytest.mark.timeout(300)
def test_replay_report_renders_in_headless_chromium(fake_engines: Any, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``turnstile replay``'s report.html (real engines: a fake OpenAI engine here) is drawn by
    a browser: the summary table and both CDFs."""
    from turnstile.testing.browser import browser_or_skip, dump_dom, screenshot

    browser = browser_or_skip()
    eng = fake_engines(count_prompt=True, tpot_s=0.001)
    out = tmp_path / "replay"
    with pytest.raises(SystemExit) as e:
        main(["replay", "--target", eng.url, "--workflows", "3", "--rate", "50",
              "--time-scale", "0.001", "--max-turns", "2", "--max-context", "1024",
              "--max-tokens", "8", "-o", str(out)])
    printed = capsys.readouterr()
    assert e.value.code == 0, printed
    # the summary line is formatted (P95 as a duration, hit rate as a percentage)
    assert re.search(r"turns done \(0 unfinished; errors: none\); flow P95 [\d.]+ m?s; "
                     r"prefix hit rate (\d+\.\d%|–)", printed.out + printed.err), printed
    dom = dump_dom(browser, out / "report.html", tmp_path / "profile")
    assert "real engines (not simulated)" in dom and dom.count("<svg") == 2
    assert '<table class="summary">' in dom and "polyline" in dom
    shot = screenshot(browser, out / "report.html", tmp_path / "r.png", tmp_path / "profile")
    assert shot.stat().st_size > 20_000  # drawn, not a blank page
