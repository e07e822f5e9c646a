"""`turnstile tune`: the halves, the choice under no harm, the warnings, the CLI's outputs and
that the chosen spec is one `serve` runs (simulated)."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from turnstile.bench.tune import (
    REPORT,
    TUNE,
    TuneConfig,
    choose,
    deploy_line,
    run_tune,
    split_halves,
)
from turnstile.bench.tune_space import BASELINE, custom_space, get_space, space_names
from turnstile.cli import app
from turnstile.sim.engine_group import EngineGroup
from turnstile.workload import synth
from turnstile.workload.jsonl import write_workload

runner = CliRunner()


def _groups(count: int = 2) -> list[EngineGroup]:
    return [EngineGroup(gpu="H100", model="llama-3.1-8b", count=count)]


def _recording(tmp_path, n: int, seed: int = 0):
    path = tmp_path / "sessions.jsonl"
    write_workload(path, synth.generate(synth.DEFAULT_SPEC, n, seed), meta={"source": "test"})
    return path


# ------------------------------------------------------------------ the halves
def test_halves_are_disjoint_equal_and_independent_of_order():
    wfs = synth.generate(synth.DEFAULT_SPEC, 41, 0)
    a, b = split_halves(wfs, seed=3)
    assert len(a) == 21 and len(b) == 20
    assert {w.id for w in a}.isdisjoint({w.id for w in b})
    assert {w.id for w in a} | {w.id for w in b} == {w.id for w in wfs}
    a2, b2 = split_halves(list(reversed(wfs)), seed=3)
    assert [w.id for w in a2] == [w.id for w in a] and [w.id for w in b2] == [w.id for w in b]
    assert [w.id for w in split_halves(wfs, seed=4)[0]] != [w.id for w in a]


# ------------------------------------------------------------------ the choice
def _cells(table: dict[str, dict[str, dict[str, tuple[float, float, float]]]]):
    """Cells as ``cells_from_runs`` makes them, from {half: {load: {spec: (p95, mean,
    ttft_p95) ratios vs eager}}}."""
    cells = []
    for half, loads in table.items():
        for load, per in loads.items():
            pols = {BASELINE: {"ratio": {"p95": 1.0, "mean": 1.0, "ttft_p95": 1.0}}}
            for spec, (p95, mean, ttft) in per.items():
                pols[spec] = {"ratio": {"p95": p95, "mean": mean, "ttft_p95": ttft}}
            cells.append({"family": half, "cluster": "c", "load": load, "policies": pols})
    return cells


def _both(per_load):
    return {TUNE: per_load, REPORT: per_load}


def test_the_dominating_candidate_is_chosen_and_the_halves_agree():
    loads = {"sat×0.5": {"a": (1.0, 1.0, 1.0), "b": (1.1, 1.0, 1.0), "c": (1.4, 1.2, 1.0)},
             "sat×1": {"a": (1.2, 1.1, 1.0), "b": (1.3, 1.1, 1.0), "c": (2.0, 1.5, 0.95)},
             "sat×2": {"a": (1.1, 1.1, 1.0), "b": (1.5, 1.3, 1.0), "c": (2.5, 2.0, 1.2)}}
    v = choose(_cells(_both(loads)), [BASELINE, "a", "b", "c"], half_sessions=150)
    assert v["chosen"] == "c" and v["report_best"] == "c"
    assert v["agree"] and v["warnings"] == []


def test_a_candidate_that_harms_in_one_cell_is_excluded():
    # "c" has the best P95 gain everywhere but its TTFT P95 is 2x eager's in one cell
    loads = {"sat×0.5": {"b": (1.1, 1.0, 1.0), "c": (1.5, 1.2, 1.0)},
             "sat×1": {"b": (1.3, 1.1, 1.0), "c": (2.0, 1.5, 0.5)},
             "sat×2": {"b": (1.5, 1.3, 1.0), "c": (2.5, 2.0, 1.2)}}
    v = choose(_cells(_both(loads)), [BASELINE, "b", "c"], half_sessions=150)
    assert v["chosen"] == "b"
    rows = {r["spec"]: r for r in v["tune"]}
    assert not rows["c"]["ok"] and rows["c"]["misses"][0]["load"] == "sat×1"
    assert rows["c"]["score"] > rows["b"]["score"]


def test_eager_is_chosen_when_every_candidate_harms():
    loads = {"sat×1": {"b": (0.9, 1.0, 1.0), "c": (2.0, 0.8, 1.0)}}
    v = choose(_cells(_both(loads)), [BASELINE, "b", "c"], half_sessions=150)
    assert v["chosen"] == BASELINE and v["agree"]


def test_halves_that_disagree_are_reported():
    tune = {"sat×1": {"b": (1.1, 1.0, 1.0), "c": (2.0, 1.5, 1.0)}}
    report = {"sat×1": {"b": (1.4, 1.2, 1.0), "c": (1.0, 0.9, 1.0)}}  # c harms on report
    v = choose(_cells({TUNE: tune, REPORT: report}), [BASELINE, "b", "c"],
               half_sessions=150)
    assert v["chosen"] == "c" and v["report_best"] == "b" and not v["agree"]
    assert any("halves disagree" in w and "too little data" in w for w in v["warnings"])


# ------------------------------------------------------------------ end to end (simulated)
def test_on_a_workload_where_one_candidate_dominates_it_is_chosen():
    # round-robin routing throws away every session's prefix cache: cvar-fixed's KV gate
    # dominates both of them on this cluster
    wfs = synth.generate(synth.DEFAULT_SPEC, 100, 1)
    cands = custom_space(["fcfs-workflow+round-robin", "cvar-fixed", "plas+round-robin"])
    doc = run_tune(wfs, TuneConfig(groups=_groups(), cluster="2xH100", candidates=cands,
                                   search_runs=4), workers=2)
    assert doc["simulated"] is True and doc["saturation"]["found"]
    assert doc["chosen"] == "cvar-fixed"
    tune_rows = {r["spec"]: r for r in doc["tune"]}
    assert tune_rows["cvar-fixed"]["score"] > 1.2
    assert not tune_rows["fcfs-workflow+round-robin"]["ok"]
    assert not tune_rows["plas+round-robin"]["ok"]
    assert {c["load"] for c in doc["cells"]} == {"sat×0.5", "sat×1", "sat×2"}
    assert {c["family"] for c in doc["cells"]} == {TUNE, REPORT}


def test_a_too_small_workload_says_there_is_too_little_data():
    wfs = synth.generate(synth.DEFAULT_SPEC, 8, 0)
    doc = run_tune(wfs, TuneConfig(groups=_groups(1), cluster="1xH100",
                                   candidates=custom_space(["cvar-fixed"]), search_runs=3),
                   workers=1)
    assert doc["sessions"] == {"tune": 4, "report": 4}
    assert any("too little data" in w for w in doc["warnings"])


# ------------------------------------------------------------------ the space and the CLI
def test_list_shows_every_candidate_of_the_space():
    res = runner.invoke(app, ["tune", "--list"])
    assert res.exit_code == 0, res.output
    specs = [c.spec for c in get_space("default")]
    assert specs[0] == BASELINE and len(specs) == len(set(specs))
    lines = [ln.split()[0] for ln in res.output.splitlines()[1:] if ln.strip()]
    assert lines == specs
    wide = runner.invoke(app, ["tune", "--list", "--space", "wide"])
    assert wide.exit_code == 0 and len(wide.output.splitlines()) == len(get_space("wide")) + 1


@pytest.mark.parametrize("name", space_names())
def test_every_declared_candidate_parses(name):
    from turnstile.policies import PolicySet

    for c in get_space(name):
        PolicySet.from_spec(c.spec)


@pytest.mark.parametrize("args, text", [
    (["tune"], "needs --trace"),
    (["tune", "--trace", "nope.jsonl"], "no such file"),
    (["tune", "--list", "--candidates", "cvar,bogus"], "unknown policy 'bogus'"),
    (["tune", "--list", "--space", "huge"], "--space 'huge'"),
])
def test_usage_mistakes_are_one_line_and_exit_2(args, text):
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and text in res.output


def test_tune_writes_its_report_and_serve_accepts_the_chosen_spec(tmp_path, monkeypatch):
    rec = _recording(tmp_path, 30)
    out = tmp_path / "out"
    res = runner.invoke(app, ["tune", "--trace", str(rec), "--engines", "2", "--candidates",
                              "cvar-fixed,plas", "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == "turnstile-tune" and doc["simulated"] is True
    assert doc["chosen"] in ("eager", "cvar-fixed", "plas")
    assert [r["spec"] for r in doc["report"]] == ["eager", "cvar-fixed", "plas"]
    assert doc["deploy"] == deploy_line(doc["chosen"], 2) and doc["deploy"] in res.output
    assert "too little data" in res.output  # 15 sessions a half
    html = (out / "report.html").read_text()
    assert "simulated" in html and doc["deploy"].replace("'", "&#x27;") in html

    # the deploy line, with real URLs, through serve's own flag and spec parsing
    import uvicorn

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app_, **kw: served.setdefault("app", app_))
    argv = shlex.split(doc["deploy"])[1:]
    argv = [f"http://127.0.0.1:{9000 + i}" if a.startswith("URL") else a
            for i, a in enumerate(argv)]
    res = runner.invoke(app, [*argv, "--port", "0"])
    assert res.exit_code == 0, res.output
    assert f"policy={doc['chosen']}" in res.output and "app" in served


def test_candidates_keep_a_spec_with_options_whole():
    res = runner.invoke(app, ["tune", "--list", "--candidates",
                              "cvar:budget=fixed,kv_fill=0.6,plas"])
    assert res.exit_code == 0, res.output
    specs = [ln.split()[0] for ln in res.output.splitlines()[1:] if ln.strip()]
    assert specs == [BASELINE, "cvar:budget=fixed,kv_fill=0.6", "plas"]
