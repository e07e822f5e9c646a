"""Test and benchmark helpers: a fake OpenAI-compatible engine served in a thread.

:class:`FakeEngine` answers ``/v1/chat/completions`` and ``/v1/completions`` (streamed or not)
with ``max_tokens`` one-character tokens after ``ttft_s`` and ``tpot_s`` per token, serves
``/health``, ``/v1/models``, ``/metrics`` (llama.cpp-style names) and ``/slots``, records
every request, and can be told to fail (``fail = "status:503"``, ``"crash"`` before the
response, ``"abort"``: a 200 that vLLM gives a running request it dropped —
``finish_reason: "abort"``, a stream of only a role chunk and that finish, without ``[DONE]``;
``"abort_waiting"``: vLLM's stream for a request dropped before it ran — a role chunk, a usage
chunk with 0 tokens and ``[DONE]``, no finish reason —
``"die_after:3"`` mid-stream, ``"end_after:3"``: the stream closed cleanly after 3
events, without ``[DONE]``, ``"error_after:3"``: after 3 events vLLM's error event as its
engine core dies — ``{"error": {..., "code": 500}}`` — then ``[DONE]``) or stall
(``stall = True``: requests in flight stop making progress but keep their connections open,
as a dying engine's may). With zero delays it is the zero-cost target of the overhead
benchmark.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from turnstile.gateway.embedded import ServerThread

__all__ = ["FakeEngine", "FakeServer", "chat_body", "start_fake"]

#: vLLM's error event on a stream whose engine core died (its text, as 0.32 sends it)
_ENGINE_ERROR = (b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace '
                 b'(above) for the root cause.", "type": "InternalServerError", "param": null, '
                 b'"code": 500}}\n\n')

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass
class FakeRequest:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    at_s: float

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")


@dataclass
class FakeEngine:
    """A scriptable OpenAI-compatible engine (an ASGI app)."""

    model: str = "tiny"
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    default_max_tokens: int = 16
    slots: int = 4
    #: each slot's context as ``GET /slots`` reports it (``n_ctx``; None: not reported)
    slot_ctx: int | None = None
    #: failure to inject on the next requests: None, "status:CODE", "crash", "abort",
    #: "abort_waiting", "die_after:N", "end_after:N"
    fail: str | None = None
    healthy: bool = True
    #: ``/health`` answers after this long (a busy engine's starved HTTP front end)
    health_delay_s: float = 0.0
    #: requests in flight make no progress while set (their connections stay open)
    stall: bool = False
    record: bool = True
    #: report ``prompt_tokens`` as characters / 4 of the request (else a constant 8)
    count_prompt: bool = False
    requests: list[FakeRequest] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    cancelled: int = 0
    completed: int = 0
    _cache: dict[tuple[str, int, bool, bool], bytes | list[bytes]] = field(default_factory=dict)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while True:
                    msg = await receive()
                    if msg["type"] == "lifespan.startup":
                        await send({"type": "lifespan.startup.complete"})
                    elif msg["type"] == "lifespan.shutdown":
                        await send({"type": "lifespan.shutdown.complete"})
                        return
            return
        path = scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            await self._complete(scope, receive, send, path)
        elif path == "/health":
            if self.health_delay_s:
                await asyncio.sleep(self.health_delay_s)
            await _send(send, 200 if self.healthy else 503, _JSON,
                        b'{"status":"ok"}' if self.healthy else b'{"status":"loading"}')
        elif path == "/v1/models":
            body = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            await _send(send, 200, _JSON, json.dumps(body).encode())
        elif path == "/metrics":
            text = (f"llamacpp:requests_processing {self.in_flight}\n"
                    f"llamacpp:requests_deferred 0\n"
                    f"llamacpp:tokens_predicted_total {self.completed}\n")
            await _send(send, 200, [(b"content-type", b"text/plain")], text.encode())
        elif path.startswith("/slots"):
            if scope["method"] == "GET":
                body = json.dumps([{"id": i, "is_processing": False}
                                   | ({} if self.slot_ctx is None else {"n_ctx": self.slot_ctx})
                                   for i in range(self.slots)])
                await _send(send, 200, _JSON, body.encode())
            else:
                await _read(receive)
                await _send(send, 200, _JSON, b'{"ok":true}')
        elif path == "/tokenize":
            raw = await _read(receive)
            n = max(1, len(json.loads(raw).get("content", "")) // 4)
            await _send(send, 200, _JSON, json.dumps({"tokens": list(range(n))}).encode())
        else:
            await _send(send, 404, _JSON, b'{"error":"not found"}')

    def _response(self, path: str, n: int, stream: bool, usage: bool,
                  prompt_tokens: int = 8) -> bytes | list[bytes]:
        key = (path, n, stream, usage)
        cached = self._cache.get(key) if prompt_tokens == 8 else None
        if cached is not None:
            return cached
        chat = path == "/v1/chat/completions"
        base = {"id": "cmpl-fake", "created": 0, "model": self.model,
                "object": ("chat.completion" if chat else "text_completion")}
        u = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
             "total_tokens": prompt_tokens + n}
        out: bytes | list[bytes]
        if not stream:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "x" * n}
            else:
                choice["text"] = "x" * n
            out = json.dumps({**base, "choices": [choice], "usage": u}).encode()
        else:
            base["object"] = "chat.completion.chunk" if chat else "text_completion"
            events = []
            for i in range(n):
                if chat:
                    delta: dict[str, Any] = {"content": "x"}
                    if i == 0:
                        delta["role"] = "assistant"
                    c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
                else:
                    c = {"index": 0, "text": "x", "finish_reason": None}
                events.append({**base, "choices": [c]})
            last: dict[str, Any] = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                                    else {"index": 0, "text": "", "finish_reason": "length"})
            events.append({**base, "choices": [last]})
            if usage:
                events.append({**base, "choices": [], "usage": u})
            out = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
            out.append(b"data: [DONE]\n\n")
        if prompt_tokens == 8:
            self._cache[key] = out
        return out

    async def _complete(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        raw = await _read(receive)
        body = json.loads(raw)
        if self.record:
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.requests.append(FakeRequest(path, body, headers, time.monotonic()))
        fail = self.fail
        if fail is not None and fail.startswith("status:"):
            code = int(fail.split(":")[1])
            await _send(send, code, _JSON, b'{"error":{"message":"injected","code":%d}}' % code)
            return
        if fail == "crash":
            raise RuntimeError("injected crash")
        if fail in ("abort", "abort_waiting"):
            await self._aborted(send, path, bool(body.get("stream")), fail == "abort_waiting")
            return
        n = body.get("max_tokens") or body.get("max_completion_tokens") or self.default_max_tokens
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") or {}
        prompt = max(1, len(raw) // 4) if self.count_prompt else 8
        resp = self._response(path, int(n), stream, bool(opts.get("include_usage")), prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if not stream:
                assert isinstance(resp, bytes)
                delay = self.ttft_s + self.tpot_s * n
                if delay > 0:
                    await _sleep_or_disconnect(receive, delay)
                await self._while_stalled(receive)
                await _send(send, 200, _JSON, resp)
            else:
                assert isinstance(resp, list)
                die_after = int(fail.split(":")[1]) if fail and fail.startswith("die_after:") \
                    else -1
                end_after = int(fail.split(":")[1]) if fail and fail.startswith("end_after:") \
                    else -1
                error_after = int(fail.split(":")[1]) \
                    if fail and fail.startswith("error_after:") else -1
                await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                if self.ttft_s > 0:
                    await _sleep_or_disconnect(receive, self.ttft_s)
                for i, ev in enumerate(resp):
                    if i == die_after:
                        raise RuntimeError("injected death mid-stream")
                    if i == end_after:
                        break
                    if i == error_after:
                        for ev in (_ENGINE_ERROR, b"data: [DONE]\n\n"):
                            await send({"type": "http.response.body", "body": ev,
                                        "more_body": True})
                        break
                    if i and self.tpot_s > 0 and i < n:
                        await _sleep_or_disconnect(receive, self.tpot_s)
                    await self._while_stalled(receive)
                    await send({"type": "http.response.body", "body": ev, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.completed += 1
        except _Disconnected:
            self.cancelled += 1
        finally:
            self.in_flight -= 1


    async def _aborted(self, send: Send, path: str, stream: bool, waiting: bool) -> None:
        chat = path == "/v1/chat/completions"
        base = {"id": "cmpl-fake", "created": 0, "model": self.model}
        if not stream:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "abort"}
            choice |= {"message": {"role": "assistant", "content": ""}} if chat else {"text": ""}
            body = {**base, "choices": [choice], "usage": {"prompt_tokens": 8,
                                                           "completion_tokens": 0}}
            await _send(send, 200, _JSON, json.dumps(body, separators=(",", ":")).encode())
            return
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}} if chat else \
            {"index": 0, "text": ""}
        last = {"index": 0, "delta": {}, "finish_reason": "abort"} if chat else \
            {"index": 0, "text": "", "finish_reason": "abort"}
        usage = {"prompt_tokens": 8, "completion_tokens": 0, "total_tokens": 8}
        events = ([{**base, "choices": [first]}, {**base, "choices": [], "usage": usage}]
                  if waiting else [{**base, "choices": [c]} for c in (first, last)])
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        for e in events:
            ev = b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": ev, "more_body": True})
        end = b"data: [DONE]\n\n" if waiting else b""
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _while_stalled(self, receive: Receive) -> None:
        while self.stall:
            await _sleep_or_disconnect(receive, 0.02)


class _Disconnected(Exception):
    pass


async def _sleep_or_disconnect(receive: Receive, delay_s: float) -> None:
    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task}, timeout=delay_s)
        if done:
            raise _Disconnected
    finally:
        task.cancel()


async def _read(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@dataclass
class FakeServer:
    """A :class:`FakeEngine` and the thread serving it."""

    engine: FakeEngine
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()

    def stop_listening(self) -> None:
        """Begin a shutdown as uvicorn does: stop listening (new connections are refused) and
        close idle kept-alive connections, but leave those with a request in flight open;
        with ``engine.stall`` they stay silent."""
        server = self.server.server

        def shut() -> None:
            for srv in server.servers:
                srv.close()
            for conn in list(server.server_state.connections):
                conn.shutdown()

        server.servers[0].get_loop().call_soon_threadsafe(shut)


def start_fake(port: int = 0, **kw: Any) -> FakeServer:
    engine = FakeEngine(**kw)
    return FakeServer(engine, ServerThread(engine, lifespan="off", port=port).start())


def chat_body(content: str = "hello", max_tokens: int = 4, **kw: Any) -> dict[str, Any]:
    """A minimal chat request body for the fake engine's model."""
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **kw}
