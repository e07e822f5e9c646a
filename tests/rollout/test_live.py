"""Live mode: tool-calling trajectories through the gateway and two real llama.cpp engines (two
buckets), routed by the same C-MLFQ class the simulator uses (the gateway follows its placement
through ``x-turnstile-engine``). Also the tool sandbox on its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from turnstile.rollout.live import LiveConfig, ToolSandbox, plan_tool, run_live
from turnstile.rollout.routing import CMLFQRouter, LevelBounds
from turnstile.workload.model import ToolCall


def test_sandbox_tools(tmp_path: Path) -> None:
    box = ToolSandbox(tmp_path / "box")
    run = lambda tool, arg, t=0.2: asyncio.run(box.run(tool, arg, t))  # noqa: E731
    assert run("calculator", "6 * 7 + 1")[:2] == ("ok", "43")
    assert run("calculator", "1 / 0")[0] == "error"
    assert run("calculator", "__import__('os')")[0] == "error"
    assert run("write_file", "a.txt\nhello")[0] == "ok"
    assert run("read_file", "a.txt")[:2] == ("ok", "hello")
    assert run("read_file", "missing.txt")[0] == "error"
    assert run("write_file", "../escape.txt\nx")[0] == "error"
    assert not (tmp_path / "escape.txt").exists()
    status, _, secs = run("sleep", "5", 0.05)
    assert status == "timeout" and secs < 1.0
    assert run("sleep", "0.01")[0] == "ok"


def test_planned_tools_fail_exactly_when_the_spec_fails(tmp_path: Path) -> None:
    cfg = LiveConfig(tool_timeout_s=0.05)
    box = ToolSandbox(tmp_path)
    box.write_file("notes.txt", "n")
    for name in ("Bash", "Read", "Grep", "Edit", "Write", "TodoWrite", "WebFetch", "other"):
        for status in ("ok", "error", "timeout"):
            call = ToolCall(name, 2.0, status, 10)  # type: ignore[arg-type]
            tool, arg = plan_tool(call, "t", 1, 0, cfg)
            got = asyncio.run(box.run(tool, arg, cfg.tool_timeout_s))[0]
            assert got == status, (name, status, tool, arg)


@pytest.mark.slow
def test_live_batch_through_the_gateway_and_two_real_engines(
    tmp_path: Path, llama_server_binary: Path
) -> None:
    # a small bound so that C-MLFQ demotes for real within a few short turns
    router = CMLFQRouter(bounds=LevelBounds(bounds=(12.0,)), min_dwell_turns=1, cost_aware=False)
    cfg = LiveConfig(trajectories=8, max_turns=4, max_tokens=16, steps=2, seed=1)
    assert cfg.via_gateway  # the default: every turn goes through the gateway
    t0 = time.perf_counter()
    result = run_live(cfg, router=router)
    assert time.perf_counter() - t0 < 60
    assert result["simulated"] is False and result["router_name"] == "cmlfq"
    assert result["via_gateway"] is True
    gw = result["gateway"]
    assert gw["policy"] == "eager+hinted"
    assert set(gw["engine_ids"]) == set(result["requests_per_engine"])
    turns = 0
    for step in result["steps"]:
        assert step["completed"] == step["trajectories"] == 8
        assert step["placement_mismatches"] == 0
        for tr in step["per_trajectory"]:
            assert tr["turns"] >= 1 and tr["output_tokens"] >= 2 * tr["turns"]
            assert all(not s.endswith("!") for s in tr["tools"])  # real outcome == spec
            assert all(k.count(":") == 2 for k in tr["tool_keys"])
            # the engine the gateway says served each turn is the one C-MLFQ placed it on
            assert tr["served_by"] == tr["engines"] and len(tr["engines"]) == tr["turns"]
        turns += step["turns"]
    assert sum(s["tool_calls"] for s in result["steps"]) > 0
    assert router.moves > 0  # demotions happened on real engines
    assert all(n > 0 for n in result["requests_per_engine"].values())
    # the gateway's own per-engine tally agrees with the router's placements, turn for turn
    assert gw["turns_per_engine"] == result["requests_per_engine"]
    assert (gw["hinted_turns"], gw["fallback_turns"]) == (turns, 0)
