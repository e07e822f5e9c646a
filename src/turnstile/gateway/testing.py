"""Test and benchmark helpers: a fake OpenAI-compatible engine and uvicorn in a thread.

:class:`FakeEngine` answers ``/v1/chat/completions`` and ``/v1/completions`` (streamed or not)
with ``max_tokens`` one-character tokens after ``ttft_s`` and ``tpot_s`` per token, serves
``/health``, ``/v1/models``, ``/metrics`` (llama.cpp-style names) and ``/slots``, records
every request, and can be told to fail (``fail = "status:503"``, ``"crash"`` before the
response, ``"die_after:3"`` mid-stream). With zero delays it is the zero-cost target of the
overhead benchmark.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

__all__ = ["FakeEngine", "FakeServer", "GatewayProcess", "GatewayServer", "ServerThread",
           "chat_body", "start_fake", "start_gateway"]

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
    #: failure to inject on the next requests: None, "status:CODE", "crash", "die_after:N"
    fail: str | None = None
    healthy: bool = True
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
                body = json.dumps([{"id": i, "is_processing": False} for i in range(self.slots)])
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
                await _send(send, 200, _JSON, resp)
            else:
                assert isinstance(resp, list)
                die_after = int(fail.split(":")[1]) if fail and fail.startswith("die_after:") \
                    else -1
                await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                if self.ttft_s > 0:
                    await _sleep_or_disconnect(receive, self.ttft_s)
                for i, ev in enumerate(resp):
                    if i == die_after:
                        raise RuntimeError("injected death mid-stream")
                    if i and self.tpot_s > 0 and i < n:
                        await _sleep_or_disconnect(receive, self.tpot_s)
                    await send({"type": "http.response.body", "body": ev, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.completed += 1
        except _Disconnected:
            self.cancelled += 1
        finally:
            self.in_flight -= 1


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


class ServerThread:
    """Serve an ASGI app with uvicorn on a loopback port, in a daemon thread.

    The socket is bound before the thread starts, so ``port`` is known at once.
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0,
                 lifespan: str = "auto", log_level: str = "warning") -> None:
        self.app = app
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (else Nagle and
        # delayed ACKs add ~40 ms to every response written in two parts)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, host=host, port=self.port, loop="asyncio", http="h11",
                                lifespan=lifespan, access_log=False, log_level=log_level,
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name=f"uvicorn-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on port {self.port} did not start in {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                self.server.force_exit = True
                self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def start_fake(port: int = 0, **kw: Any) -> FakeServer:
    engine = FakeEngine(**kw)
    return FakeServer(engine, ServerThread(engine, lifespan="off", port=port).start())


@dataclass
class GatewayServer:
    """A gateway app served in a thread (``gateway`` is its :class:`Gateway`)."""

    app: Any
    server: ServerThread

    @property
    def gateway(self) -> Any:
        return self.app.gateway

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def start_gateway(engines: list[Any], *, policy: str = "eager", policies: Any = None,
                  kind: str = "llama.cpp", port: int = 0, **cfg: Any) -> GatewayServer:
    """Serve a gateway over ``engines`` (URLs or adapters); ``cfg``: GatewayConfig fields."""
    from turnstile.gateway.adapters import EngineAdapter, make_adapter
    from turnstile.gateway.app import GatewayApp
    from turnstile.gateway.config import EngineConfig, GatewayConfig, build_policies
    from turnstile.gateway.service import Gateway

    cfg.setdefault("stats_interval_s", 0.0)
    config = GatewayConfig(policy=policy, **cfg)
    adapters = [e if isinstance(e, EngineAdapter) else make_adapter(e, kind) for e in engines]
    config.engines = [EngineConfig(a.base_url, a.kind) for a in adapters]
    gw = Gateway(config, adapters=adapters,
                 policies=policies or build_policies(policy, config.policy_params))
    app = GatewayApp(gw)
    return GatewayServer(app, ServerThread(app, port=port).start())


def chat_body(content: str = "hello", max_tokens: int = 4, **kw: Any) -> dict[str, Any]:
    """A minimal chat request body for the fake engine's model."""
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **kw}


class GatewayProcess:
    """``python -m turnstile.gateway serve`` as a subprocess, so a test can SIGKILL it (a crash)."""

    def __init__(self, config: Path, port: int, log: Path, *extra_args: str) -> None:
        self.config = config
        self.port = port
        self.log = log
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> GatewayProcess:
        import httpx

        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "turnstile.gateway", "serve", "--config",
                 str(self.config), "--port", str(self.port), *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
