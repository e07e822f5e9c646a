"""``turnstile replay``: closed-loop agents against the gateway (and an engine directly), writing
the same results.json as ``turnstile bench``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from turnstile.bench.replay import ReplaySpec, load_workflows, plan_workflow, run_replay
from turnstile.bench.report import load_results
from turnstile.gateway.cli import register
from turnstile.workload.model import ToolCall, Turn, Workflow

pytestmark = pytest.mark.timeout(60)


def test_plan_scales_a_workflow_into_the_context() -> None:
    wf = Workflow("w", 0.0, tuple(
        Turn(input_tokens=20_000 if i == 0 else 3_000, output_tokens=500,
             context_tokens=0 if i == 0 else 20_000 + i * 3_500,
             tools=(ToolCall("bash", 1.0),)) for i in range(5)))
    plan = plan_workflow(wf, max_context=2048, max_tokens=32, max_turns=None)
    assert plan.outputs == [32] * 5
    assert 0 < plan.scale < 0.1
    total = sum(plan.inputs) + sum(plan.outputs[:-1]) + 6 * 10
    assert total <= 2048 - 32
    assert plan.inputs[0] > plan.inputs[1]  # the shape is kept
    short = plan_workflow(wf, max_context=2048, max_tokens=32, max_turns=2)
    assert len(short.inputs) == 2


def test_replay_against_gateway_and_engine(fake_engines: Any, gateways: Any,
                                           tmp_path: Path) -> None:
    eng = fake_engines(count_prompt=True, tpot_s=0.001)
    gw = gateways([eng.url], policy="cvar+kv-affinity")
    spec = ReplaySpec(target=gw.url, rate=50.0, workflows=6, time_scale=0.001, max_turns=3,
                      max_context=1024, max_tokens=8)
    wfs, info = load_workflows(spec)
    assert len(wfs) == 6 and info["rate"] == 50.0
    path, _ = asyncio.run(run_replay(spec, wfs, info, tmp_path / "gw"))
    doc = load_results(path)
    assert doc["simulated"] is False
    (res,) = doc["policies"]
    assert res["policy"] == "cvar+kv-affinity"  # from the gateway's /health
    m = res["metrics"]
    n_turns = sum(min(len(w.turns), 3) for w in wfs)
    assert m["workflows"] == 6 and m["workflows_unfinished"] == 0
    assert m["turns"] == n_turns and m["output_tokens"] == 8 * n_turns
    assert m["ttft_s"]["count"] == n_turns and m["hold_s"]["count"] == n_turns
    assert m["flow_time_s"]["p95"] > 0
    assert res["replay"]["errors"] == {}
    assert res["replay"]["requests"] == n_turns
    assert 3.0 <= res["replay"]["chars_per_token"] <= 5.0  # the fake counts chars / 4
    # the engine saw growing contexts per session
    sessions: dict[str, list[int]] = {}
    for r in eng.engine.requests:
        sid = r.headers.get("x-session-id")
        if sid:
            sessions.setdefault(sid, []).append(len(r.body["messages"]))
    assert all(lens == list(range(1, 2 * len(lens), 2)) for lens in sessions.values())

    direct = ReplaySpec(target=eng.url, rate=50.0, workflows=3, time_scale=0.0, max_turns=2,
                        max_context=1024, max_tokens=4, stream=False)
    wfs, info = load_workflows(direct)
    path2, _ = asyncio.run(run_replay(direct, wfs, info, tmp_path / "direct"))
    doc2 = load_results(path2)
    assert doc2["policies"][0]["policy"] == "direct"
    # the same fields as the simulator's results
    assert set(doc2["policies"][0]["metrics"]) == set(m)
    assert set(doc) == set(doc2) >= {"schema", "version", "simulated", "config", "trace",
                                     "policies"}


def test_replay_with_a_known_tokenizer_sends_only_the_sessions(fake_engines: Any,
                                                                 tmp_path: Path) -> None:
    eng = fake_engines(count_prompt=True, tpot_s=0.001)
    spec = ReplaySpec(target=eng.url, rate=50.0, workflows=3, time_scale=0.0, max_turns=2,
                      max_context=1024, max_tokens=4, stream=False, chars_per_token=4.0)
    wfs, info = load_workflows(spec)
    path, _ = asyncio.run(run_replay(spec, wfs, info, tmp_path))
    res = load_results(path)["policies"][0]
    assert res["replay"]["chars_per_token"] == 4.0
    n_turns = sum(min(len(w.turns), 2) for w in wfs)
    # no calibration request: every request the engine saw is a session's turn
    assert len(eng.engine.requests) == res["replay"]["requests"] == n_turns
    assert all(r.headers.get("x-session-id") for r in eng.engine.requests)


def test_replay_command(fake_engines: Any, gateways: Any, tmp_path: Path) -> None:
    eng = fake_engines(count_prompt=True)
    gw = gateways([eng.url])
    app = typer.Typer()
    register(app)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["replay", "--target", gw.url, "--rate", "100", "--workflows",
                                 "3", "--max-turns", "2", "--time-scale", "0", "--out",
                                 str(out), "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "3 workflows" in r.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["replay"]["workflows"] == 3 and "api_key" not in doc["config"]["replay"]
