"""``turnstile replay`` writes report.html beside results.json, and ``--save-detailed`` adds every
turn's samples (a fake engine: only the files are checked here)."""

from __future__ import annotations

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
