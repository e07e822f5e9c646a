"""Live mode: tool-calling trajectories through the gateway and two real llama.cpp engines (two
buckets), routed by the gateway's own scheduler core with the same C-MLFQ policy class the
simulator uses. Also the tool sandbox and the gateway config on their own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from turnstile.gateway.config import load_config
from turnstile.rollout.live import LiveConfig, ToolSandbox, gateway_toml, plan_tool, run_live
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


def test_gateway_config_names_the_policy_and_the_buckets(tmp_path: Path) -> None:
    cfg = LiveConfig(policy="cmlfq", routing_params={"bounds": [12.0], "min_obs": 2})
    path = tmp_path / "gw.toml"
    path.write_text(gateway_toml(cfg, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 9999))
    gw = load_config(path)
    assert gw.policy == "eager+cmlfq" and gw.port == 9999
    assert gw.policy_params == {"routing": {"bounds": [12.0], "min_obs": 2}}
    assert [(e.name, e.tp, e.bucket) for e in gw.engines] == [
        ("e0-throughput", 1, "throughput"), ("e1-latency", 2, "latency")]
    gw.validate()  # the policy builds with those parameters


@pytest.mark.slow
def test_live_batch_through_the_gateway_and_two_real_engines(
    tmp_path: Path, llama_server_binary: Path
) -> None:
    # small bounds so that C-MLFQ moves for real within a few short turns: the trees learn from
    # step 0 and move step 1's trajectories after their tool returns. Libra's rules (starts in
    # the first bucket, moves both ways, no balance guard: the default would spread 8 starts
    # over both engines)
    cfg = LiveConfig(trajectories=8, max_turns=4, max_tokens=16, steps=3, seed=1,
                     routing_params={"bounds": [12.0], "min_obs": 2, "rebuild_every_done": 4,
                                     "balance": False, "start": "level0", "move_back": True})
    t0 = time.perf_counter()
    result = run_live(cfg)
    assert time.perf_counter() - t0 < 90
    assert result["simulated"] is False
    names = {"e0-throughput", "e1-latency"}
    for step in result["steps"]:
        assert step["completed"] == step["trajectories"] == 8
        for tr in step["per_trajectory"]:
            assert tr["turns"] >= 1 and tr["output_tokens"] >= 2 * tr["turns"]
            assert all(not s.endswith("!") for s in tr["tools"])  # real outcome == spec
            assert set(tr["served_by"]) <= names
    assert sum(s["tool_calls"] for s in result["steps"]) > 0
    # before the trees know anything, every trajectory starts on the throughput bucket (later
    # steps may start where a prompt's history says it ends); C-MLFQ moved some after tool
    # returns
    first = [tr["served_by"][0] for tr in result["steps"][0]["per_trajectory"]]
    assert set(first) == {"e0-throughput"}
    assert sum(s["moves"] for s in result["steps"][1:]) > 0
    # the gateway's own per-engine tally agrees with what the responses said
    assert result["gateway_turns_per_engine"] == result["turns_per_engine"]
