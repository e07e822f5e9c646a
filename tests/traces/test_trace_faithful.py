"""Importer faithfulness (issue 31, item 6): tool status from ``<returncode>``, time-outs only
from the agent's own signal, counted clamps and runaway outputs, a warning when a log has no
timestamps, and the AIPerf multi-turn Mooncake format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turnstile.traces import load_trace
from turnstile.traces.trajectory import RUNAWAY_OUTPUT_TOKENS


def _reply(created: int | None, prompt: int, out: int, text: str = "```bash\nls\n```"
           ) -> dict[str, Any]:
    resp: dict[str, Any] = {"usage": {"prompt_tokens": prompt, "completion_tokens": out}}
    if created is not None:
        resp["created"] = created
    return {"role": "assistant", "content": text, "extra": {"response": resp}}


def _obs(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **({"extra": extra} if extra else {})}


def _write(tmp_path: Path, messages: list[dict[str, Any]], name: str = "t") -> Path:
    p = tmp_path / f"{name}.traj.json"
    p.write_text(json.dumps({"trajectory_format": "mini-swe-agent-1", "info": {},
                             "messages": [{"role": "system", "content": "sys " * 50},
                                          {"role": "user", "content": "task"}, *messages]}))
    return p


PYTEST_HEADER = ("<returncode>0</returncode>\n<output>\nplatform linux -- Python 3.11\n"
                 "plugins: timeout-2.3.1, cov-5.0.0\n1 passed</output>")
TIMED_OUT = ("The last command <command>pytest</command> timed out and has been killed.\n"
             "The output of the command was:\n <output>\ncollected 10 items\n</output>")


def test_status_from_returncode_text_and_timeouts_only_from_the_agent(tmp_path: Path) -> None:
    msgs = [_reply(100, 1000, 20), _obs(PYTEST_HEADER),
            _reply(110, 1100, 20), _obs("<returncode>2</returncode>\n<output>err</output>"),
            _reply(120, 1200, 20), _obs(TIMED_OUT),
            _reply(200, 1300, 20), _obs("no code here"),
            _reply(210, 1400, 20, "done")]
    lt = load_trace(_write(tmp_path, msgs))
    statuses = [t.tools[0].status for t in lt.workflows[0].turns if t.tools]
    assert statuses == ["ok", "error", "timeout", "unknown"]


def test_swe_agent_timeout_only_from_its_own_message(tmp_path: Path) -> None:
    steps = [{"query": [{"role": "user", "content": "q" * 40}], "response": "r" * 40,
              "execution_time": 1.0, "observation": obs}
             for obs in ("plugins: timeout-2.3.1\n1 passed",
                         "The command 'pytest' was cancelled because it took more than 1800 "
                         "seconds. Please try a different command.")]
    p = tmp_path / "s.traj"
    p.write_text(json.dumps({"trajectory": steps, "info": {}}))
    lt = load_trace(p)
    assert [t.tools[0].status for t in lt.workflows[0].turns] == ["unknown", "timeout"]


def test_clamped_tool_times_prompts_and_runaway_outputs_are_counted(tmp_path: Path) -> None:
    msgs = [_reply(100, 1000, 20), _obs("<returncode>0</returncode>"),
            # the next call was created 0 s later: the LLM-time estimate exceeds the gap
            _reply(100, 1100, 40_000), _obs("<returncode>0</returncode>"),
            # the provider counted fewer prompt tokens than the transcript grew to
            _reply(2000, 1200, 20, "done")]
    lt = load_trace(_write(tmp_path, msgs))
    assert lt.counts["tool_time_clamped_to_zero"] == 1
    assert lt.counts["prompt_clamped_to_context"] == 1
    assert lt.counts["runaway_outputs"] == 1
    notes = " | ".join(lt.notes)
    assert "1 tool times clamped to 0" in notes
    assert "1 prompts shorter than the previous prompt + output" in notes
    assert f"runaway outputs (≥ {RUNAWAY_OUTPUT_TOKENS:,} tokens, max 40,000)" in notes
    assert not lt.warnings  # every tool call had timing


def test_a_log_without_timestamps_warns_that_tool_time_is_zero(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from turnstile.cli import app

    msgs = [_reply(None, 1000, 20), _obs("<returncode>0</returncode>"),
            _reply(None, 1100, 20), _obs("<returncode>0</returncode>"),
            _reply(None, 1200, 20, "done")]
    p = _write(tmp_path, msgs)
    lt = load_trace(p)
    assert lt.warnings and "modelled as zero for 2 of 2 tool calls" in lt.warnings[0]
    runner = CliRunner()
    info = runner.invoke(app, ["traces", "info", str(p)])
    assert info.exit_code == 0 and "modelled as zero" in info.output
    bench = runner.invoke(app, ["bench", "--trace", str(p), "--workflows", "3",
                                "--engines", "1"])
    assert bench.exit_code == 0, bench.output
    assert "modelled as zero" in bench.output
    # a converted workload file keeps the warning
    out = tmp_path / "w.jsonl"
    assert runner.invoke(app, ["traces", "convert", str(p), "-o", str(out)]).exit_code == 0
    assert load_trace(out).warnings == lt.warnings
    again = runner.invoke(app, ["bench", "--trace", str(out), "--workflows", "2",
                                "--engines", "1"])
    assert again.exit_code == 0 and "modelled as zero" in again.output


def test_aiperf_multi_turn_mooncake_sessions(tmp_path: Path) -> None:
    rows = [
        {"session_id": "a", "input_length": 1100, "output_length": 50,
         "hash_ids": [1, 2, 3], "timestamp": 0.0},
        {"session_id": "b", "input_length": 1100, "output_length": 10,
         "hash_ids": [1, 2, 9], "timestamp": 500.0},
        {"session_id": "a", "input_length": 300, "output_length": 20, "hash_ids": [4],
         "delay": 2500.0},
    ]
    p = tmp_path / "aiperf.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lt = load_trace(p)
    assert lt.name.startswith("mooncake-sessions") and lt.hash_block_tokens == 512
    a, b = lt.workflows
    assert (a.id, b.id, b.arrival_s) == ("a", "b", 0.5)
    t0, t1 = a.turns
    assert (t1.context_tokens, t1.input_tokens) == (1150, 300)
    assert t0.tools[0].duration_s == pytest.approx(2.5) and not t1.tools
    # the first turn's complete blocks keep the file's ids (shared with b); the rest are unique
    assert t0.block_hashes[:2] == (1, 2) == b.turns[0].block_hashes[:2]
    assert t1.block_hashes[:3] == t0.block_hashes  # the later turn extends the first's blocks
    assert t0.block_hashes[2] != b.turns[0].block_hashes[2]


def test_bench_says_how_many_workflows_it_used_and_help_names_the_loads(tmp_path: Path
                                                                         ) -> None:
    from typer.testing import CliRunner

    from turnstile.cli import app

    fix = Path(__file__).parents[1] / "fixtures" / "traces" / "mini_swe_agent"
    runner = CliRunner()
    many = runner.invoke(app, ["bench", "--trace", str(fix), "--workflows", "5",
                               "--engines", "1"])
    assert many.exit_code == 0, many.output
    assert "--workflows 5: the trace's 2 workflows, each replayed about 2.5 times" in many.output
    one = runner.invoke(app, ["bench", "--trace", str(fix), "--workflows", "1",
                              "--engines", "1"])
    assert "--workflows 1: 1 of the trace's 2 workflows" in one.output
    trace_arr = runner.invoke(app, ["bench", "--trace", str(fix), "--workflows", "9",
                                    "--engines", "1", "--arrivals", "trace"])
    assert "the first 2 of the trace's 2 workflows by arrival" in trace_arr.output
    helptext = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).output
    from turnstile.bench.runner import LOAD_LEVELS

    for name, value in LOAD_LEVELS.items():
        assert f"{name} ({value})" in helptext
