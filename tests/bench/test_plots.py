"""Plots write non-empty PNGs; titles of simulated results say so; import stays lazy."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from turnstile.bench import compute_metrics, flow_times_of, plot_flow_cdf, plot_load_sweep
from turnstile.bench.plots import _title
from turnstile.core.state import WorkflowRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_flow_cdf_png(wf: Callable[..., WorkflowRecord], tmp_path: Path) -> None:
    results = []
    for name, scale in (("eager", 1.0), ("cvar", 0.01)):
        wfs = [wf(f"{name}{i}", 0.0, [(0.0, 0.0, 0.0, 0.1, scale * (i + 1), 3)]) for i in range(50)]
        results.append({"policy": name, "metrics": compute_metrics(wfs, makespan_s=60.0)})
    results.append({"policy": "empty", "metrics": compute_metrics([], makespan_s=0.0)})
    results.append({"policy": "from-json", "metrics": {"flow_time_s": {}}})
    assert len(flow_times_of(results[0])) == 50 and flow_times_of(results[3]) == []
    out = plot_flow_cdf(results, tmp_path / "plots" / "cdf.png", "Flow time CDF")
    assert out == tmp_path / "plots" / "cdf.png" and _is_png(out)
    linear = plot_flow_cdf(results[:1], tmp_path / "lin.png", "t", simulated=False, log_x=False)
    assert _is_png(linear)


def test_load_sweep_png(tmp_path: Path) -> None:
    sweep = {
        "eager": [(0.5, 10.0, 4.0), (0.1, 2.0, 1.0), (1.0, 80.0, 20.0)],
        "cvar": [(0.1, 2.0, 1.0), (0.5, 5.0, None), (1.0, 12.0, 6.0)],
    }
    out = plot_load_sweep(sweep, tmp_path / "sweep.png", "P95 flow time (s)", log_y=True)
    assert _is_png(out)
    assert _is_png(plot_load_sweep({}, tmp_path / "empty.png", "s", simulated=False))


def test_titles_say_simulated() -> None:
    assert _title("Flow time", True) == "Flow time (simulated)"
    assert _title("Simulated flow time", True) == "Simulated flow time"
    assert _title("Flow time", False) == "Flow time"


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, turnstile.bench; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
