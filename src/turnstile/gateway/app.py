"""The gateway's HTTP face: a plain ASGI application (served by uvicorn).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI schemas, streamed
as SSE or not, bodies passed through), ``GET /v1/models``, ``GET /health`` (liveness),
``GET /ready`` (readiness, :mod:`.overload`), ``GET /metrics`` (Prometheus; behind the token
too with ``auth_admin``). Any other path is a 404 in OpenAI's error shape, whatever the method.

Written against ASGI directly rather than a framework: the request path is a handful of dict
lookups, which keeps the gateway's own latency well under a millisecond, and it needs two
things frameworks make awkward — choosing the HTTP status only once the engine's first event
arrived, and noticing a client that disconnects while its turn is held.

Errors are OpenAI-shaped (``{"error": {"message", "type", "code"}}``): 400 malformed JSON
(nesting too deep included) or fields, 401 bad bearer token, 404 unknown model or route, 405,
409 duplicate in-flight ``x-request-id``, 413 oversized body, 431 oversized headers, 429
(with ``Retry-After``) when the holding queue is full, 502/504 when engines fail; anything
unexpected is a 500 of the same shape (logged without the request's content).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from turnstile.gateway.config import GatewayConfig
from turnstile.gateway.identity import read_body, request_identity
from turnstile.gateway.overload import readiness
from turnstile.gateway.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    JSON_CT,
    GatewayError,
    Outcome,
    TurnRequest,
    error_body,
)
from turnstile.gateway.service import Gateway

__all__ = ["GatewayApp", "create_app"]

log = logging.getLogger("turnstile.gateway")

#: nesting deeper than this is refused (what the gateway and the engine re-encode stays far
#: from Python's recursion limit)
_MAX_DEPTH = 64
#: a session id taken from the body's ``user`` is echoed in a response header: anything but
#: printable ASCII (control characters would break the response) is replaced by its hash
_HEADER_SAFE = re.compile(r"[\x21-\x7e]{1,256}")
#: a ``\u`` escape of a UTF-16 surrogate (D800-DFFF): only such a body may hold a string that
#: is not valid Unicode (one whose surrogate has no pair), so only such a body is walked
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_GET_ROUTES = frozenset(("/health", "/ready", "/metrics", "/v1/models"))

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class GatewayApp:
    """ASGI callable around a :class:`Gateway` (its lifespan starts and stops it)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        cfg = gateway.config
        self._auth = f"Bearer {cfg.auth_token}".encode() if cfg.auth_token else None
        self._max_body = cfg.max_body_bytes
        self._max_header = cfg.max_header_bytes
        self._body_timeout_s = cfg.client_body_timeout_s
        self._auth_admin = cfg.auth_admin and self._auth is not None
        self._count_children: dict[tuple[str, int], Any] = {}

    def _counts(self, path: str, status: int) -> Any:
        key = (path, status)
        child = self._count_children.get(key)
        if child is None:
            child = self._count_children[key] = self.gateway.metrics.requests.labels(
                path, str(status))
        return child

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.gateway.start()
                except Exception as e:  # reported to uvicorn, which exits
                    log.exception("gateway failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.gateway.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ routing
    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        sent: list[bool] = []

        async def tracked(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                sent.append(True)
            await send(msg)

        try:
            await self._route(scope, receive, tracked, path)
        except Exception as e:
            # a bug, not the client's fault: its type and the path at error level; the
            # traceback (whose message may quote the request) at debug only
            log.error("unhandled %s on %s", type(e).__name__, path)
            log.debug("unhandled error on %s", path, exc_info=True)
            if not sent:
                await _error(send, GatewayError(500, "internal error", type_="server_error",
                                                code="internal_error"), path)

    async def _route(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        method = scope["method"]
        if path in (CHAT_PATH, COMPLETIONS_PATH):
            if method != "POST":
                await _error(send, GatewayError(405, f"{path} takes POST",
                                                code="method_not_allowed"), path)
                return
            await self._completions(scope, receive, send, path)
            return
        if path not in _GET_ROUTES:
            # OpenAI's own answer to a route it does not serve: 404 "Invalid URL (METHOD /path)"
            await _error(send, GatewayError(404, f"Invalid URL ({method} {path})",
                                            code="not_found"), path)
            return
        if method not in ("GET", "HEAD"):
            await _error(send, GatewayError(405, f"{path} takes GET",
                                            code="method_not_allowed"), path)
            return
        if path == "/health":
            await self._health(send, self._authorized(scope))
        elif path == "/ready":
            ok, detail = await readiness(self.gateway)
            if self._auth_admin and not self._authorized(scope):
                detail = {"status": detail["status"]}
            await _respond(send, 200 if ok else 503, [JSON_CT], json.dumps(detail).encode())
        elif path == "/metrics":
            if self._auth_admin and not self._authorized(scope):
                await _error(send, _unauthorized(), path)
                return
            await _respond(send, 200, [(b"content-type", b"text/plain; version=0.0.4")],
                           self.gateway.metrics.render())
        elif path == "/v1/models":
            if not self._authorized(scope):
                await _error(send, _unauthorized(), path)
                return
            await self._models(send)

    def _authorized(self, scope: Scope) -> bool:
        if self._auth is None:
            return True
        for k, v in scope["headers"]:
            if k == b"authorization":
                return hmac.compare_digest(v, self._auth)
        return False

    async def _health(self, send: Send, detail: bool) -> None:
        gw = self.gateway
        up = gw.engine_up
        ok = gw.started and any(up.values())
        out: dict[str, Any] = {"status": "ok" if ok else "unavailable"}
        if detail or not self._auth_admin:
            out.update(policy=gw.policies.spec, engines=up, held_turns=gw.scheduler.held_turns,
                       sessions=len(gw.sessions))
        await _respond(send, 200 if ok else 503, [JSON_CT], json.dumps(out).encode())

    async def _models(self, send: Send) -> None:
        data = [{"id": m, "object": "model", "owned_by": "turnstile"}
                for m in self.gateway.models]
        await _respond(send, 200, [JSON_CT],
                       json.dumps({"object": "list", "data": data}).encode())

    # ------------------------------------------------------------------ completions
    async def _completions(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        counts = self._counts
        try:
            req = await self._parse(scope, receive, path)
        except GatewayError as e:
            counts(path, e.status).inc()
            await _error(send, e, path)
            return
        # One watcher per request: when the client disconnects it cancels this task, wherever
        # it is (held, waiting for the engine, or streaming), and the clean-up runs from there.
        me = asyncio.current_task()
        assert me is not None
        gone: list[bool] = []
        watch = asyncio.ensure_future(_watch_disconnect(receive, me, gone))
        outcome: Outcome | None = None
        status = 499
        try:
            try:
                outcome = await self.gateway.handle(req)
            except GatewayError as e:
                status = e.status
                await _error(send, e, path)
                return
            status = outcome.status
            if outcome.events is None:
                assert outcome.body is not None
                await _respond(send, outcome.status, outcome.headers, outcome.body)
                return
            await send({"type": "http.response.start", "status": outcome.status,
                        "headers": outcome.headers})
            if outcome.first:
                await send({"type": "http.response.body", "body": outcome.first,
                            "more_body": True})
                async for ev in outcome.events:
                    await send({"type": "http.response.body", "body": ev, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            me.uncancel()  # the client went away: nothing to answer
            status = 499
        finally:
            watch.cancel()
            if outcome is not None and outcome.events is not None:
                with contextlib.suppress(BaseException):
                    await outcome.events.aclose()
            if gone and me.cancelling():
                me.uncancel()
            counts(path, status).inc()

    async def _parse(self, scope: Scope, receive: Receive, path: str) -> TurnRequest:
        if not self._authorized(scope):
            raise _unauthorized()
        header_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        for k, v in scope["headers"]:
            header_bytes += len(k) + len(v) + 4
        if header_bytes > self._max_header:
            raise GatewayError(431, f"request headers of {header_bytes} bytes exceed the limit "
                               f"of {self._max_header}", code="headers_too_large")
        ident = request_identity(scope["headers"])
        length = ident.content_length
        if length > self._max_body:
            raise _too_large(length, self._max_body)
        raw = await self._read_body(receive)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise GatewayError(400, f"request body is not valid JSON: {e}",
                               code="invalid_json") from None
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply",
                               code="invalid_json") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object", code="invalid_json")
        if _MAY_HOLD_SURROGATE.search(raw):
            _check_encodable(body)
        if raw.count(b"[") + raw.count(b"{") > _MAX_DEPTH and _depth(body) > _MAX_DEPTH:
            raise GatewayError(400, f"request body is nested deeper than {_MAX_DEPTH}",
                               code="invalid_json")
        _validate(path, body)
        self.gateway.check_model(body)
        read_body(ident, body)
        session_id = ident.session_id
        if (session_id is not None and ident.session_source in ("prompt_cache_key", "user")
                and not _HEADER_SAFE.fullmatch(session_id)):
            session_id = _hashed("user-", session_id)
        parent_session, session_end = ident.parent_session, ident.session_end
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise GatewayError(400, "'stream' must be a boolean", code="invalid_value")
        recorder = self.gateway.recorder
        if recorder is not None and session_id:  # sub-agents and explicit ends: see .recorder
            if parent_session:
                recorder.note_parent(session_id, parent_session)
            if session_end:
                recorder.note_end(session_id)
        return TurnRequest(path, body, stream, session_id, ident.request_id, ident.tenant,
                           ident.engine_hint, probe=ident.probe,
                           session_end=session_end)


    async def _read_body(self, receive: Receive) -> bytes:
        """The whole body, within ``client_body_timeout_s`` (408 and the connection closed
        past it) and ``max_body_bytes`` (413)."""
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + self._body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise GatewayError(499, "client disconnected")
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > self._max_body:
                        raise _too_large(size, self._max_body)
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            raise GatewayError(408, f"request body not received within "
                               f"{self._body_timeout_s:g} s ({size} bytes arrived)",
                               code="request_timeout",
                               headers=[(b"connection", b"close")]) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _check_encodable(doc: Any) -> None:
    """400 when a string of the parsed body (a key or a value) is not valid Unicode: JSON lets
    ``\\ud800`` stand alone, but no engine can encode a lone UTF-16 surrogate."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        x, where = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                _encodable(k, f"{where}.{k}" if where else str(k))
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(x, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(x))
        elif isinstance(x, str):
            _encodable(x, where)


def _encodable(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        name = where[:200].encode("ascii", "backslashreplace").decode() or "a key"
        raise GatewayError(400, f"request body: {name} holds a lone UTF-16 surrogate "
                           f"(\\u{ord(text[e.start]):04x}), which is not valid Unicode",
                           code="invalid_unicode") from None


def _validate(path: str, body: dict[str, Any]) -> None:
    """The fields the gateway reads, checked for type (the rest goes to the engine as sent)."""
    if path == CHAT_PATH:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise GatewayError(400, "'messages' must be a non-empty array",
                               code="invalid_messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise GatewayError(400, f"messages[{i}] must be an object with a 'role'",
                                   code="invalid_messages")
            _check_message(i, m)
        for key in ("tools", "functions"):
            tools = body.get(key)
            if tools is None:
                continue
            if not isinstance(tools, list):
                raise GatewayError(400, f"'{key}' must be an array", code="invalid_value")
            for j, t in enumerate(tools):
                fn = t.get("function", t) if isinstance(t, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or (
                        key == "tools" and not isinstance(t.get("type"), str)):
                    raise GatewayError(400, f"{key}[{j}] must be an object with a 'type' and a "
                                       "'function' naming it", code="invalid_value")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise GatewayError(400, "'prompt' must be a string or a non-empty array",
                               code="invalid_prompt")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise GatewayError(400, f"'{key}' must be a positive integer", code="invalid_value")
    for key in ("user", "model"):
        v = body.get(key)
        if v is not None and not isinstance(v, str):
            raise GatewayError(400, f"'{key}' must be a string", code="invalid_value")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise GatewayError(400, "'stream_options' must be an object", code="invalid_value")


def _check_message(i: int, m: dict[str, Any]) -> None:
    """The string fields engines parse as strings (llama.cpp answers a wrong type with a 500,
    which is the request's fault, not the engine's)."""
    def bad(what: str) -> GatewayError:
        return GatewayError(400, f"messages[{i}].{what}", code="invalid_messages")

    content = m.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            raise bad("content must be a string or an array of content parts")
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str) or (
                    part["type"] == "text" and not isinstance(part.get("text"), str)):
                raise bad("content parts must be objects with a 'type' (text parts a 'text')")
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise bad(f"{key} must be a string")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise bad("tool_calls must be an array")
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", ""), str)
                or any(c.get(k) is not None and not isinstance(c[k], str) for k in ("id", "type"))):
            raise bad("tool_calls must be objects with string 'id', 'type' and a 'function' "
                      "with a string 'name' and 'arguments'")


def _hashed(prefix: str, text: str) -> str:
    return prefix + hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                    digest_size=12).hexdigest()


def _depth(doc: Any) -> int:
    """Nesting depth of a parsed JSON document (iterative: any depth json.loads accepts)."""
    deepest = 0
    stack = [(doc, 1)]
    while stack:
        x, d = stack.pop()
        if d > deepest:
            deepest = d
        if isinstance(x, dict):
            stack.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, d + 1) for v in x)
    return deepest


def _unauthorized() -> GatewayError:
    return GatewayError(401, "missing or wrong bearer token", type_="authentication_error",
                        code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])


def _too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(413, f"request body of {size} bytes exceeds the limit of {limit}",
                        code="body_too_large")


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], gone: list[bool]
                            ) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            gone.append(True)
            task.cancel()
            return


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _error(send: Send, e: GatewayError, path: str) -> None:
    if e.status == 499:
        return
    await _respond(send, e.status, [JSON_CT, *e.headers],
                   error_body(e.message, e.type, e.code))


def create_app(config: GatewayConfig | None = None, *, gateway: Gateway | None = None
               ) -> GatewayApp:
    """The ASGI app for ``config`` (or around an existing ``gateway``)."""
    if gateway is None:
        if config is None:
            raise ValueError("create_app needs a config or a gateway")
        gateway = Gateway(config)
    return GatewayApp(gateway)
