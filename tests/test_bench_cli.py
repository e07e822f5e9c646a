"""`turnstile bench` end to end: the evidence record and the side-by-side table."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from turnstile.bench.runner import LOAD_LEVELS, parse_load
from turnstile.cli import app

runner = CliRunner()

METRIC_KEYS = {"flow_time_s", "ttft_s", "engine_ttft_s", "tpot_s", "e2e_s", "throughput", "slo",
               "prefix_hit_rate", "recomputed_prefill_tokens", "cost"}


def test_bench_on_the_synthetic_workload_writes_an_evidence_record(tmp_path):
    res = runner.invoke(app, ["bench", "--policies", "eager,cvar", "--workflows", "15",
                              "--engines", "2", "--load", "0.5", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "simulated" in res.output and "cvar" in res.output
    d = json.loads((tmp_path / "results.json").read_text())
    assert d["simulated"] is True
    assert [p["policy"] for p in d["policies"]] == ["eager", "cvar"]
    for p in d["policies"]:
        assert set(p["metrics"]) >= METRIC_KEYS
        assert p["metrics"]["workflows"] == 15
        assert p["metrics"]["cost"]["tokens_per_dollar"] > 0
    assert d["config"]["workload"]["workflows"] == 15
    assert d["config"]["workload_sha256"]
    assert (tmp_path / "flow_cdf.png").stat().st_size > 1000


def test_bench_with_a_llama_cpp_profile_simulates_its_slots(tmp_path):
    from turnstile.sim.fitted_perf import FittedPerf

    prof = tmp_path / "profile.json"
    meta = {"engine_kind": "llama.cpp", "n_parallel": 2, "ctx_per_seq": 131072}
    FittedPerf(0.002, 1e-4, 6e-4, 1e-6, 5e-8, engine="llama.cpp", meta=meta).to_profile(prof)
    res = runner.invoke(app, ["bench", "--policies", "eager", "--workflows", "6", "--engines",
                              "2", "--load", "0.5", "--profile", str(prof), "--kv-tokens", "200000",
                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "results.json").read_text())
    eng = d["config"]["engines"][0]
    assert (eng["kv_slots"], eng["slot_tokens"], eng["max_num_seqs"]) == (2, 131072, 2)
    assert d["policies"][0]["metrics"]["workflows"] == 6


@pytest.mark.traces
def test_bench_on_the_real_agentcgroup_trace(tmp_path, traces_dir):
    trace = traces_dir / "agentcgroup_swerebench_claude_code"
    res = runner.invoke(app, ["bench", "--trace", str(trace), "--policies", "eager",
                              "--engines", "2", "--workflows", "40", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "results.json").read_text())
    assert d["trace"]["sha256"] and len(d["trace"]["sha256"]) == 64
    assert "Poisson" in d["trace"]["arrivals"]
    assert set(d["policies"][0]["metrics"]) >= METRIC_KEYS


def test_load_levels():
    assert parse_load("light") == LOAD_LEVELS["light"]
    assert parse_load("0.8") == 0.8
    for bad in ("-1", "0", "heavy-ish"):
        with pytest.raises(ValueError):
            parse_load(bad)


def test_bench_unannounced_ends_is_recorded_and_a_bad_idle_time_exits_2(tmp_path):
    res = runner.invoke(app, ["bench", "--policies", "eager", "--workflows", "6", "--engines",
                              "1", "--load", "0.3", "--unannounced-ends", "--session-idle-s",
                              "60", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "results.json").read_text())
    assert d["config"]["session_ends"] == "idle 60 s"
    assert d["policies"][0]["metrics"]["workflows"] == 6
    bad = runner.invoke(app, ["bench", "--workflows", "6", "--session-idle-s", "0"])
    assert bad.exit_code == 2
    assert "--session-idle-s" in bad.output and "> 0" in bad.output
