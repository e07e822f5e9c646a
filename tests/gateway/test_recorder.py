"""The session recorder on its own: observations in, a workload file out (no gateway)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turnstile.gateway.recorder import SessionRecorder
from turnstile.traces import load_trace
from turnstile.traces.prefix import BLOCK_CHARS
from turnstile.workload.jsonl import read_header, read_workload

SYSTEM = "You are a careful coding agent. " * 100  # ≈ 3.2k characters, shared by every session


def _usage(prompt: int, out: int, cached: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": out,
                         "total_tokens": prompt + out}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "messages": messages}


def _session(rec: SessionRecorder, sid: str, t0: float, turns: int = 3,
             secret: str = "") -> None:
    """An agent loop: each turn appends the reply and a tool result, 2 s of tool time."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {sid}"}]
    t = t0
    for k in range(turns):
        prompt = sum(len(m["content"]) for m in msgs) // 4
        rec.turn_finished(sid, "acme", _body(msgs), t, t + 1.0, _usage(prompt, 50, prompt // 2),
                          None)
        msgs = [*msgs, {"role": "assistant", "content": f"run step {k} {secret}"},
                {"role": "user", "content": "output " * 200}]
        t += 3.0


@pytest.mark.parametrize("background", [False, True], ids=["inline", "writer-thread"])
def test_sessions_are_written_when_closed_with_counts_gaps_and_shared_hashes(
        tmp_path: Path, background: bool) -> None:
    path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(path, background=background)
    _session(rec, "a", 100.0, secret="TOP-SECRET-a")
    _session(rec, "b", 101.5, secret="TOP-SECRET-b")
    rec.flush()
    assert not path.exists()  # nothing finished yet
    rec.session_closed("a")
    rec.flush()
    assert len(read_workload(path)) == 1  # written at once, before the other session ends
    rec.session_closed("b")
    rec.close()
    raw = path.read_text()
    assert "TOP-SECRET" not in raw and "careful coding agent" not in raw  # never content
    a, b = read_workload(path)
    assert (a.id, b.id) == ("a", "b") and a.tenant == "acme"
    assert a.arrival_s == 0.0 and b.arrival_s == pytest.approx(1.5)
    assert len(a.turns) == 3
    t0, t1, t2 = a.turns
    assert t0.context_tokens == 0 and t0.cached_tokens == t0.prompt_tokens // 2
    # turn 1 extends turn 0's transcript: it reuses turn 0's prompt and output
    assert t1.context_tokens == t0.prompt_tokens + t0.output_tokens
    assert t0.tools[0].name == "gap" and t0.tools[0].duration_s == pytest.approx(2.0)
    assert t0.tools[0].result_tokens == t1.input_tokens
    assert t2.tools == ()  # the last turn waits for nothing
    # the shared system prompt gives both sessions the same leading blocks, then they differ
    n_shared = len(SYSTEM) // BLOCK_CHARS
    assert t0.block_hashes is not None and b.turns[0].block_hashes is not None
    assert t0.block_hashes[:n_shared] == b.turns[0].block_hashes[:n_shared]
    assert t2.block_hashes is not None and b.turns[2].block_hashes is not None
    assert t2.block_hashes != b.turns[2].block_hashes
    # a later turn's chain starts with the earlier turn's chain (its prompt extends it)
    assert t1.block_hashes[: len(t0.block_hashes)] == t0.block_hashes  # type: ignore[index]
    meta = read_header(path)["meta"]
    assert meta["hash_block_chars"] == BLOCK_CHARS
    assert meta["hash_block_tokens"] % 16 == 0 and meta["hash_block_tokens"] > 0
    assert load_trace(path).hash_block_tokens == meta["hash_block_tokens"]


def test_a_sub_agent_becomes_a_dag_branch_of_its_open_parent(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(path)
    main = [{"role": "user", "content": "main task"}]
    rec.turn_finished("main", "t", _body(main), 0.0, 1.0, _usage(100, 10), None)
    rec.note_parent("sub", "main")
    sub = [{"role": "user", "content": "sub task"}]
    rec.turn_finished("sub", "t", _body(sub), 1.5, 2.0, _usage(50, 5), None)
    sub2 = [*sub, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    rec.turn_finished("sub", "t", _body(sub2), 3.0, 4.0, _usage(60, 5), None)
    rec.session_closed("main")  # the parent closes first: it waits for its sub-agent
    assert not path.exists()
    rec.session_closed("sub")
    rec.close()
    (wf,) = read_workload(path)
    assert wf.id == "main" and wf.meta["subagents"] == "1"
    assert [t.prompt_tokens for t in wf.turns] == [100, 50, 60]
    # the branch starts after the spawning turn and continues: here the DAG is a chain
    assert wf.is_chain
    assert wf.turns[0].tools[0].duration_s == pytest.approx(0.5)
    assert wf.turns[1].context_tokens == 0  # a sub-agent has its own context
    assert wf.turns[2].context_tokens == 55


def test_a_sub_agent_joins_the_parent_turn_that_waited_for_it(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(path)
    rec.turn_finished("main", "t", _body([{"role": "user", "content": "a"}]), 0.0, 1.0,
                      _usage(100, 10), None)
    rec.note_parent("sub", "main")
    rec.turn_finished("sub", "t", _body([{"role": "user", "content": "s"}]), 1.2, 2.0,
                      _usage(40, 5), None)
    rec.session_closed("sub")  # closes while the parent is open: folded into it
    rec.turn_finished("main", "t", _body([{"role": "user", "content": "a"},
                                          {"role": "user", "content": "b"}]), 2.5, 3.0,
                      _usage(120, 10), None)
    rec.close()  # shutdown writes the open parent
    (wf,) = read_workload(path)
    assert wf.turns[2].parents == (0, 1)  # the parent's next turn waited for the sub-agent
    assert wf.turns[1].tools[0].duration_s == pytest.approx(0.5)


def test_an_orphan_sub_agent_is_written_alone_with_its_parent_named(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(path)
    rec.note_parent("sub", "elsewhere")
    rec.turn_finished("sub", "t", _body([{"role": "user", "content": "s"}]), 5.0, 6.0,
                      _usage(40, 5), None)
    rec.session_closed("sub")
    (wf,) = read_workload(path)
    assert wf.meta["parent_session"] == "elsewhere" and wf.turns[0].parents is None


def test_turns_without_usage_are_skipped(tmp_path: Path) -> None:
    rec = SessionRecorder(tmp_path / "rec.jsonl")
    rec.turn_finished("s", "t", _body([{"role": "user", "content": "x"}]), 0, 1, None, 5)
    rec.session_closed("s")
    rec.close()
    assert rec.turns_skipped == 1 and not (tmp_path / "rec.jsonl").exists()


def test_reopening_appends_keeps_the_origin_cuts_a_torn_line_and_keeps_ids_unique(
        tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(path)
    _session(rec, "s", 1000.0, turns=2)
    rec.session_closed("s")
    rec.close()
    with path.open("a") as f:
        f.write('{"id": "torn", "arrival_s": 1')  # a crash in the middle of a write
    with pytest.raises(ValueError):
        read_workload(path)
    rec = SessionRecorder(path)
    _session(rec, "s", 1010.0, turns=1)  # the same session id comes back after closing
    rec.close()
    first, second = read_workload(path)
    assert (first.id, second.id) == ("s", "s~2")
    assert second.arrival_s == pytest.approx(10.0)  # same origin as the first recording


def test_a_file_that_is_not_a_workload_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text(json.dumps({"hello": 1}) + "\n")
    with pytest.raises(ValueError, match="not a turnstile workload"):
        SessionRecorder(path)


def test_an_explicit_end_writes_the_session_when_that_turn_finishes(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(path)
    rec.turn_finished("s", "t", _body([{"role": "user", "content": "a"}]), 0, 1, _usage(9, 2), 2)
    rec.note_end("s")
    assert not path.exists()  # the marked turn has not finished yet
    rec.turn_finished("s", "t", _body([{"role": "user", "content": "b"}]), 2, 3, _usage(9, 2), 2)
    assert [len(w.turns) for w in read_workload(path)] == [2]


@pytest.mark.parametrize("empty_file", [False, True], ids=["new", "empty"])
def test_create_writes_the_header_at_once_and_the_first_session_its_origin(
        tmp_path: Path, empty_file: bool) -> None:
    """``serve --record`` creates its file at start (it was created only when the first session
    ended): the header line, with the time origin ``null`` until the first session is written,
    which fills it in place; a restart before any session keeps the same file."""
    path = tmp_path / "rec.jsonl"
    if empty_file:
        path.touch()  # new or empty: both allowed by serve's --record check
    rec = SessionRecorder(path, background=True)
    rec.create()
    assert path.read_bytes().count(b"\n") == 1 and read_workload(path) == []
    assert read_header(path)["meta"]["origin_unix"] is None
    rec.close()
    rec = SessionRecorder(path)  # a restart before any session ended
    rec.create()  # the file is there: nothing more written
    _session(rec, "a", 100.0, turns=2)
    _session(rec, "b", 101.5, turns=1)
    rec.session_closed("a")
    rec.session_closed("b")
    rec.close()
    a, b = read_workload(path)
    assert a.arrival_s == 0.0 and b.arrival_s == pytest.approx(1.5)
    meta = read_header(path)["meta"]
    assert meta["origin_unix"] == 100.0 and meta["hash_block_chars"] == BLOCK_CHARS
    assert meta["sample_tokens"] > 0  # the ratio fields are rewritten as before
    assert load_trace(path).hash_block_tokens == meta["hash_block_tokens"]


def test_gateway_headers_reach_the_recorder(tmp_path: Path) -> None:
    """In-process gateway over the fake engine: the session-end and parent headers."""
    import httpx

    from turnstile.gateway.embedded import start_gateway
    from turnstile.testing.fake_engine import chat_body, start_fake

    path = tmp_path / "rec.jsonl"
    eng = start_fake(count_prompt=True)
    gw = start_gateway([eng.url], record=str(path))
    # there at once, its header first (time origin to come with the first session)
    assert read_workload(path) == [] and read_header(path)["meta"]["origin_unix"] is None
    try:
        def post(sid: str, **headers: str) -> None:
            r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body("x" * 40),
                           headers={"x-session-id": sid, **headers}, timeout=10)
            assert r.status_code == 200

        post("a")
        post("a", **{"x-turnstile-session-end": "1"})
        gw.gateway.recorder.flush()
        assert [w.id for w in read_workload(path)] == ["a"]  # written before any idle close
        post("a")  # the id comes back: a new workflow
        post("kid", **{"x-turnstile-parent-session": "p"})
    finally:
        gw.stop()
        eng.stop()
    wfs = {w.id: w for w in read_workload(path)}
    assert set(wfs) == {"a", "a~2", "kid"}
    assert len(wfs["a"].turns) == 2 and wfs["kid"].meta["parent_session"] == "p"


def test_serve_refuses_to_record_into_a_file_that_is_not_a_workload(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from turnstile.cli import app

    path = tmp_path / "notes.jsonl"
    path.write_text('{"hello": 1}\n')
    r = CliRunner().invoke(app, ["serve", "--engine", "http://127.0.0.1:9,llama.cpp",
                                 "--record", str(path)])
    assert r.exit_code == 2 and "not a turnstile workload" in r.output


def test_the_header_ratio_rests_on_every_recorded_turn(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"

    def one(rec: SessionRecorder, sid: str, chars: int, tokens: int) -> None:
        body = _body([{"role": "user", "content": "x" * chars}])
        rec.turn_finished(sid, "t", body, 0.0, 1.0, _usage(tokens, 3), 3)
        rec.session_closed(sid)

    rec = SessionRecorder(path)
    one(rec, "a", 4000, 1000)  # 0.25 tokens per character (prompt text ≈ 4,030 characters)
    first = read_header(path)["meta"]
    assert first["hash_block_tokens"] == 256
    one(rec, "b", 4000, 4000)  # a second session at ≈ 1 token per character
    rec.close()
    meta = read_header(path)["meta"]
    assert meta["sample_tokens"] == 5000
    assert meta["tokens_per_char"] == pytest.approx(5000 / meta["sample_chars"])
    assert meta["hash_block_tokens"] == 16 * round(1024 * meta["tokens_per_char"] / 16)
    rec = SessionRecorder(path)  # appending keeps counting from the header's sums
    one(rec, "c", 4000, 4000)
    rec.close()
    meta = read_header(path)["meta"]
    assert meta["sample_tokens"] == 9000 and len(read_workload(path)) == 3
    assert load_trace(path).hash_block_tokens == meta["hash_block_tokens"]


def test_context_counts_only_the_replies_the_client_sent_back(tmp_path: Path) -> None:
    """mini-swe-agent drops a malformed reply and sends only a format error: the next turn
    re-sends the previous prompt, not its output, so its context is that prompt alone; a reply
    sent back (kept, or edited) counts with the prompt."""
    path = tmp_path / "rec.jsonl"
    rec = SessionRecorder(path)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "task"}]
    prompts = [800, 830, 900, 960]
    for k, prompt in enumerate(prompts):
        rec.turn_finished("s", "t", _body(msgs), 10.0 * k, 10.0 * k + 1, _usage(prompt, 50),
                          None)
        if k == 0:  # a malformed reply: dropped, only the format error goes back
            msgs = [*msgs, {"role": "user", "content": "Format error: one action please"}]
        else:
            msgs = [*msgs, {"role": "assistant", "content": f"step {k}"},
                    {"role": "user", "content": "output"}]
    rec.session_closed("s")
    rec.close()
    (wf,) = read_workload(path)
    t0, t1, t2, t3 = wf.turns
    assert t1.context_tokens == 800  # turn 0's prompt; its 50-token reply was never re-sent
    assert t1.input_tokens == 30
    assert t0.tools[0].result_tokens == 30
    assert t2.context_tokens == 830 + 50  # turn 1's reply went back
    assert t3.context_tokens == 900 + 50
