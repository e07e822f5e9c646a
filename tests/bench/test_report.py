"""results.json round trip, hashing helpers and the side-by-side table."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from turnstile.bench import (
    compute_metrics,
    file_sha256,
    format_count,
    format_seconds,
    load_results,
    p95_ratio,
    render_table,
    tree_sha256,
    write_results,
)
from turnstile.core.state import WorkflowRecord

Factory = Callable[..., WorkflowRecord]


def _results(wf: Factory) -> list[dict[str, Any]]:
    slow = [wf(f"s{i}", 0.0, [(0.0, 0.0, 0.0, 1.0, 10.0 + i, 5)]) for i in range(20)]
    fast = [wf(f"f{i}", 0.0, [(0.0, 0.0, 0.0, 0.5, 5.0 + i / 2, 5)]) for i in range(20)]
    return [
        {
            "policy": "eager",
            "metrics": compute_metrics(slow, makespan_s=30.0),
            "engines": {"e0": {"steps": np.int64(3)}},
        },
        {
            "policy": "cvar",
            "metrics": compute_metrics(fast, makespan_s=30.0),
            "_private": "not written",
        },
    ]


def test_results_json_round_trip_without_private_samples(wf: Factory, tmp_path: Path) -> None:
    results = _results(wf)
    config = {"policies": ["eager", "cvar"], "seed": 0, "_scratch": 1, "out": tmp_path}
    trace = {"path": None, "sha256": None, "name": "synthetic"}
    path = write_results(tmp_path / "run", results, config, trace)
    assert path == tmp_path / "run" / "results.json"
    text = path.read_text()
    assert "_flow_times_s" not in text and "_private" not in text and "_scratch" not in text

    doc = load_results(path.parent)
    assert doc["schema"] == "turnstile-results" and doc["version"] == 1
    assert doc["simulated"] is True
    assert doc["config"]["policies"] == ["eager", "cvar"]
    assert doc["config"]["out"] == str(tmp_path)
    assert doc["trace"] == trace
    assert [p["policy"] for p in doc["policies"]] == ["eager", "cvar"]
    assert doc["policies"][0]["engines"]["e0"]["steps"] == 3
    expected = {k: v for k, v in results[1]["metrics"].items() if not k.startswith("_")}
    assert doc["policies"][1]["metrics"] == json.loads(json.dumps(expected))
    assert "_flow_times_s" in results[0]["metrics"]  # the caller's dicts are untouched
    assert not list(path.parent.glob("*.tmp"))

    real = write_results(tmp_path / "real", results, {}, {}, simulated=False)
    assert load_results(real)["simulated"] is False


def test_write_results_hashes_the_trace_when_not_given(tmp_path: Path) -> None:
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text('{"id": "a"}\n')
    path = write_results(tmp_path / "out", [], {}, {"path": trace_file, "name": "t"})
    doc = load_results(path)
    assert doc["trace"]["sha256"] == hashlib.sha256(trace_file.read_bytes()).hexdigest()
    assert doc["trace"]["path"] == str(trace_file)
    assert doc["policies"] == []


def test_load_results_rejects_other_files(tmp_path: Path) -> None:
    p = tmp_path / "results.json"
    p.write_text(json.dumps({"schema": "other", "version": 1}))
    with pytest.raises(ValueError, match="not a turnstile-results"):
        load_results(p)
    p.write_text(json.dumps({"schema": "turnstile-results", "version": 99}))
    with pytest.raises(ValueError, match="version"):
        load_results(p)


def test_file_and_tree_sha256(tmp_path: Path) -> None:
    root = tmp_path / "trace"
    (root / "sub").mkdir(parents=True)
    (root / "a.csv").write_bytes(b"x,y\n1,2\n")
    (root / "sub" / "b.json").write_bytes(b"{}")
    assert file_sha256(root / "a.csv") == hashlib.sha256(b"x,y\n1,2\n").hexdigest()

    first = tree_sha256(root)
    assert tree_sha256(root) == first
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "junk.pyc").write_bytes(b"junk")
    assert tree_sha256(root) == first  # excluded names do not count

    (root / "sub" / "b.json").write_bytes(b"{ }")
    changed = tree_sha256(root)
    assert changed != first
    (root / "sub" / "b.json").rename(root / "sub" / "c.json")
    assert tree_sha256(root) != changed  # a rename changes the digest

    copy = tmp_path / "copy"
    (copy / "sub").mkdir(parents=True)
    (copy / "a.csv").write_bytes(b"x,y\n1,2\n")
    (copy / "sub" / "c.json").write_bytes(b"{ }")
    assert tree_sha256(copy) == tree_sha256(root)  # the location does not count


def test_render_table_rows_and_ratio(wf: Factory) -> None:
    results = _results(wf)
    console = Console(record=True, width=200, color_system=None)
    table = render_table(results, console)
    text = console.export_text()
    assert table.row_count == 2
    assert "eager" in text and "cvar" in text and "P95 vs first" in text
    ratio = p95_ratio(
        results[0]["metrics"]["flow_time_s"]["p95"], results[1]["metrics"]["flow_time_s"]["p95"]
    )
    assert ratio is not None and ratio > 1  # cvar's tail is shorter than eager's
    assert f"{ratio:.2f}×" in text
    assert "1.00×" in text


def test_render_table_with_empty_metrics() -> None:
    console = Console(record=True, width=200, color_system=None)
    empty = compute_metrics([], makespan_s=0.0)
    render_table([{"policy": "a", "metrics": empty}, {"policy": "b", "metrics": {}}], console)
    assert "–" in console.export_text()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "–"),
        (0.0, "0 s"),
        (0.00045, "450 µs"),
        (0.0123, "12.3 ms"),
        (0.85, "850 ms"),
        (4.567, "4.57 s"),
        (750.0, "12.5 min"),
        (11520.0, "3.20 h"),
        (float("nan"), "–"),
    ],
)
def test_format_seconds(seconds: float | None, text: str) -> None:
    assert format_seconds(seconds) == text


def test_format_count() -> None:
    assert format_count(None) == "–"
    assert format_count(950) == "950"
    assert format_count(12_345) == "12.3k"
    assert format_count(4_560_000) == "4.56M"
    assert format_count(0.5) == "0.5"


def test_render_table_shows_mean_and_ttft_ratios_and_flags_harm_in_red(wf: Factory) -> None:
    results = _results(wf)
    # a policy whose P95 ties the baseline but whose TTFT P95 is twice as long
    worse = {"policy": "slow-ttft", "metrics": {
        "flow_time_s": dict(results[0]["metrics"]["flow_time_s"]),
        "ttft_s": {"p95": 2 * results[0]["metrics"]["ttft_s"]["p95"]}}}
    console = Console(record=True, width=240, color_system="truecolor")
    render_table([results[0], worse], console)
    text = console.export_text(styles=False, clear=False)
    assert "mean vs first" in text and "TTFT P95 vs first" in text
    assert "0.50×" in text and "1.00×" in text
    styled = console.export_text(styles=True)
    red = next(line for line in styled.splitlines() if "slow-ttft" in line)
    assert "31m0.50×" in red
    assert "31m1.00×" not in styled  # parity is not flagged
