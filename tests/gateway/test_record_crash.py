"""``turnstile serve --record``: a gateway killed with SIGKILL leaves a readable workload holding
every session finished before the kill, and ``turnstile bench --trace`` runs on it.

The gateway is a real subprocess; the engine is the fake one (it reports ``prompt_tokens``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from turnstile.cli import app
from turnstile.engines.llama_server import free_port
from turnstile.testing.fake_engine import FakeServer, start_fake
from turnstile.testing.replicas import GatewayProcess
from turnstile.workload.jsonl import read_workload

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engine() -> Iterator[FakeServer]:
    eng = start_fake(count_prompt=True)
    yield eng
    eng.stop()


def _config(tmp_path: Path, engine: FakeServer, record: Path) -> Path:
    config = tmp_path / "gateway.toml"
    config.write_text(f"""
[gateway]
policy = "eager"
session_idle_s = 0.6
record = "{record}"

[[engines]]
url = "{engine.url}"
kind = "llama.cpp"
name = "fake"
""")
    return config


def _turns(url: str, sid: str, n: int, pause_s: float = 0.2) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    messages = [{"role": "system", "content": "shared system prompt " * 80},
                {"role": "user", "content": f"task {sid}"}]
    for k in range(n):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                           extra_headers={"x-session-id": sid})
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"tool output {k} " * 30}]
        time.sleep(pause_s)


def _wait_for(path: Path, sessions: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) == sessions + 1:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path}: {sessions} sessions not written in {timeout_s} s")


def test_killed_gateway_leaves_every_finished_session_and_bench_runs_on_it(
        tmp_path: Path, engine: FakeServer) -> None:
    record = tmp_path / "sessions.jsonl"
    config = _config(tmp_path, engine, record)
    port = free_port()
    gw = GatewayProcess(config, replica_id="rec", port=port).start()
    try:
        _turns(gw.url, "alpha", 3)
        _wait_for(record, 1)  # closed after 0.6 s idle: written while the gateway runs
        _turns(gw.url, "beta", 2, pause_s=0.0)  # finished turns, session still open
        gw.kill()
    finally:
        gw.close()
    (alpha,) = read_workload(record)  # beta was open at the kill: not written
    assert alpha.id == "alpha" and len(alpha.turns) == 3
    assert [t.output_tokens for t in alpha.turns] == [8, 8, 8]
    assert all(t.block_hashes for t in alpha.turns)
    assert alpha.turns[0].tools[0].duration_s >= 0.2
    # a restart appends to the same file; a clean stop writes the open session
    gw = GatewayProcess(config, replica_id="rec", port=port).start()
    try:
        _turns(gw.url, "gamma", 2, pause_s=0.0)
    finally:
        gw.close()
    wfs = read_workload(record)
    assert [w.id for w in wfs] == ["alpha", "gamma"]
    assert wfs[1].arrival_s > 0  # the first recording's origin is kept
    # the shared system prompt is a shared prefix across sessions
    assert alpha.turns[0].block_hashes[:2] == wfs[1].turns[0].block_hashes[:2]  # type: ignore[index]
    result = CliRunner().invoke(app, ["bench", "--trace", str(record), "--policies",
                                      "eager,cvar", "--workflows", "20", "--engines", "1"])
    assert result.exit_code == 0, result.output
    assert "simulated" in result.output and "cvar" in result.output
