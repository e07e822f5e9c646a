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


def test_rollout_sim_writes_results_and_cmlfq_wins(tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = CliRunner().invoke(
        _app(),
        ["rollout", "sim", "--steps", "5", "--gpus", "16", "--policy", "load-balance,cmlfq",
         "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["simulated"] is True
    assert doc["config"]["steps"] == 5 and doc["config"]["gpus"] == 16
    pols = doc["policies"]
    assert set(pols) == {"load-balance", "cmlfq"}
    for p in pols.values():
        assert len(p["makespan_s"]) == 5 and len(p["steps"]) == 5
        for s in p["steps"]:
            assert s["rollout_gpus"] + s["train_gpus"] <= 16
            assert s["mix"] and s["rollout_makespan_s"] > 0
    assert pols["cmlfq"]["mean_makespan_s"] < pols["load-balance"]["mean_makespan_s"]
    assert "Rollout-step makespan" in result.output and "simulated" in result.output


def test_rollout_sim_fixed_mix_and_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(_app(), ["rollout", "sim", "--steps", "1", "--gpus", "8", "--prompts",
                                "4", "--samples", "4", "--mix", "tp1x4,tp2x1", "--policy",
                                "cmlfq,length-predict,load-balance:nosticky", "--out",
                                str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["policies"]["cmlfq"]["steps"][0]["mix"] == "tp1x4,tp2x1"
    assert doc["policies"]["cmlfq"]["steps"][0]["train_gpus"] == 2
    bad = runner.invoke(_app(), ["rollout", "sim", "--policy", "nope"])
    assert bad.exit_code == 2 and "valid names" in bad.output
    big = runner.invoke(_app(), ["rollout", "sim", "--gpus", "4", "--mix", "tp4x2"])
    assert big.exit_code == 2


def test_rollout_live_goes_through_the_gateway_unless_direct(monkeypatch) -> None:
    import turnstile.rollout.live as live

    seen = []

    def fake_run_live(cfg, log=None, router=None):  # no engines: only the flag's wiring
        seen.append(cfg.via_gateway)
        return {"via_gateway": cfg.via_gateway, "steps": []}

    monkeypatch.setattr(live, "run_live", fake_run_live)
    runner = CliRunner()
    assert runner.invoke(_app(), ["rollout", "live"]).exit_code == 0
    direct = runner.invoke(_app(), ["rollout", "live", "--direct"])
    assert direct.exit_code == 0, direct.output
    assert seen == [True, False] and "direct" in direct.output
