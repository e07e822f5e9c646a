"""Record → bench with a real engine: agents (the ``openai`` client) talk to a real llama.cpp
``llama-server`` through a gateway started with ``record``; the recording holds the engine's own
token counts and ``turnstile bench --trace`` simulates it.

Skipped only when the binary is missing and ``CI`` is unset (build it with ``make engine``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from turnstile.cli import app
from turnstile.engines.llama_server import LlamaServerProcess
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.gateway.embedded import start_gateway
from turnstile.workload.jsonl import read_header, read_workload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

SYSTEM = "You are a coding agent. Run one shell command per turn and read its output. " * 20


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path
           ) -> Iterator[LlamaServerProcess]:
    model = write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")
    proc = LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1,
                              binary=llama_server_binary).start()
    yield proc
    proc.stop()


def _agent(url: str, sid: str, turns: int, *, stream: bool, parent: str | None = None,
           first: list[dict[str, Any]] | None = None) -> list[tuple[int, int, int]]:
    """A closed-loop session; returns the (prompt, completion, cached) usage the client saw."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    headers = {"x-session-id": sid}
    if parent:
        headers["x-turnstile-parent-session"] = parent
    messages = first or [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"task {sid}: fix the failing test"}]
    seen = []
    for t in range(turns):
        if stream:
            text, usage = "", None
            for ch in client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=10, stream=True,
                    stream_options={"include_usage": True}, extra_headers=headers):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                if ch.usage is not None:
                    usage = ch.usage
        else:
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                               extra_headers=headers)
            text, usage = r.choices[0].message.content or "", r.usage
        assert usage is not None
        details = usage.prompt_tokens_details
        seen.append((usage.prompt_tokens, usage.completion_tokens,
                     (details.cached_tokens if details else 0) or 0))
        messages = [*messages, {"role": "assistant", "content": text},
                    {"role": "user", "content": f"output of command {t}: " + "ok " * 40}]
        time.sleep(0.3)  # the "tool"
    return seen


def test_recorded_sessions_hold_the_engines_usage_and_bench_runs_on_them(
        engine: LlamaServerProcess, tmp_path: Path) -> None:
    record = tmp_path / "sessions.jsonl"
    gw = start_gateway([engine.base_url], policy="eager", record=str(record),
                       session_idle_s=30.0)
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = {f"agent-{i}": pool.submit(_agent, gw.url, f"agent-{i}", 3,
                                                 stream=i % 2 == 0) for i in range(4)}
            seen = {k: f.result(timeout=90) for k, f in futures.items()}
        # a main agent that runs a sub-agent between its two turns
        main = _agent(gw.url, "main", 1, stream=False)
        sub = _agent(gw.url, "main/sub", 2, stream=True, parent="main",
                     first=[{"role": "user", "content": "sub-task: read the logs"}])
        main += _agent(gw.url, "main", 1, stream=False)
    finally:
        gw.stop()  # shutdown writes the sessions still open
    wfs = {w.id: w for w in read_workload(record)}
    assert set(wfs) == {"agent-0", "agent-1", "agent-2", "agent-3", "main"}
    for sid, usage in seen.items():
        turns = wfs[sid].turns
        assert [(t.prompt_tokens, t.output_tokens) for t in turns] == [u[:2] for u in usage]
        assert [t.cached_tokens for t in turns] == [u[2] for u in usage]
        # the transcript grows: each turn reuses the previous prompt and reply
        assert turns[1].context_tokens == turns[0].prompt_tokens + turns[0].output_tokens
        assert all(0.3 <= t.tools[0].duration_s < 5 for t in turns[:-1])
    # a common system prompt is a shared prefix across sessions
    h0, h1 = wfs["agent-0"].turns[0].block_hashes, wfs["agent-1"].turns[0].block_hashes
    assert h0 and h1 and h0[0] == h1[0]
    # the sub-agent is a DAG branch of its parent: main0 → sub0 → sub1 → main1 (waits for both)
    m = wfs["main"]
    assert [t.prompt_tokens for t in m.turns] == [main[0][0], sub[0][0], sub[1][0], main[1][0]]
    assert m.turns[3].parents == (0, 2) and m.meta["subagents"] == "1"
    assert m.turns[1].context_tokens == 0
    meta = read_header(record)["meta"]
    assert meta["hash_block_tokens"] % 16 == 0 and "content" in meta
    assert "coding agent" not in record.read_text()  # never content
    r = CliRunner().invoke(app, ["bench", "--trace", str(record), "--policies", "eager,cvar",
                                 "--workflows", "20", "--engines", "1"])
    assert r.exit_code == 0, r.output
    assert "simulated" in r.output
