"""Derived sessions with the message patterns real agent clients send (no session header):
mini-swe-agent drops a malformed reply and sends only a "Format error" message, clients edit
replies, agents given the same task at temperature 0 send identical conversations, and requests
the engine refuses open no session. The recorder writes the sessions the clients had."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from turnstile.gateway.embedded import GatewayServer
from turnstile.testing.fake_engine import FakeServer
from turnstile.workload.jsonl import read_workload

SYSTEM = "You are a helpful assistant that can interact with a computer shell. " * 8
FORMAT_ERROR = ("Please always provide EXACTLY ONE action in triple backticks, found 0 actions."
                " If you want to end the task, please issue the following command: `echo DONE`")


def _post(gw: GatewayServer, messages: list[dict[str, Any]], **kw: Any) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", timeout=20,
                      json={"model": "tiny", "messages": messages, "max_tokens": 8, **kw})


def _derived(gw: GatewayServer) -> dict[str, float]:
    out = {}
    for ln in httpx.get(gw.url + "/metrics").text.splitlines():
        if ln.startswith("turnstile_gateway_derived_sessions_total{"):
            how = ln.split('how="', 1)[1].split('"', 1)[0]
            out[how] = float(ln.rsplit(" ", 1)[1])
    return out


def _swe_agent(gw: GatewayServer, task: str, turns: int, *, bad: set[int],
               edit: bool = False) -> list[str]:
    """A mini-swe-agent-like loop: a malformed reply (turn in ``bad``) is dropped and only the
    format error goes back; a good one is appended (edited, with ``edit``) with its output."""
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Please solve this issue: {task}"}]
    sessions = []
    for t in range(turns):
        r = _post(gw, msgs)
        assert r.status_code == 200, r.text
        sessions.append(r.headers["x-session-id"])
        reply = r.json()["choices"][0]["message"]["content"]
        if t in bad:
            msgs = [*msgs, {"role": "user", "content": FORMAT_ERROR}]
        else:
            shown = f"THOUGHT: ok\n```bash\nls\n```{reply}" if edit else reply
            msgs = [*msgs, {"role": "assistant", "content": shown},
                    {"role": "user", "content": f"<returncode>0</returncode> output {t}"}]
    return sessions


def test_dropped_and_edited_replies_keep_one_session(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer]) -> None:
    eng = fake_engines()
    gw = gateways([eng.url])
    # every reply malformed: the agent never sends an assistant message back (the split case)
    all_bad = _swe_agent(gw, "fix the parser", 6, bad=set(range(6)))
    assert len(set(all_bad)) == 1
    # malformed replies in between good ones
    mixed = _swe_agent(gw, "fix the lexer", 6, bad={1, 2, 4})
    assert len(set(mixed)) == 1
    # replies the client rewrote before sending them back
    edited = _swe_agent(gw, "fix the tests", 4, bad=set(), edit=True)
    assert len(set(edited)) == 1
    assert len({all_bad[0], mixed[0], edited[0]}) == 3
    for sid, n in ((all_bad[0], 6), (mixed[0], 6), (edited[0], 4)):
        assert gw.gateway.sessions[sid].turns == n
    assert _derived(gw) == {"new": 3.0, "continued": 13.0}


def test_identical_conversations_stay_separate_sessions(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer]) -> None:
    eng = fake_engines(ttft_s=0.2)  # identical replies for identical requests, like T=0
    gw = gateways([eng.url], policy="eager")
    n, turns = 4, 4
    seen: dict[int, list[str]] = {}

    def agent(i: int) -> None:
        seen[i] = _swe_agent(gw, "the same task for everyone", turns, bad={1})

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sessions = {sid for v in seen.values() for sid in v}
    # never merged into one session served one turn at a time: as many sessions as agents,
    # each with one turn per agent turn, and the engine saw them side by side
    assert len(sessions) == n
    assert sorted(gw.gateway.sessions[s].turns for s in sessions) == [turns] * n
    assert eng.engine.max_in_flight >= 2
    # the first requests were identical: one new session, the others new or forks of it (an
    # identical one already running); every later turn continued its own session
    d = _derived(gw)
    assert d.get("new", 0) + d.get("forked", 0) == n and d["continued"] == n * (turns - 1)


def test_a_copy_of_a_running_conversation_forks_near_it(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer]) -> None:
    engines = [fake_engines(ttft_s=0.5), fake_engines(ttft_s=0.5)]
    gw = gateways([e.url for e in engines], policy="eager+kv-affinity")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task"}]
    first = _post(gw, msgs)
    home = first.headers["x-turnstile-engine"]
    nxt = [*msgs, {"role": "assistant", "content": first.json()["choices"][0]["message"][
        "content"]}, {"role": "user", "content": "output"}]
    out: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: out.append(_post(gw, nxt))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sids = {r.headers["x-session-id"] for r in out}
    assert first.headers["x-session-id"] in sids and len(sids) == 2  # one continues, one forks
    assert {r.headers["x-turnstile-engine"] for r in out} == {home}  # the fork starts near it
    assert _derived(gw)["forked"] == 1.0


def test_requests_the_engine_refuses_open_no_session(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer]) -> None:
    eng = fake_engines()
    gw = gateways([eng.url])
    eng.engine.fail = "status:400"
    for i in range(3):
        r = _post(gw, [{"role": "user", "content": f"too long {i}"}])
        assert r.status_code == 400
        r = _post(gw, [{"role": "user", "content": "named"}], user=f"u{i}")
        assert r.status_code == 400
    assert len(gw.gateway.sessions) == 0
    eng.engine.fail = None
    assert _post(gw, [{"role": "user", "content": "fine"}]).status_code == 200
    assert len(gw.gateway.sessions) == 1


def test_the_recorder_writes_the_sessions_the_clients_had(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer],
        tmp_path: Path) -> None:
    eng = fake_engines()
    path = tmp_path / "rec.jsonl"
    gw = gateways([eng.url], record=str(path))
    for k in range(4):
        _swe_agent(gw, f"task {k}", 5, bad={0, 2})
    gw.stop()
    wfs = read_workload(path)
    assert sorted(len(w.turns) for w in wfs) == [5, 5, 5, 5]  # not twenty one-turn sessions
    # the time between turns is the client's: each turn but the last has its gap
    assert all(len(t.tools) == 1 for w in wfs for t in w.turns[:-1])


def test_a_task_run_again_is_a_fork_whatever_the_timing(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer]) -> None:
    """Two runs of one task: started together, or the second once the first has its reply
    (its first user message is then the first run's last, remembered for sub-agents) — the
    same situation, the same class: a fork near the first run, never its sub-agent."""
    eng = fake_engines(ttft_s=0.3)
    gw = gateways([eng.url], policy="eager")
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Please solve this issue: the same task, run twice"}]
    first = _post(gw, msgs).headers["x-session-id"]
    later = _post(gw, msgs).headers["x-session-id"]  # after the first run's reply
    assert later != first
    assert _derived(gw) == {"new": 1.0, "forked": 1.0}
    together = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Please solve this issue: started side by side"}]
    out: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: out.append(_post(gw, together)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.headers["x-session-id"] for r in out}) == 2
    assert _derived(gw) == {"new": 2.0, "forked": 2.0}
    sessions = gw.gateway.sessions
    assert later in sessions and all(s.parent is None for s in sessions.values())
