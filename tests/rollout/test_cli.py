"""``turnstile rollout sim`` through typer's CliRunner (a fresh app with ``register``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from turnstile.rollout.cli import register


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command()
    def version() -> None:  # a second command keeps "rollout" a sub-command
        pass

    return app


def test_rollout_sim_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = CliRunner().invoke(
        _app(),
        ["rollout", "sim", "--steps", "2", "--gpus", "16", "--prompts", "8", "--samples", "4",
         "--policies", "least-open,cmlfq-adaptive", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["simulated"] is True
    assert doc["config"]["steps"] == 2 and doc["config"]["gpus"] == 16
    pols = doc["policies"]
    assert set(pols) == {"least-open", "cmlfq-adaptive"}
    for p in pols.values():
        assert len(p["makespan_s"]) == 2 and len(p["steps"]) == 2
        for s in p["steps"]:
            assert s["rollout_gpus"] + s["train_gpus"] <= 16
            assert s["mix"] and s["rollout_makespan_s"] > 0
    assert "Rollout-step makespan" in result.output and "simulated" in result.output


def test_rollout_sim_fixed_mix_and_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(_app(), ["rollout", "sim", "--steps", "1", "--gpus", "8", "--prompts",
                                "4", "--samples", "4", "--mix", "tp1x4,tp2x1", "--policy",
                                "cmlfq,length-predict,least-open:nosticky", "--out",
                                str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["policies"]["cmlfq"]["steps"][0]["mix"] == "tp1x4,tp2x1"
    assert doc["policies"]["cmlfq"]["steps"][0]["train_gpus"] == 2
    bad = runner.invoke(_app(), ["rollout", "sim", "--policies", "nope"])
    assert bad.exit_code == 2 and "valid names" in bad.output
    big = runner.invoke(_app(), ["rollout", "sim", "--gpus", "4", "--mix", "tp4x2"])
    assert big.exit_code == 2


def test_rollout_live_reports_engine_errors(monkeypatch) -> None:
    import turnstile.rollout.live as live

    def fake_run_live(cfg, log=None):  # no engines: only the command's wiring
        raise RuntimeError("the gateway exited (1)")

    monkeypatch.setattr(live, "run_live", fake_run_live)
    res = CliRunner().invoke(_app(), ["rollout", "live", "--policy", "cmlfq"])
    assert res.exit_code == 2 and "gateway exited" in res.output


def test_rollout_sim_libra_workload(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(_app(), ["rollout", "sim", "--workload", "search-r1", "--steps", "1",
                                "--gpus", "8", "--mix", "tp2x2,tp4x1", "--train-gpus", "0",
                                "--policies", "least-open,cmlfq", "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["workload"]["name"] == "search-r1"
    assert doc["policies"]["cmlfq"]["steps"][0]["trajectories_done"] == 80  # 16 × 5, as cited
    bad = runner.invoke(_app(), ["rollout", "sim", "--workload", "nope"])
    assert bad.exit_code == 2 and "valid" in bad.output
