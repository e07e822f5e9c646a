"""The A/B pieces that need no real engine: workload, prediction, aggregation, goals, report;
the small-chunk attention term of the fitted step model; the gateway settings the A/B relies on
(an engine's KV capacity reaches the release policy, the engine's cache hits reach it too)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from turnstile.calibrate.ab import (
    AbEngines,
    ServingTerms,
    aggregate,
    build_sessions,
    cell_row,
    cell_workload,
    check_goals,
    plot_ab,
    policy_spec,
    predict,
    render_table,
    repredict,
    sim_workflows,
    slot_kv_tokens,
    with_profile_slots,
)
from turnstile.calibrate.ab_real import AbRun, gateway_toml
from turnstile.calibrate.fidelity import TraceScale
from turnstile.gateway.config import load_config
from turnstile.gateway.protocol import cached_tokens
from turnstile.gateway.service import Gateway
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.profile_fit import fit_profile
from turnstile.workload.model import ToolCall, Turn, Workflow

SCALE = TraceScale(max_output=16, tool_div=20.0, max_tool_s=0.5, max_context=600, max_turns=6)
PERF = FittedPerf(0.002, 1e-4, 6e-4, 1e-6, 5e-8, engine="test")
ENGINES = AbEngines(count=2, n_parallel=2, ctx=1536)


def test_build_sessions_synthetic_scaled_chains() -> None:
    sessions = build_sessions([], 0, 5, SCALE, seed=3)
    assert len(sessions) == 5
    for wf in sessions:
        assert wf.id.startswith("synth-")
        assert 4 <= len(wf.turns) <= SCALE.max_turns
        last = wf.turns[-1]
        assert last.prompt_tokens + last.output_tokens <= SCALE.max_context
        assert all(t.think_s == 0 and t.output_tokens <= 16 for t in wf.turns)
        for a, b in zip(wf.turns, wf.turns[1:], strict=False):  # a chain: context grows
            assert b.context_tokens == a.prompt_tokens + a.output_tokens


def test_cell_workload_same_sessions_seeded_arrivals() -> None:
    sessions = build_sessions([], 0, 4, SCALE, seed=1)
    a, b = cell_workload(sessions, 2.0, 7), cell_workload(sessions, 2.0, 7)
    assert [w.arrival_s for w in a] == [w.arrival_s for w in b]
    assert a[0].arrival_s == 0.0
    assert sorted(len(w.turns) for w in a) == sorted(len(w.turns) for w in sessions)
    slow = cell_workload(sessions, 0.5, 7)
    assert slow[-1].arrival_s > a[-1].arrival_s  # a lower rate spreads the same arrivals


def test_sim_workflows_adds_template_tokens_and_stays_a_chain() -> None:
    wf = Workflow("w", 0.0, (Turn(100, 10), Turn(20, 5, 110), Turn(30, 5, 135)))
    (got,) = sim_workflows([wf], per_message=6)
    assert [t.input_tokens for t in got.turns] == [112, 26, 36]
    assert [t.context_tokens for t in got.turns] == [0, 122, 153]


def test_sim_workflows_as_the_gateway_sees_them() -> None:
    wf = Workflow("w", 0.0, (Turn(100, 10, tools=(ToolCall("Bash", 0.2), ToolCall("Read", 0.1))),
                             Turn(20, 5, 110), Turn(30, 5, 135)))
    (got,) = sim_workflows([wf], per_message=6, session_idle_s=0.8)
    # one unnamed pause per turn (the replay sends no tool messages: one pooled latency key),
    # the tool time kept; after the last turn the session stays open until the gateway's sweep
    # closes it (idle 0.8 s + half the 0.2-s sweep period)
    assert [t.tools for t in got.turns] == [(ToolCall("", pytest.approx(0.3)),),
                                            (ToolCall("", 0.0),), (ToolCall("", 0.9),)]
    assert [t.input_tokens for t in got.turns] == [112, 26, 36]
    (plain,) = sim_workflows([wf], per_message=6)
    assert plain.turns[0].tools == wf.turns[0].tools and plain.turns[2].tools == ()
    # a template measured on the engine: 17 tokens around each later turn's two messages
    (measured,) = sim_workflows([wf], per_message=6, turn_template_tokens=17)
    assert [t.input_tokens for t in measured.turns] == [112, 37, 47]
    assert [t.context_tokens for t in measured.turns] == [0, 122, 164]


def test_serving_terms_lengthen_pauses_slow_the_engine_and_add_the_last_round_trip() -> None:
    wf = Workflow("w", 0.0, (Turn(100, 10, tools=(ToolCall("Bash", 0.2),)),
                             Turn(20, 5, 110), Turn(30, 5, 135)))
    (got,) = sim_workflows([wf], per_message=6, session_idle_s=0.8, turn_overhead_s=0.05)
    # every pause but the idle close after the last turn carries a turn's round trip
    assert [t.tools[0].duration_s for t in got.turns] == [pytest.approx(0.25), 0.05,
                                                          pytest.approx(0.9)]
    slow = PERF.scaled(1.5)
    assert slow.step_time(300, 2, 600, 4e4) == pytest.approx(1.5 * PERF.step_time(300, 2, 600, 4e4))
    with pytest.raises(ValueError):
        PERF.scaled(0.0)
    with pytest.raises(ValueError):
        ServingTerms(turn_overhead_s=-1.0)
    sessions = build_sessions([], 0, 6, SCALE, seed=2)
    wfs = cell_workload(sessions, 0.5, 0)  # light load: flows grow by the terms, not queueing
    base = cell_row(predict(wfs, ["eager"], ENGINES, PERF, 0.8)["eager"])
    served = cell_row(predict(wfs, ["eager"], ENGINES, PERF, 0.8,
                              ServingTerms(turn_overhead_s=0.05, engine_slowdown=1.5))["eager"])
    shortest = min(len(w.turns) for w in wfs)
    assert served["flow_p50_s"] > base["flow_p50_s"] + 0.05 * shortest
    assert served["workflows"] == base["workflows"] == 6
    only_last = cell_row(ServingTerms(turn_overhead_s=0.5).metrics(
        predict(wfs, ["eager"], ENGINES, PERF, 0.8)["eager"]))
    assert only_last["flow_p95_s"] == pytest.approx(base["flow_p95_s"] + 0.5)


def test_each_policy_can_be_predicted_with_its_own_serving_terms() -> None:
    """A mapping of terms by policy: each policy (and its rerun) as if predicted alone with its
    own; a policy the mapping lacks with none."""
    sessions = build_sessions([], 0, 6, SCALE, seed=2)
    wfs = cell_workload(sessions, 0.5, 0)
    slow, fast = ServingTerms(turn_overhead_s=0.2), ServingTerms(turn_overhead_s=0.01)
    got = predict(wfs, ["eager", "cvar", "eager@rerun", "plas"], ENGINES, PERF, 0.8,
                  {"eager": slow, "cvar": fast})
    assert list(got) == ["eager", "cvar", "eager@rerun", "plas"]
    assert got["eager"] == predict(wfs, ["eager"], ENGINES, PERF, 0.8, slow)["eager"]
    assert got["cvar"] == predict(wfs, ["cvar"], ENGINES, PERF, 0.8, fast)["cvar"]
    assert got["eager@rerun"] == got["eager"]
    assert got["plas"] == predict(wfs, ["plas"], ENGINES, PERF, 0.8)["plas"]
    assert cell_row(got["eager"])["flow_p50_s"] > cell_row(
        predict(wfs, ["eager"], ENGINES, PERF, 0.8, fast)["eager"])["flow_p50_s"]


def test_gateway_view_retains_a_finished_sessions_slot_until_closed() -> None:
    sessions = build_sessions([], 0, 10, SCALE, seed=0)
    wfs = cell_workload(sessions, 20.0, 0)
    known = cell_row(predict(wfs, ["eager+ttl"], ENGINES, PERF)["eager+ttl"])
    seen = cell_row(predict(wfs, ["eager+ttl"], ENGINES, PERF, session_idle_s=0.8)["eager+ttl"])
    assert known["workflows"] == seen["workflows"] == 10
    # the gateway pins a slot after every turn, the last one too (it cannot know it is the
    # last), until the TTL: other sessions find fewer slots and lose more of their contexts
    assert seen["prefix_hit_rate"] < known["prefix_hit_rate"] - 0.03


def test_predict_contention_eager_recomputes_cvar_gates() -> None:
    sessions = build_sessions([], 0, 10, SCALE, seed=0)
    wfs = cell_workload(sessions, 20.0, 0)
    pred = predict(wfs, ["eager", "cvar"], ENGINES, PERF)
    eager, cvar = cell_row(pred["eager"]), cell_row(pred["cvar"])
    assert eager["workflows"] == cvar["workflows"] == 10
    # 10 sessions arriving at once on 4 slots: eager loses contexts, cvar's gate keeps them
    assert eager["recomputed_prompt_tokens"] > cvar["recomputed_prompt_tokens"]
    assert eager["prefix_hit_rate"] < cvar["prefix_hit_rate"]


def test_engines_are_simulated_as_llama_cpp_slots_and_repredict_keeps_the_measurements() -> None:
    slots = ENGINES.group(PERF)
    assert (slots.kv_slots, slots.slot_tokens, slots.max_num_seqs) == (2, 768, 2)
    paged = AbEngines(count=2, n_parallel=2, ctx=1536, kv_model="paged").group(PERF)
    assert paged.kv_slots == 0 and paged.kv_tokens == 1536
    with pytest.raises(ValueError, match="kv_model"):
        AbEngines(count=1, n_parallel=1, ctx=100, kv_model="vllm")
    # the slot size the server reports (a profile's ``ctx_per_seq``) wins over -c / -np
    measured = FittedPerf(0.002, 1e-4, engine="test", meta={"ctx_per_seq": 1024})
    assert with_profile_slots(ENGINES, measured).group(PERF).slot_tokens == 1024
    assert with_profile_slots(ENGINES, PERF) is ENGINES
    sessions = build_sessions([], 0, 10, SCALE, seed=0)
    wfs = cell_workload(sessions, 20.0, 0)
    pred = predict(wfs, ["eager"], AbEngines(count=2, n_parallel=2, ctx=1536,
                                             kv_model="paged"), PERF)
    cell = {"policy": "eager", "load": 2.0, "rate": 20.0, "seed": 0,
            "real": {"flow_p95_s": 9.0}, "pred": cell_row(pred["eager"])}
    again = repredict([cell], sessions, {2.0: 20.0}, ENGINES, PERF)[0]
    assert again["real"] == {"flow_p95_s": 9.0} and again["pred_before"] == cell["pred"]
    # two slots per engine hold two sessions however short: more is recomputed than when
    # paged KV holds 1536 tokens of them
    assert (again["pred"]["recomputed_prompt_tokens"]
            > cell["pred"]["recomputed_prompt_tokens"])
    rows = aggregate([again])
    assert rows[0]["pred_before"]["flow_p95_s"] == cell["pred"]["flow_p95_s"]


def _cell(policy: str, load: float, seed: int, p95: float, pred95: float) -> dict:
    row = {"flow_p50_s": p95 / 2, "flow_p95_s": p95, "flow_mean_s": p95 / 1.5,
           "prefix_hit_rate": 0.5, "recomputed_prompt_tokens": 100.0, "prompt_tokens": 1e3,
           "workflows": 4, "unfinished": 0}
    pred = {**row, "flow_p95_s": pred95}
    return {"policy": policy, "load": load, "rate": load * 2, "seed": seed, "real": row,
            "pred": pred, "engine_hit_rate": 0.5}


def test_aggregate_ratios_and_goals() -> None:
    cells = []
    for seed, jitter in ((0, 1.0), (1, 1.2)):
        cells += [_cell("eager", 0.3, seed, 10.2, 10), _cell("cvar", 0.3, seed, 10, 10.3),
                  _cell("eager", 2.0, seed, 60 * jitter, 50), _cell("cvar", 2.0, seed, 20, 20)]
    rows = aggregate(cells)
    hi = next(r for r in rows if r["load"] == 2.0 and r["policy"] == "cvar")
    assert hi["real_ratio"]["min"] == pytest.approx(3.0)
    assert hi["real_ratio"]["max"] == pytest.approx(3.6)
    assert hi["real_ratio"]["mean"] == pytest.approx(3.3)
    assert hi["pred_ratio"]["mean"] == pytest.approx(2.5)
    assert hi["real"]["flow_p95_s"] == pytest.approx(20)
    goals = check_goals(rows)
    assert goals["gain_met"] and goals["light_met"] and goals["ranking_met"]
    # within the tie band the simulator's order is free (10.2 vs 10 real, 10 vs 10.3 predicted)
    assert goals["ranking"]["0.3"]["real"] != goals["ranking"]["0.3"]["pred"]
    bad = aggregate([*cells[:2], _cell("eager", 2.0, 0, 60, 15), _cell("cvar", 2.0, 0, 20, 20)])
    assert check_goals(bad)["ranking"]["2.0"]["misordered_pairs"] == [["eager", "cvar"]]
    assert goals["ratio_max_err"] == pytest.approx(abs(2.5 - 3.3) / 3.3)
    assert not goals["ratio_met"]  # 24% off > 20%
    table = render_table(rows)
    assert table.count("\n| ") == 4 and "3.30× (3.00–3.60)" in table


def test_a_rerun_of_the_baseline_is_the_noise_floor_not_a_policy() -> None:
    cells = [_cell("eager", 2.0, 0, 60, 50), _cell("cvar", 2.0, 0, 20, 20),
             _cell("eager@rerun", 2.0, 0, 48, 50)]
    rows = aggregate(cells)
    rerun = next(r for r in rows if r["policy"] == "eager@rerun")
    assert rerun["real_ratio"]["mean"] == pytest.approx(1.25)  # eager / its own rerun
    goals = check_goals(rows)
    assert goals["noise_floor_max"] == pytest.approx(0.25)
    assert goals["ranking"]["2.0"]["real"] == ["cvar", "eager"]  # the rerun is not ranked
    assert [e["policy"] for e in goals["ratio_errors"]] == ["cvar"]
    assert "| eager@rerun |" in render_table(rows)
    # a later group that ran the policies in another order lists them as the first group did
    later = [_cell("cvar", 3.0, 0, 20, 20), _cell("eager", 3.0, 0, 60, 50)]
    assert [r["policy"] for r in aggregate(cells + later) if r["load"] == 3.0] == ["eager", "cvar"]


def test_predict_runs_a_rerun_label_as_its_policy() -> None:
    sessions = build_sessions([], 0, 4, SCALE, seed=0)
    wfs = cell_workload(sessions, 5.0, 0)
    pred = predict(wfs, ["eager", "eager@rerun"], ENGINES, PERF)
    assert pred["eager@rerun"] == pred["eager"] and policy_spec("eager@rerun") == "eager"


def test_cells_rotate_the_policy_order_and_rerun_the_baseline_last() -> None:
    run = AbRun(policies=["eager", "cvar", "x"], loads=[1.0], seeds=[0, 1, 2], engines=ENGINES,
                rerun_baseline=True)
    assert run.cell_order(0) == ["eager", "cvar", "x", "eager@rerun"]
    assert run.cell_order(1) == ["cvar", "x", "eager", "eager@rerun"]
    assert run.cell_order(5) == ["x", "eager", "cvar", "eager@rerun"]
    assert run.cell_policies == ["eager", "cvar", "x", "eager@rerun"]


def test_plot_ab_writes_png(tmp_path: Path) -> None:
    rows = aggregate([_cell("eager", 1.0, 0, 5, 5), _cell("cvar", 1.0, 0, 4, 4),
                      _cell("eager", 2.0, 0, 9, 8), _cell("cvar", 2.0, 0, 4, 5)])
    out = plot_ab(rows, tmp_path / "ab.png", "test")
    assert out.stat().st_size > 1000


# --- the small-chunk attention term -----------------------------------------------------------


def _chunk_samples(truth: FittedPerf, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(120):
        n = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
        c = rng.randint(0, 2000)
        k = rng.randint(0, 4)
        f = (float(n), float(k), float(c + k * 500), n * c + n * (n + 1) / 2)
        out.append((f, truth.step_time(*f) * (1 + rng.uniform(-0.01, 0.01))))
    return out


def test_fit_recovers_small_chunk_term() -> None:
    truth = FittedPerf(0.004, 2e-4, 1.5e-3, 4e-6, 3e-7, b5=1e-6, small_chunk_tokens=16.0)
    samples = _chunk_samples(truth, 0)
    linear = fit_profile(samples, relative=True)
    fit = fit_profile(samples, relative=True, small_chunk_knees=(4, 16, 64))
    assert fit.small_chunk_tokens == 16.0
    assert fit.b5 == pytest.approx(1e-6, rel=0.1)
    assert fit.meta["fit"]["median_abs_rel_err"] < 0.5 * linear.meta["fit"]["median_abs_rel_err"]
    # a small append to a long context costs more per pair than the linear model says
    assert fit.step_time(8, 0, 1500, 8 * 1500 + 36) > linear.step_time(8, 0, 1500, 8 * 1500 + 36)


def test_fit_keeps_linear_model_when_term_does_not_help() -> None:
    truth = FittedPerf(0.004, 2e-4, 1.5e-3, 4e-6, 3e-7)
    fit = fit_profile(_chunk_samples(truth, 1), relative=True, small_chunk_knees=(4, 16, 64))
    assert fit.b5 == 0.0 and fit.small_chunk_tokens == 0.0


def test_profile_file_round_trip_with_small_chunk_term(tmp_path: Path) -> None:
    perf = FittedPerf(0.004, 2e-4, 1.5e-3, 4e-6, 3e-7, b5=1e-6, small_chunk_tokens=16.0)
    perf.to_profile(tmp_path / "p.json")
    back = FittedPerf.from_profile(tmp_path / "p.json")
    assert back.b5 == perf.b5 and back.small_chunk_tokens == 16.0
    assert back.step_time(4, 1, 900, 3610.0) == pytest.approx(perf.step_time(4, 1, 900, 3610.0))


def test_fit_tells_the_tile_threshold_from_a_knee(tmp_path: Path) -> None:
    """An engine whose attention turns cheap at once at 64 prefill tokens (llama.cpp's tiled
    flash attention): the threshold candidate wins over every knee, and the file keeps it."""
    truth = FittedPerf(0.004, 2e-4, 1.5e-3, 4e-6, 3e-7, b5=1e-6, small_chunk_tokens=64.0,
                       small_chunk_rule="below")
    assert truth.step_time(63, 0, 0, 6e4) - truth.step_time(63, 0, 0, 0.0) == pytest.approx(
        (3e-7 + 1e-6) * 6e4)
    assert truth.step_time(64, 0, 0, 6e4) - truth.step_time(64, 0, 0, 0.0) == pytest.approx(
        3e-7 * 6e4)
    samples = _chunk_samples(truth, 2)
    knees = fit_profile(samples, relative=True, small_chunk_knees=(4, 16, 64))
    fit = fit_profile(samples, relative=True, small_chunk_knees=(4, 16, 64),
                      small_chunk_thresholds=(64,))
    assert (fit.small_chunk_rule, fit.small_chunk_tokens) == ("below", 64.0)
    assert fit.b5 == pytest.approx(1e-6, rel=0.1)
    assert fit.meta["fit"]["median_abs_rel_err"] < 0.5 * knees.meta["fit"]["median_abs_rel_err"]
    fit.to_profile(tmp_path / "p.json")
    back = FittedPerf.from_profile(tmp_path / "p.json")
    assert back.small_chunk_rule == "below"
    assert back.step_time(40, 1, 900, 4e4) == fit.step_time(40, 1, 900, 4e4)
    doc = json.loads((tmp_path / "p.json").read_text())
    del doc["coefficients"]["small_chunk_rule"]  # a profile from before the rule: a knee
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert FittedPerf.from_profile(tmp_path / "p.json").small_chunk_rule == "knee"
    # a knee model's samples keep their knee: the threshold is only a candidate
    knee_truth = FittedPerf(0.004, 2e-4, 1.5e-3, 4e-6, 3e-7, b5=1e-6, small_chunk_tokens=16.0)
    got = fit_profile(_chunk_samples(knee_truth, 0), relative=True,
                      small_chunk_knees=(4, 16, 64), small_chunk_thresholds=(64,))
    assert (got.small_chunk_rule, got.small_chunk_tokens) == ("knee", 16.0)
    with pytest.raises(ValueError, match="small_chunk_rule"):
        FittedPerf(0.004, small_chunk_rule="step")


# --- the gateway as the A/B configures it -----------------------------------------------------


def test_gateway_engine_kv_tokens_reach_the_release_policy(tmp_path: Path) -> None:
    toml = gateway_toml("cvar", ["http://127.0.0.1:9", "http://127.0.0.1:10"], ENGINES,
                        port=8123, session_idle_s=1.5, params={"release": {"kv_fill": 0.6}})
    (tmp_path / "gw.toml").write_text(toml)
    cfg = load_config(tmp_path / "gw.toml")
    assert cfg.policy == "cvar" and cfg.session_idle_s == 1.5
    gw = Gateway(cfg)
    view = gw.scheduler.view
    assert [view[e].capacity_tokens for e in view.ids] == [1536, 1536]
    assert gw.policies.release.kv_fill == 0.6
    # with the capacity known the KV gate is on: room = kv_fill × capacity
    assert gw.policies.release.kv_room(view) == pytest.approx(0.6 * 1536)


def test_cached_tokens_from_usage() -> None:
    assert cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}) == 7
    assert cached_tokens({"prompt_tokens": 9}) is None
    assert cached_tokens(None) is None


def test_slot_kv_tokens_is_slots_times_mean_live_context() -> None:
    wf = Workflow("w", 0.0, (Turn(100, 10), Turn(20, 5, 110)))
    # as the engine sees them: prompts 112 and 148 (template tokens), outputs 10 and 5
    assert slot_kv_tokens([wf], 2) == round(2 * ((112 + 10) + (148 + 5)) / 2)
    engines = AbEngines(count=1, n_parallel=2, ctx=4096, kv_tokens=275)
    assert engines.group(PERF).kv_tokens == 275 and engines.session_kv_tokens == 275
    assert AbEngines(count=1, n_parallel=2, ctx=4096).session_kv_tokens == 4096


def test_serving_terms_from_served_turns() -> None:
    """The serving probe's arithmetic on hand-made turns: the mean time outside the engine's
    own compute, and the median full prefill that ran alone against the model's time for
    that prompt (a prefill batched with another reports the whole step)."""
    from types import SimpleNamespace

    from turnstile.calibrate.ab_real import serving_terms
    from turnstile.core.state import TurnRecord, WorkflowRecord

    perf = FittedPerf(0.0, 1e-4, engine="test")  # 0.1 ms per prefill token, nothing else
    wf = WorkflowRecord("s", 0.0, "default", None)
    timings = {}
    # (engine, released, finished, prompt_n, cache_n, prompt_ms, predicted_ms)
    rows = [("a", 0.0, 0.100, 500, 0, 60.0, 20.0),   # alone: 60 ms against 50 modelled
            ("a", 1.0, 1.050, 20, 500, 5.0, 15.0),   # an append: not a full prefill
            ("a", 2.0, 2.140, 400, 20, 44.0, 16.0),  # alone: 44 against 40
            ("b", 2.0, 2.100, 300, 0, 39.0, 11.0),   # alone on its engine: 39 against 30
            ("a", 3.0, 3.200, 400, 0, 90.0, 10.0),   # these two shared steps: each reports
            ("a", 3.1, 3.250, 400, 0, 90.0, 10.0)]   # the step's time, 90 against 40
    for i, (eng, rel, fin, n, cached, pms, dms) in enumerate(rows):
        rec = TurnRecord(wf, i, Turn(input_tokens=n, output_tokens=8))
        rec.released_s, rec.finished_s, rec.engine = rel, fin, eng
        wf.turns.append(rec)
        timings[("s", i)] = {"prompt_n": n, "cache_n": cached, "prompt_ms": pms,
                             "predicted_ms": dms}
    rep = SimpleNamespace(records=[wf], engine_timings=timings)
    terms, info = serving_terms(rep, perf)  # type: ignore[arg-type]
    # outside the engine: 20, 30, 80, 50, 100 and 50 ms
    assert terms.turn_overhead_s == pytest.approx(0.330 / 6)
    assert terms.engine_slowdown == pytest.approx(1.2)  # median of 1.2, 1.1, 1.3
    assert info["turns"] == 6 and info["full_prefills"] == 5 and info["isolated_prefills"] == 3
    # too few alone: the lower quartile of all of them
    few = SimpleNamespace(records=[wf], engine_timings={k: v for k, v in timings.items()
                                                        if k[1] in (0, 4, 5)})
    assert serving_terms(few, perf)[0].engine_slowdown == pytest.approx(  # type: ignore[arg-type]
        float(np.quantile([1.2, 2.25, 2.25], 0.25)))
    with pytest.raises(RuntimeError, match="no engine timings"):
        empty = SimpleNamespace(records=[wf], engine_timings={})
        serving_terms(empty, perf)  # type: ignore[arg-type]


def test_best_of_measures_again_while_the_host_looks_busy() -> None:
    from turnstile.calibrate.ab_real import best_of

    said: list[str] = []
    scores = iter([0.3, 0.05, 0.01])
    got = best_of(lambda i: (i, next(scores)), lambda r: r[1], 0.1, 3, "fit error", said.append)
    assert got == (1, 0.05)  # the second attempt is under the limit: no third one
    assert len(said) == 1 and "fit error 0.3 is over 0.1" in said[0]
    # every attempt over the limit: the best of them is kept, nothing said after the last
    scores = iter([0.4, 0.2, 0.3])
    said.clear()
    assert best_of(lambda i: (i, next(scores)), lambda r: r[1], 0.1, 3, "x", said.append) == (
        1, 0.2)
    assert len(said) == 2
    # one attempt: measured once whatever it scores
    assert best_of(lambda i: i, lambda r: 9.0, 0.1, 1, "x", said.append) == 0
