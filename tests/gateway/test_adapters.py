"""Engine adapters against recorded protocol fixtures (httpx.MockTransport) and the lean
HTTP client against a live loopback server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from turnstile.core.actions import RetentionDecision
from turnstile.core.slots import choose_slot
from turnstile.gateway.adapters import (
    EngineAdapter,
    ForwardHints,
    LlamaCppAdapter,
    OpenAIAdapter,
    SglangAdapter,
    UpstreamError,
    UpstreamHTTPError,
    VllmAdapter,
    make_adapter,
    parse_prometheus,
    split_sse,
)
from turnstile.testing.fake_engine import chat_body, start_fake
from turnstile.transport.fast import ConnectFailed, FastHttpClient

pytestmark = pytest.mark.timeout(30)

FIXTURES = Path(__file__).parent / "fixtures"
Handler = Callable[[httpx.Request], httpx.Response]


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


async def chunked(data: bytes, size: int = 37) -> AsyncIterator[bytes]:
    """The body in small pieces, so SSE events straddle chunk boundaries."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


class Recorder:
    """A MockTransport handler that records requests and answers from a route table."""

    def __init__(self, routes: dict[str, Callable[[httpx.Request], httpx.Response]]) -> None:
        self.routes = routes
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        key = f"{request.method} {request.url.path}"
        if key not in self.routes:
            return httpx.Response(404, json={"error": "no route"})
        return self.routes[key](request)

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]


def adapter(cls: type[EngineAdapter], handler: Handler, **kw: Any) -> EngineAdapter:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return cls("http://engine:8000", client=client, **kw)


def hints(session: str = "s1", priority: float = 0.0) -> ForwardHints:
    return ForwardHints(session, "req-1", priority)


# ----------------------------------------------------------------------------- helpers
def test_parse_prometheus_sums_label_sets_and_skips_comments() -> None:
    text = fixture("vllm/metrics.txt").decode() + 'x{a="1"} 2\nx{a="2"} 3\nnan_metric NaN\n'
    m = parse_prometheus(text)
    assert m["vllm:num_requests_waiting"] == 5.0
    assert m["vllm:time_to_first_token_seconds_count"] == 100.0
    assert m["x"] == 5.0
    assert "nan_metric" not in m
    # a malformed line ends the parse; what came before it is kept
    m = parse_prometheus('a 1\nb{x="1" 2\nc 3\n')
    assert m == {"a": 1.0}


def test_split_sse_keeps_partial_events() -> None:
    buf = bytearray(b"data: 1\n\ndata: 2\r\n\r\ndata: 3")
    assert split_sse(buf) == [b"data: 1\n\n", b"data: 2\n\n"]
    assert bytes(buf) == b"data: 3"
    buf += b"\n\n"
    assert split_sse(buf) == [b"data: 3\n\n"] and not buf


def test_make_adapter_by_kind() -> None:
    assert isinstance(make_adapter("http://h:1", "vllm"), VllmAdapter)
    assert isinstance(make_adapter("http://h:1", "llama.cpp"), LlamaCppAdapter)
    assert make_adapter("http://h:1", "sglang", engine_id="g").id == "g"
    assert make_adapter("http://h:1", "openai").id == "h:1"
    with pytest.raises(ValueError, match=r"valid kinds: llama\.cpp, openai, sglang, vllm"):
        make_adapter("http://h:1", "tgi")


# ----------------------------------------------------------------------------- vLLM
def test_vllm_non_stream_sends_priority_and_request_id() -> None:
    rec = Recorder({"POST /v1/chat/completions": lambda r: httpx.Response(
        200, content=fixture("vllm/chat_completion.json"),
        headers={"content-type": "application/json"})})
    a = adapter(VllmAdapter, rec)
    resp = asyncio.run(a.complete("/v1/chat/completions", chat_body(), hints(priority=12.5)))
    assert resp.json()["usage"]["completion_tokens"] == 10
    sent = rec.bodies("/v1/chat/completions")[0]
    assert sent["priority"] == 12500 and isinstance(sent["priority"], int)
    assert sent["messages"] == chat_body()["messages"]
    assert rec.requests[0].headers["x-request-id"] == "req-1"
    b = adapter(VllmAdapter, rec, options={"priority": False})
    asyncio.run(b.complete("/v1/chat/completions", chat_body(), hints(priority=3.0)))
    assert "priority" not in rec.bodies("/v1/chat/completions")[1]


def test_vllm_stream_yields_whole_events() -> None:
    data = fixture("vllm/chat_stream.sse")
    rec = Recorder({"POST /v1/chat/completions": lambda r: httpx.Response(
        200, content=chunked(data), headers={"content-type": "text/event-stream"})})
    a = adapter(VllmAdapter, rec)

    async def collect() -> list[bytes]:
        body = chat_body(stream=True, stream_options={"include_usage": True})
        return [ev async for ev in a.stream("/v1/chat/completions", body, hints())]

    events = asyncio.run(collect())
    assert len(events) == 6 and events[-1] == b"data: [DONE]\n\n"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3
    assert all(ev.endswith(b"\n\n") for ev in events)


def test_vllm_stats_models_tokenize_health() -> None:
    rec = Recorder({
        "GET /metrics": lambda r: httpx.Response(200, content=fixture("vllm/metrics.txt")),
        "GET /v1/models": lambda r: httpx.Response(200, content=fixture("vllm/models.json")),
        "POST /tokenize": lambda r: httpx.Response(200, content=fixture("vllm/tokenize.json")),
        "GET /health": lambda r: httpx.Response(200),
    })
    a = adapter(VllmAdapter, rec)
    stats = asyncio.run(a.stats())
    assert stats is not None
    assert (stats.running, stats.queue_len, stats.kv_used_frac) == (3, 5, 0.4375)
    assert stats.counters["prefix_hit_tokens"] == 90000.0
    assert stats.counters["preemptions"] == 2.0
    assert asyncio.run(a.models()) == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert asyncio.run(a.tokenize("hello world")) == 7
    assert rec.bodies("/tokenize") == [{"prompt": "hello world"}]
    assert asyncio.run(a.health()) is True


def test_vllm_http_errors_and_retries() -> None:
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append("x")
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, content=fixture("vllm/chat_completion.json"))

    a = adapter(VllmAdapter, flaky)
    asyncio.run(a.complete("/v1/chat/completions", chat_body(), hints()))
    assert len(calls) == 2  # refused: nothing was sent, so one retry

    def stale(request: httpx.Request) -> httpx.Response:
        calls.append("s")
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    calls.clear()
    with pytest.raises(UpstreamError) as e:
        asyncio.run(adapter(VllmAdapter, stale).complete("/v1/chat/completions", chat_body(),
                                                         hints()))
    assert e.value.engine_down and len(calls) == 2

    def slow(request: httpx.Request) -> httpx.Response:
        calls.append("t")
        raise httpx.ReadTimeout("slow")

    calls.clear()
    with pytest.raises(UpstreamError) as e:
        asyncio.run(adapter(VllmAdapter, slow).complete("/v1/chat/completions", chat_body(),
                                                        hints()))
    assert not e.value.engine_down and len(calls) == 1  # the engine got it: never resent

    def overloaded(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "busy"}})

    with pytest.raises(UpstreamHTTPError) as h:
        asyncio.run(adapter(VllmAdapter, overloaded).complete("/v1/chat/completions",
                                                              chat_body(), hints()))
    assert h.value.status == 503


def test_stream_broken_after_events_is_marked_streamed() -> None:
    data = fixture("vllm/chat_stream.sse")

    async def dying() -> AsyncIterator[bytes]:
        yield data[:400]
        raise httpx.ReadError("connection reset")

    a = adapter(VllmAdapter, lambda r: httpx.Response(200, content=dying()))

    async def collect() -> list[bytes]:
        got = []
        async for ev in a.stream("/v1/chat/completions", chat_body(stream=True), hints()):
            got.append(ev)
        return got

    with pytest.raises(UpstreamError) as e:
        asyncio.run(collect())
    assert e.value.streamed and e.value.engine_down


# ----------------------------------------------------------------------------- SGLang
def test_sglang_stream_stats_and_priority_sign() -> None:
    rec = Recorder({
        "POST /v1/chat/completions": lambda r: httpx.Response(
            200, content=chunked(fixture("sglang/chat_stream.sse"), 64)),
        "GET /metrics": lambda r: httpx.Response(200, content=fixture("sglang/metrics.txt")),
    })
    a = adapter(SglangAdapter, rec)

    async def collect(ad: EngineAdapter, p: float) -> list[bytes]:
        return [ev async for ev in ad.stream("/v1/chat/completions", chat_body(stream=True),
                                             hints(priority=p))]

    events = asyncio.run(collect(a, 2.0))
    assert len(events) == 5 and b'"usage":null' in events[0]
    assert "priority" not in rec.bodies("/v1/chat/completions")[0]  # off unless asked
    asyncio.run(collect(adapter(SglangAdapter, rec, options={"priority": True}), 2.0))
    assert rec.bodies("/v1/chat/completions")[1]["priority"] == -2000  # SGLang: higher first
    asyncio.run(collect(adapter(SglangAdapter, rec, options={
        "priority": True, "low_priority_first": True}), 2.0))
    assert rec.bodies("/v1/chat/completions")[2]["priority"] == 2000
    stats = asyncio.run(a.stats())
    assert stats is not None
    assert (stats.running, stats.queue_len, stats.kv_used_frac) == (7, 2, 0.28)
    assert stats.counters["prefix_hit_tokens"] == 6.1e6


def test_openai_generic_adapter() -> None:
    rec = Recorder({
        "GET /v1/models": lambda r: httpx.Response(200, content=fixture("vllm/models.json")),
        "POST /v1/completions": lambda r: httpx.Response(200, json={"choices": []}),
    })
    a = adapter(OpenAIAdapter, rec, api_key="sk-test")
    assert asyncio.run(a.health()) is True
    assert asyncio.run(a.stats()) is None
    assert asyncio.run(a.tokenize("x")) is None
    asyncio.run(a.complete("/v1/completions", {"model": "m", "prompt": "x"}, hints()))
    sent = rec.requests[-1]
    assert sent.headers["authorization"] == "Bearer sk-test"
    assert json.loads(sent.content) == {"model": "m", "prompt": "x"}  # passed through as is


# ----------------------------------------------------------------------------- llama.cpp
def llama_recorder() -> Recorder:
    ok = lambda r: httpx.Response(200, json={"ok": True})  # noqa: E731
    return Recorder({
        "GET /slots": lambda r: httpx.Response(200, content=fixture("llama_cpp/slots.json")),
        "POST /slots/0": ok, "POST /slots/1": ok,
        "GET /metrics": lambda r: httpx.Response(200, content=fixture("llama_cpp/metrics.txt")),
        "POST /tokenize": lambda r: httpx.Response(200, json={"tokens": [1, 2, 3]}),
        "POST /v1/chat/completions": lambda r: httpx.Response(200, json={"usage": {}}),
    })


def test_llama_cpp_pins_sessions_to_slots() -> None:
    rec = llama_recorder()
    a = adapter(LlamaCppAdapter, rec)
    assert isinstance(a, LlamaCppAdapter)

    async def run() -> None:
        await a.start()
        assert len(a.slots) == 2
        h1 = hints("alice")
        await a.begin(h1)
        assert h1.slot is not None
        body = a.prepare(chat_body(), h1)
        assert body["id_slot"] == h1.slot and body["cache_prompt"] is True
        h2 = hints("bob")
        await a.begin(h2)
        assert h2.slot is not None and h2.slot != h1.slot
        h3 = hints("carol")
        await a.begin(h3)
        assert h3.slot is None  # both busy: the server picks
        a.end(h1)
        a.end(h2)
        again = hints("alice")
        await a.begin(again)
        assert again.slot == h1.slot  # KV affinity inside the engine
        a.end(again)

    asyncio.run(run())


def test_llama_cpp_retention_pin_offload_discard() -> None:
    rec = llama_recorder()
    a = adapter(LlamaCppAdapter, rec)
    assert isinstance(a, LlamaCppAdapter)

    async def turn(session: str) -> int | None:
        h = hints(session)
        await a.begin(h)
        a.end(h)
        return h.slot

    async def run() -> None:
        await a.start()
        s_alice = await turn("alice")
        await a.retain("alice", RetentionDecision("pin", 60.0), 0.0)
        s_bob = await turn("bob")
        assert s_bob != s_alice  # alice's slot is pinned
        # offload bob: saved through the slots API, restored after his slot was taken
        await a.retain("bob", RetentionDecision("offload", 60.0), 0.0)
        saves = [r for r in rec.requests if r.url.params.get("action") == "save"]
        assert len(saves) == 1 and json.loads(saves[0].content)["filename"] == "ts-bob.bin"
        assert await turn("carol") == s_bob  # the only unpinned slot
        assert await turn("bob") == s_bob
        restores = [r for r in rec.requests if r.url.params.get("action") == "restore"]
        assert len(restores) == 1 and json.loads(restores[0].content)["filename"] == "ts-bob.bin"
        assert restores[0].url.path == f"/slots/{s_bob}"
        assert await turn("dave") == s_bob
        await a.retain("dave", RetentionDecision("discard"), 0.0)
        erases = [r for r in rec.requests if r.url.params.get("action") == "erase"]
        assert len(erases) == 1

    asyncio.run(run())


def test_llama_cpp_stats_and_tokenize() -> None:
    a = adapter(LlamaCppAdapter, llama_recorder())
    stats = asyncio.run(a.stats())
    assert stats is not None and (stats.running, stats.queue_len) == (2, 1)
    assert stats.counters == {"prompt_tokens_computed": 415.0, "prefix_hit_tokens": 200.0,
                              "output_tokens": 12.0}
    assert asyncio.run(a.tokenize("abc")) == 3


# ----------------------------------------------------------------------------- fast client
def test_fast_client_keep_alive_chunked_and_stale_connections() -> None:
    eng = start_fake(tpot_s=0.001)
    port = eng.server.port
    try:
        async def run() -> None:
            c = FastHttpClient(eng.url, read_timeout_s=5)
            body = json.dumps(chat_body(max_tokens=3)).encode()
            for _ in range(3):
                r = await c.post("/v1/chat/completions", body, {"x-a": "1"})
                assert r.status == 200
                assert json.loads(await r.read())["usage"]["completion_tokens"] == 3
            assert len(c._idle) == 1  # one connection, reused
            r = await c.post("/v1/chat/completions",
                             json.dumps(chat_body(max_tokens=5, stream=True)).encode(), {})
            data = await r.read()  # chunked transfer encoding
            assert data.count(b"data: ") == 7 and data.endswith(b"[DONE]\n\n")
            await c.aclose()

        asyncio.run(run())
    finally:
        eng.stop()

    async def stale() -> None:
        first = start_fake(port=port)
        c = FastHttpClient(first.url, read_timeout_s=5)
        body = json.dumps(chat_body()).encode()
        await (await c.post("/v1/chat/completions", body, {})).read()
        first.stop()  # the kept-alive connection is now dead
        second = start_fake(port=port)
        try:
            r = await c.post("/v1/chat/completions", body, {})  # resent on a new connection
            assert r.status == 200 and await r.read()
            assert len(second.engine.requests) == 1
        finally:
            second.stop()
        with pytest.raises(ConnectFailed):
            await FastHttpClient(f"http://127.0.0.1:{port}").post("/x", b"", {})

    asyncio.run(stale())


def test_fast_client_read_timeout() -> None:
    eng = start_fake(ttft_s=2.0)
    try:
        async def run() -> None:
            c = FastHttpClient(eng.url, read_timeout_s=0.2)
            with pytest.raises(TimeoutError):
                await c.post("/v1/chat/completions", json.dumps(chat_body()).encode(), {})
            assert not c._idle

        asyncio.run(run())
    finally:
        eng.stop()


def test_llama_cpp_pins_expire_on_the_clock_the_gateway_gives() -> None:
    """One clock: a pin's TTL counts from the ``now_s`` handed to ``retain`` (the gateway's
    clock, which continues across restarts), not from this process's monotonic clock."""
    rec = llama_recorder()
    a = adapter(LlamaCppAdapter, rec)
    assert isinstance(a, LlamaCppAdapter)

    async def run() -> None:
        await a.start()
        for session in ("alice", "dave"):
            h = ForwardHints(session, "r", 0.0, now_s=999.0)
            await a.begin(h)
            a.end(h)
            await a.retain(session, RetentionDecision("pin", 5.0), 1000.0)
        # the slot a new session's turn would be bound to
        assert choose_slot(a.slots, "bob", 1001.0)[1] is None  # both slots pinned until 1005
        assert choose_slot(a.slots, "bob", 1010.0)[1] is not None  # both pins expired

    asyncio.run(run())
