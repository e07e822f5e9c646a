"""benchmarks/peers.py's pure parts: the order the systems run in, the load flag, the table."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peers_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peers = _load()


def test_order_rotates_so_every_system_runs_first_and_last() -> None:
    systems = ["a", "b", "c"]
    orders = [peers.system_order(systems, g) for g in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {o[0] for o in orders} == set(systems)
    assert {o[-1] for o in orders} == set(systems)
    assert peers.system_order(systems, 4) == orders[1]
    assert peers.system_order([], 2) == []


def test_loads_parse_and_reject_a_missing_rate() -> None:
    assert peers.parse_loads("light=0.3, contended=6") == [("light", 0.3), ("contended", 6.0)]
    with pytest.raises(ValueError, match="NAME=SESSIONS_PER_S"):
        peers.parse_loads("light")


def _cell(system: str, rep: int, p95: float, hit: float, errors: dict | None = None) -> dict:
    return {"family": "f", "load": "contended", "rep": rep, "system": system,
            "flow_p50_s": p95 / 2, "flow_p95_s": p95, "ttft_p95_s": p95 / 4,
            "engine_hit_rate": hit, "errors": errors or {}, "unfinished": 0}


def test_rows_average_repetitions_and_ratio_is_per_group() -> None:
    cells = [_cell("turnstile-eager", 0, 2.0, 0.2), _cell("x", 0, 1.0, 0.8),
             _cell("turnstile-eager", 1, 4.0, 0.3), _cell("x", 1, 4.0, 0.6, {"HTTP 500": 2})]
    rows = {r["system"]: r for r in peers.build_rows(cells)}
    x = rows["x"]
    assert x["reps"] == 2
    assert x["flow_p95_s"] == {"mean": 2.5, "min": 1.0, "max": 4.0, "n": 2}
    # ratios 0.5 (rep 0) and 1.0 (rep 1): the mean of the per-repetition ratios, not 2.5/3
    assert x["p95_vs_base"]["mean"] == pytest.approx(0.75)
    assert x["engine_hit_rate"]["mean"] == pytest.approx(0.7)
    assert x["errors"] == 2
    assert rows["turnstile-eager"]["p95_vs_base"]["mean"] == pytest.approx(1.0)


def test_table_shows_means_ranges_and_missing_figures() -> None:
    cells = [_cell("turnstile-eager", 0, 2.0, 0.25), _cell("turnstile-eager", 1, 3.0, 0.75),
             {**_cell("y", 0, 1.0, 0.5), "ttft_p95_s": None}]
    table = peers.render_table(peers.build_rows(cells))
    lines = table.strip().splitlines()
    assert len(lines) == 4
    eager = next(ln for ln in lines if "| turnstile-eager |" in ln)
    assert "2.50 (2.00–3.00)" in eager and "50% (25%–75%)" in eager
    y = next(ln for ln in lines if "| y |" in ln)
    assert "| – |" in y and "0.50×" in y
