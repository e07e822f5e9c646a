"""A gateway killed with held turns serves them after a restart (SQLite persistence).

The gateway runs as a subprocess (``python -m turnstile.gateway serve``) so that it can be
killed with SIGKILL, like a crash; the engine is a fake one in this process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from turnstile.engines.llama_server import free_port
from turnstile.gateway.process import GatewayProcess
from turnstile.gateway.store import HeldTurnRow, SessionRow, Store
from turnstile.testing.fake_engine import FakeServer, chat_body, start_fake

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def engine() -> Iterator[FakeServer]:
    eng = start_fake(ttft_s=2.0)
    yield eng
    eng.stop()


@pytest.fixture
def gateway_factory(tmp_path: Path, engine: FakeServer) -> Iterator[Any]:
    procs: list[GatewayProcess] = []
    config = tmp_path / "gateway.toml"
    config.write_text(f"""
[gateway]
policy = "fcfs-workflow"
db = "{tmp_path / 'gw.sqlite3'}"
health_interval_s = 0.5

[policy.release]
max_inflight_per_engine = 1

[[engines]]
url = "{engine.url}"
kind = "llama.cpp"
name = "fake"
""")
    port = free_port()

    def start() -> GatewayProcess:
        p = GatewayProcess(config, port=port, log=tmp_path / "gateway.log").start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def test_restart_serves_held_turns_once(engine: FakeServer, gateway_factory: Any) -> None:
    gw = gateway_factory()
    first_try: dict[str, Any] = {}

    def send(rid: str, stream: bool) -> None:
        try:
            first_try[rid] = httpx.post(
                gw.url + "/v1/chat/completions", json=chat_body(content=rid, stream=stream),
                headers={"x-request-id": rid, "x-session-id": "s-" + rid}, timeout=30)
        except httpx.HTTPError as e:
            first_try[rid] = e

    threads = [threading.Thread(target=send, args=(f"r{i}", i == 1)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # arrival order r0, r1, r2, r3
    deadline = time.monotonic() + 15
    while httpx.get(gw.url + "/health").json()["held_turns"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert [r.request_id for r in engine.engine.requests] == ["r0"]
    gw.kill()  # a crash: r0 is running at the engine, r1..r3 are held
    for t in threads:
        t.join(10)
    assert all(isinstance(first_try[f"r{i}"], httpx.HTTPError) for i in range(4))

    engine.engine.ttft_s = 0.3
    gw = gateway_factory()  # same database, same port
    health = httpx.get(gw.url + "/health").json()
    assert health["sessions"] >= 3
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        # clients retry with the same request ids; r3's client only comes back later
        retried = {}
        for rid, stream in (("r1", True), ("r2", False), ("r0", False)):
            retried[rid] = c.post("/v1/chat/completions",
                                  json=chat_body(content=rid, stream=stream),
                                  headers={"x-request-id": rid, "x-session-id": "s-" + rid})
        deadline = time.monotonic() + 15
        while "r3" not in [r.request_id for r in engine.engine.requests]:
            assert time.monotonic() < deadline, "the unclaimed held turn was not served"
            time.sleep(0.05)
        time.sleep(0.6)
        retried["r3"] = c.post("/v1/chat/completions", json=chat_body(content="r3"),
                               headers={"x-request-id": "r3", "x-session-id": "s-r3"})
    for rid, r in retried.items():
        assert r.status_code == 200, (rid, r.text)
    assert "data: [DONE]" in retried["r1"].text  # streamed to the client that asked
    assert retried["r2"].json()["usage"]["completion_tokens"] == 4
    assert retried["r3"].json()["usage"]["completion_tokens"] == 4
    assert retried["r3"].headers.get("x-turnstile-cached") == "1"
    ids = [r.request_id for r in engine.engine.requests]
    # held turns ran exactly once across the crash; r0 was running, so its outcome was lost
    # and the retry ran it again
    assert sorted(ids) == ["r0", "r0", "r1", "r2", "r3"]
    # the answer kept for r3 survives another crash (its row was deleted as the turn was
    # forgotten, right after the answer was written into it: the retry ran r3 again)
    gw.kill()
    gw = gateway_factory()
    again = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(content="r3"),
                       headers={"x-request-id": "r3", "x-session-id": "s-r3"}, timeout=30)
    assert again.status_code == 200 and again.headers.get("x-turnstile-cached") == "1"
    assert [r.request_id for r in engine.engine.requests].count("r3") == 1


def test_store_round_trip(tmp_path: Path) -> None:
    st = Store(tmp_path / "s.db")
    assert st.clock_origin(100.0) == 100.0
    assert st.clock_origin(200.0) == 100.0
    st.put_session(SessionRow("a", "t", 1.0, False, 2, 30, 40, "e1", 5.0))
    st.put_held(HeldTurnRow("r1", "a", "/v1/chat/completions", {"x": 1}, True, 3.0, 10, 20, 5),
                3.0)
    st.put_result("r2", "a", "/v1/completions", 200, b'{"ok":1}', 4.0)
    st.close()
    st = Store(tmp_path / "s.db")
    assert st.sessions() == [SessionRow("a", "t", 1.0, False, 2, 30, 40, "e1", 5.0)]
    assert st.held() == [HeldTurnRow("r1", "a", "/v1/chat/completions", {"x": 1}, True, 3.0,
                                     10, 20, 5)]
    assert st.results() == {"r2": (200, b'{"ok":1}', 4.0, "/v1/completions")}
    st.purge_results(5.0)
    assert st.results() == {}
    st.drop_turn("r1")
    st.drop_session("a")
    assert st.held() == [] and st.sessions() == []
    # a restored turn's result replaces its held row; forgetting the turn keeps the result
    st.put_held(HeldTurnRow("r3", "a", "/v1/chat/completions", {}, False, 6.0, 1, 1, 1), 6.0)
    st.put_result("r3", "a", "/v1/chat/completions", 200, b"{}", 7.0)
    st.drop_turn("r3")
    assert st.results() == {"r3": (200, b"{}", 7.0, "/v1/chat/completions")}
    st.close()
