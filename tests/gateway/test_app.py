"""The gateway over fake engines: OpenAI passthrough, sessions, holding, errors, metrics."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from turnstile.gateway.adapters import parse_prometheus
from turnstile.gateway.embedded import GatewayServer
from turnstile.testing.fake_engine import FakeServer, chat_body

pytestmark = pytest.mark.timeout(60)

HOLD_ONE = {"policy": "fcfs-workflow",
            "policy_params": {"release": {"max_inflight_per_engine": 1}}}


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def metrics(gw: GatewayServer) -> dict[str, float]:
    return parse_prometheus(httpx.get(gw.url + "/metrics", timeout=10).text)


def labelled(gw: GatewayServer, name: str) -> dict[str, float]:
    """``{label string: value}`` for one metric name."""
    out = {}
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def oai(gw: GatewayServer, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, timeout=kw.pop("timeout", 20.0), **kw)


# ----------------------------------------------------------------------------- passthrough
def test_chat_and_completions_streamed_and_not(fake_engines: Any, gateways: Any) -> None:
    eng: FakeServer = fake_engines()
    gw: GatewayServer = gateways([eng.url])
    client = oai(gw)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5)
    assert r.choices[0].message.content == "xxxxx"
    assert r.usage is not None and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "x" * 6
    # the usage chunk the gateway asked for is not passed on to a client that did not ask
    assert all(c.usage is None for c in chunks)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    c = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert c.choices[0].text == "xxx"
    streamed = list(client.completions.create(model="tiny", prompt="hello", max_tokens=2,
                                              stream=True))
    assert "".join(x.choices[0].text for x in streamed if x.choices) == "xx"
    # the engine saw llama.cpp fields and the usage request, the client's body otherwise
    sent = eng.engine.requests[1].body
    assert sent["cache_prompt"] is True and sent["stream_options"] == {"include_usage": True}
    assert "id_slot" in sent


def test_models_health_and_headers(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines()
    gw = gateways([eng.url])
    models = httpx.get(gw.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    health = httpx.get(gw.url + "/health").json()
    assert health["status"] == "ok" and health["policy"] == "eager"
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                   headers={"x-session-id": "s1", "x-request-id": "r-1"})
    assert r.status_code == 200
    assert r.headers["x-session-id"] == "s1" and r.headers["x-request-id"] == "r-1"
    assert r.headers["x-turnstile-engine"] == gw.gateway.scheduler.view.ids[0]
    assert float(r.headers["x-turnstile-hold-ms"]) >= 0
    assert eng.engine.requests[0].request_id == "r-1"


def test_sessions_from_header_and_user_field(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines()
    gw = gateways([eng.url], derive_sessions=False)
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=chat_body(max_tokens=5),
                          headers={"x-session-id": "agent-1"}).status_code == 200
        assert c.post("/v1/chat/completions",
                      json=chat_body(user="agent-2")).status_code == 200
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
    g = gw.gateway
    assert set(g.sessions) == {"agent-1", "agent-2"}  # the anonymous one-turn session closed
    s = g.sessions["agent-1"]
    assert s.turns == 3
    assert s.context_tokens == 8 + 5  # the engine's usage: prompt 8 + output 5
    wf = g.scheduler.workflows["agent-1"]
    assert len(wf.turns) == 3 and wf.turns[2].output_tokens == 5
    assert wf.turns[2].turn.context_tokens > 0  # the context grew from the previous turn
    assert metrics(gw)["turnstile_gateway_flow_time_seconds_count"] == 1.0


def test_idle_sessions_are_closed(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines()
    gw = gateways([eng.url], session_idle_s=0.2)
    for _ in range(2):
        httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                   headers={"x-session-id": "short"})
    wait_until(lambda: "short" not in gw.gateway.sessions, 5)
    assert metrics(gw)["turnstile_gateway_flow_time_seconds_count"] == 1.0
    # the session id can be used again: a new session
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                   headers={"x-session-id": "short"})
    assert r.status_code == 200 and gw.gateway.sessions["short"].turns == 1


def test_one_turn_at_a_time_per_session(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines(ttft_s=0.15)
    gw = gateways([eng.url])

    def call(_: int) -> int:
        return httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                          headers={"x-session-id": "same"}, timeout=10).status_code

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(call, range(3))) == [200] * 3
    assert eng.engine.max_in_flight == 1
    assert gw.gateway.sessions["same"].turns == 3


# ----------------------------------------------------------------------------- holding
def test_release_policy_holds_turns_and_queue_overflow_is_429(fake_engines: Any,
                                                             gateways: Any) -> None:
    eng = fake_engines(ttft_s=0.8)
    gw = gateways([eng.url], max_held=2, **HOLD_ONE)
    results: list[httpx.Response] = []

    def call(i: int) -> None:
        results.append(httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                                  headers={"x-session-id": f"s{i}"}, timeout=10))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: gw.gateway.scheduler.held_turns == 2)
    assert eng.engine.max_in_flight == 1
    over = httpx.post(gw.url + "/v1/chat/completions", json=chat_body())
    assert over.status_code == 429
    assert over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200, 200]
    holds = sorted(float(r.headers["x-turnstile-hold-ms"]) for r in results)
    assert holds[0] < holds[1] < holds[2] and holds[2] > 1200  # the last waited for two
    assert eng.engine.max_in_flight == 1
    m = metrics(gw)
    assert m["turnstile_gateway_rejected_total"] == 1
    assert m["turnstile_gateway_hold_seconds_count"] == 3
    assert m["turnstile_gateway_held_turns"] == 0


def test_duplicate_request_id_in_flight_is_409(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines(ttft_s=1.0)
    gw = gateways([eng.url])
    first: list[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(httpx.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-request-id": "dup"},
        timeout=10)))
    t.start()
    wait_until(lambda: eng.engine.in_flight == 1)
    second = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                        headers={"x-request-id": "dup"})
    t.join()
    assert second.status_code == 409
    assert first[0].status_code == 200
    assert len(eng.engine.requests) == 1


# ----------------------------------------------------------------------------- client gone
def test_client_disconnect_mid_stream_cancels_upstream(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines(tpot_s=0.02)
    gw = gateways([eng.url])
    with httpx.Client(timeout=10) as c, c.stream(
        "POST", gw.url + "/v1/chat/completions",
        json=chat_body(max_tokens=500, stream=True), headers={"x-session-id": "gone"},
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until(lambda: eng.engine.cancelled == 1)
    wait_until(lambda: gw.gateway.scheduler.view.released_turns == 0)
    assert gw.gateway.sessions["gone"].active is None
    assert labelled(gw, "turnstile_gateway_turns_cancelled_total") == {'{stage="running"}': 1.0}
    # the session goes on
    ok = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                    headers={"x-session-id": "gone"})
    assert ok.status_code == 200


def test_client_disconnect_non_stream_cancels_upstream(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines(ttft_s=5.0)
    gw = gateways([eng.url])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=0.3)
    wait_until(lambda: eng.engine.cancelled == 1)
    wait_until(lambda: gw.gateway.scheduler.view.released_turns == 0)


def test_client_disconnect_while_held_never_reaches_engine(fake_engines: Any,
                                                           gateways: Any) -> None:
    eng = fake_engines(ttft_s=1.5)
    gw = gateways([eng.url], **HOLD_ONE)
    t = threading.Thread(target=lambda: httpx.post(gw.url + "/v1/chat/completions",
                                                   json=chat_body(content="first"), timeout=10))
    t.start()
    wait_until(lambda: eng.engine.in_flight == 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/chat/completions", json=chat_body(content="held"),
                   headers={"x-session-id": "impatient"}, timeout=0.2)
    t.join()
    wait_until(lambda: gw.gateway.scheduler.held_turns == 0)
    wait_until(lambda: gw.gateway.sessions.get("impatient") is None
               or gw.gateway.sessions["impatient"].active is None)
    assert [r.body["messages"][0]["content"] for r in eng.engine.requests] == ["first"]
    # counted once: dropped at once (issue 36), not again when it would have been released
    assert labelled(gw, "turnstile_gateway_turns_cancelled_total") == {'{stage="held"}': 1.0}
    ok = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                    headers={"x-session-id": "impatient"}, timeout=10)
    assert ok.status_code == 200


# ----------------------------------------------------------------------------- errors
def test_bad_requests_get_4xx_and_server_stays_healthy(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines()
    gw = gateways([eng.url], max_body_bytes=10_000)
    url = gw.url + "/v1/chat/completions"
    cases = [
        (httpx.post(url, content=b"{not json"), 400, "invalid_json"),
        (httpx.post(url, content=b"[1, 2]"), 400, "invalid_json"),
        (httpx.post(url, json={"model": "tiny"}), 400, "invalid_messages"),
        (httpx.post(url, json={"model": "tiny", "messages": ["x"]}), 400, "invalid_messages"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]}), 400,
         "missing_model"),
        (httpx.post(url, json=chat_body(max_tokens=0)), 400, "invalid_value"),
        (httpx.post(url, json=chat_body(stream="yes")), 400, "invalid_value"),
        (httpx.post(url, json={**chat_body(), "model": "gpt-9"}), 404, "model_not_found"),
        (httpx.post(url, content=b"x" * 20_000), 413, "body_too_large"),
        (httpx.post(url, content=iter([b"{" + b" " * 6000, b" " * 6000 + b"}"])), 413,
         "body_too_large"),
        (httpx.post(gw.url + "/v1/completions", json={"model": "tiny"}), 400, "invalid_prompt"),
        (httpx.get(url), 405, None),
        (httpx.get(gw.url + "/v2/nothing"), 404, "not_found"),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert err["message"]
        if code:
            assert err["code"] == code
    assert httpx.get(gw.url + "/health").status_code == 200
    assert httpx.post(url, json=chat_body()).status_code == 200
    assert eng.engine.requests and len(eng.engine.requests) == 1
    counts = labelled(gw, "turnstile_gateway_requests_total")
    assert counts['{endpoint="/v1/chat/completions",status="400"}'] == 7
    assert counts['{endpoint="/v1/chat/completions",status="413"}'] == 2


def test_engine_4xx_is_passed_through(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines(fail="status:400")
    gw = gateways([eng.url])
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body())
    assert r.status_code == 400 and r.json()["error"]["message"] == "injected"
    assert gw.gateway.scheduler.view.released_turns == 0
    assert len(eng.engine.requests) == 1  # not retried


def test_bearer_auth(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines()
    gw = gateways([eng.url], auth_token="s3cret")
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body()).status_code == 401
    bad = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                     headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gw.url + "/v1/models").status_code == 401
    client = oai(gw, api_key="s3cret")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2
    assert httpx.get(gw.url + "/health").status_code == 200  # health stays open


# ----------------------------------------------------------------------------- engine failures
def test_engine_errors_are_rerouted_to_a_healthy_engine(fake_engines: Any,
                                                        gateways: Any) -> None:
    bad = fake_engines(fail="status:503")
    crash = fake_engines(fail="crash")
    good = fake_engines()
    gw = gateways([bad.url, crash.url, good.url], policy="eager+round-robin")
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        for i in range(6):
            r = c.post("/v1/chat/completions", json=chat_body(stream=bool(i % 2)))
            assert r.status_code == 200, r.text
            assert r.headers["x-turnstile-engine"] == gw.gateway.scheduler.view.ids[2]
    m = metrics(gw)
    assert m["turnstile_gateway_turns_rerouted_total"] >= 4
    assert len(good.engine.requests) == 6
    wait_until(lambda: gw.gateway.scheduler.view.released_turns == 0)


def test_a_turn_is_sent_max_attempts_times_under_the_one_retry_rule(fake_engines: Any,
                                                                    gateways: Any) -> None:
    """The re-route loop follows RetryRule: max_attempts sends in all, then the OpenAI-shaped
    upstream error; the waits are the rule's backoff."""
    bad = [fake_engines(fail="status:503") for _ in range(3)]
    gw = gateways([b.url for b in bad], policy="eager+round-robin", max_attempts=2)
    rule = gw.gateway.reroute_rule()
    assert (rule.retries, rule.delay_s(1), rule.delay_s(20)) == (1, 0.05, 0.5)
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10)
    assert r.status_code >= 500 and r.json()["error"]["code"] == "engine_failed"
    assert sum(len(b.engine.requests) for b in bad) == 2
    assert metrics(gw)["turnstile_gateway_turns_rerouted_total"] == 1


def test_dead_engine_marked_down_and_back_up(fake_engines: Any, gateways: Any) -> None:
    a = fake_engines()
    b = fake_engines()
    gw = gateways([a.url, b.url], policy="eager+round-robin", recheck_interval_s=0.1)
    ida, idb = gw.gateway.scheduler.view.ids
    port = a.server.port
    a.stop()
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        for i in range(4):
            r = c.post("/v1/chat/completions", json=chat_body(stream=bool(i % 2)))
            assert r.status_code == 200 and r.headers["x-turnstile-engine"] == idb
    assert gw.gateway.engine_up[ida] is False
    assert httpx.get(gw.url + "/health").json()["engines"][ida] is False
    assert labelled(gw, "turnstile_gateway_engine_healthy")[f'{{engine="{ida}"}}'] == 0.0
    back = fake_engines(port=port)
    wait_until(lambda: gw.gateway.engine_up[ida], 5)
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        engines = {c.post("/v1/chat/completions", json=chat_body()).headers["x-turnstile-engine"]
                   for _ in range(4)}
    assert engines == {ida, idb}
    assert back.engine.requests


def test_all_engines_down_fails_with_502(fake_engines: Any, gateways: Any) -> None:
    a = fake_engines()
    gw = gateways([a.url])
    a.stop()
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "engine_failed"
    assert httpx.get(gw.url + "/health").status_code == 503
    assert gw.gateway.scheduler.view.released_turns == 0


def test_engine_dying_mid_stream_gives_an_sse_error(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines(fail="die_after:3")
    gw = gateways([eng.url])
    client = oai(gw)
    got: list[str] = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for ch in client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=10,
                stream=True):
            got.append(ch.choices[0].delta.content or "")
    assert "".join(got) == "xxx"
    wait_until(lambda: gw.gateway.scheduler.view.released_turns == 0)
    assert labelled(gw, "turnstile_gateway_turns_failed_total") == {
        f'{{engine="{gw.gateway.scheduler.view.ids[0]}",reason="mid_stream"}}': 1.0}
    eng.engine.fail = None
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body()).status_code == 200


# ----------------------------------------------------------------------------- metrics
def test_metrics_count_requests_turns_and_tokens(fake_engines: Any, gateways: Any) -> None:
    a = fake_engines()
    b = fake_engines()
    gw = gateways([a.url, b.url], policy="eager+round-robin")
    n = 10
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        for i in range(n):
            r = c.post("/v1/chat/completions", json=chat_body(max_tokens=3, stream=i < 4),
                       headers={"x-session-id": f"m{i % 3}"})
            assert r.status_code == 200
    m = metrics(gw)
    counts = labelled(gw, "turnstile_gateway_requests_total")
    assert counts == {'{endpoint="/v1/chat/completions",status="200"}': float(n)}
    assert m["turnstile_gateway_turns_finished_total"] == n
    assert m["turnstile_gateway_output_tokens_total"] == 3 * n
    assert m["turnstile_gateway_released_turns_total"] == n
    assert m["turnstile_gateway_ttft_seconds_count"] == 4  # streamed turns
    assert m["turnstile_gateway_turn_seconds_count"] == n
    assert m["turnstile_gateway_active_sessions"] == 3
    per_engine = labelled(gw, "turnstile_gateway_turns_finished_total")
    assert sorted(per_engine.values()) == [5.0, 5.0]
    assert len(a.engine.requests) == len(b.engine.requests) == 5
    assert m["turnstile_gateway_engine_outstanding_turns"] == 0


def test_stats_scrape_feeds_the_scheduler(fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines()
    gw = gateways([eng.url], stats_interval_s=0.05)
    e = gw.gateway.scheduler.view[gw.gateway.scheduler.view.ids[0]]
    wait_until(lambda: e.queue_len == 0 and e.running == 0, 5)
    assert json.loads(json.dumps(gw.gateway.health.engines[e.id].stats_counters)) == {
        "output_tokens": 0.0}


def test_forward_debug_log_says_where_each_turn_went(fake_engines: Any, gateways: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """At DEBUG the gateway logs every forwarded turn's engine and llama.cpp slot (what a
    cache-miss investigation reads); a session's second turn goes back to its slot."""
    caplog.set_level(logging.DEBUG, logger="turnstile.gateway")
    eng = fake_engines()
    gw = gateways([eng.url])
    engine_id = gw.gateway.scheduler.view.ids[0]
    for _ in range(2):
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                       headers={"x-session-id": "s-log"})
        assert r.status_code == 200
    lines = [m for m in (rec.getMessage() for rec in caplog.records)
             if m.startswith("forward s-log ")]
    assert [m.split(" at ")[0] for m in lines] == [
        f"forward s-log turn 0 -> {engine_id} slot 0",
        f"forward s-log turn 1 -> {engine_id} slot 0",
    ]


def test_gateway_tells_the_core_how_many_slots_a_llama_cpp_engine_keeps(
        fake_engines: Any, gateways: Any) -> None:
    """The slots a llama.cpp server reports (``/slots``) reach the core's engine record, where
    the release policy's KV gate counts sessions against them."""
    eng = fake_engines(slots=3)
    gw = gateways([eng.url])
    e = gw.gateway.scheduler.view[gw.gateway.scheduler.view.ids[0]]
    assert e.kv_slots == 3 and e.has_free_slot
