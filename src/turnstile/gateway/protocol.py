"""What the gateway answers: request and outcome types, OpenAI-style errors, SSE helpers.

Transport-free: :mod:`.app` turns an :class:`Outcome` into ASGI messages; the service and its
relay build them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "JSON_CT", "SSE_HEADERS", "GatewayError", "Outcome",
           "TurnRequest", "cached_outcome", "cached_tokens", "collect_delta", "collect_message",
           "completion_tokens", "error_body", "has_token",
           "sse_from_response", "started"]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_CT = (b"content-type", b"application/json")


class GatewayError(Exception):
    """An error answered to the client as an OpenAI-style JSON error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = list(headers)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type_: str, code: str | int | None = None) -> bytes:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


@dataclass(slots=True)
class TurnRequest:
    path: str
    body: dict[str, Any]
    stream: bool
    session_id: str | None = None
    request_id: str | None = None
    tenant: str = "default"
    #: ``x-turnstile-engine``: the engine the client asks for (only the ``hinted`` routing
    #: policy acts on it)
    engine_hint: str | None = None
    #: ``x-turnstile-probe``: served, never recorded (:mod:`.recorder`)
    probe: bool = False
    #: ``x-turnstile-session-end: 1`` or ``x-dynamo-session-final: true``: no turn follows
    #: this one (the session closes when it is over)
    session_end: bool = False


@dataclass(slots=True)
class Outcome:
    """What to answer: a whole body, or a stream of SSE events (status already decided).

    A stream's generator is already started (its first event is ``first``), so closing it
    always runs its clean-up: whoever receives an Outcome with ``events`` must ``aclose`` it.
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes | None = None
    events: AsyncGenerator[bytes, None] | None = None
    first: bytes = b""



def completion_tokens(usage: Any) -> int | None:
    if isinstance(usage, dict):
        n = usage.get("completion_tokens")
        if isinstance(n, int):
            return n
    return None


def cached_tokens(usage: Any) -> int | None:
    """Prompt tokens the engine served from its prefix cache (OpenAI ``prompt_tokens_details``),
    which the release policy's KV-miss feedback (``cvar``) reads."""
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
    return None


def has_token(choices: Any) -> bool:
    for c in choices:
        if not isinstance(c, dict):
            continue
        if c.get("text"):
            return True
        d = c.get("delta")
        if isinstance(d, dict) and (d.get("content") or d.get("tool_calls")
                                    or d.get("reasoning_content")):
            return True
    return False


def collect_delta(choices: list[Any], reply: list[str], args: list[str]) -> None:
    """A streamed chunk's content (onto ``reply``) and tool-call argument fragments (onto
    ``args``), from its first choice."""
    c = choices[0]
    d = c.get("delta") if isinstance(c, dict) else None
    if not isinstance(d, dict):
        return
    if isinstance(d.get("content"), str):
        reply.append(d["content"])
    for call in d.get("tool_calls") or ():
        f = call.get("function") if isinstance(call, dict) else None
        if isinstance(f, dict) and isinstance(f.get("arguments"), str):
            args.append(f["arguments"])


def collect_message(obj: dict[str, Any], reply: list[str], args: list[str]) -> None:
    """A whole (not streamed) reply's content (onto ``reply``) and tool-call arguments (onto
    ``args``); a malformed body raises (KeyError, IndexError, TypeError, AttributeError)."""
    msg = obj["choices"][0].get("message") or {}
    reply.append(msg.get("content") or "")
    for c in msg.get("tool_calls") or ():
        args.append(c["function"]["arguments"])


async def started(out: Outcome) -> Outcome:
    """Start a stream outcome's generator (see :class:`Outcome`)."""
    assert out.events is not None
    try:
        out.first = await out.events.__anext__()
    except StopAsyncIteration:
        out.first = b""
    return out


async def sse_from_response(path: str, resp: dict[str, Any]) -> AsyncGenerator[bytes, None]:
    """A complete (non-streamed) response replayed as an OpenAI SSE stream."""
    base: dict[str, Any] = {k: resp.get(k) for k in ("id", "created", "model") if k in resp}
    chat = path == CHAT_PATH
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    for ch in resp.get("choices") or ():
        idx = ch.get("index", 0)
        if chat:
            msg = ch.get("message") or {}
            delta = {"role": msg.get("role", "assistant"), "content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = msg["tool_calls"]
            first = {"index": idx, "delta": delta, "finish_reason": None}
            last = {"index": idx, "delta": {}, "finish_reason": ch.get("finish_reason")}
        else:
            first = {"index": idx, "text": ch.get("text", ""), "finish_reason": None}
            last = {"index": idx, "text": "", "finish_reason": ch.get("finish_reason")}
        for c in (first, last):
            yield b"data: " + json.dumps({**base, "choices": [c]}).encode() + b"\n\n"
    if resp.get("usage") is not None:
        yield (b"data: " + json.dumps({**base, "choices": [], "usage": resp["usage"]}).encode()
               + b"\n\n")
    yield b"data: [DONE]\n\n"


def cached_outcome(rid: str, status: int, body: bytes, path: str, stream: bool) -> Outcome:
    """A kept result answered again (a retried ``x-request-id``), as a stream if asked."""
    headers = [(b"x-request-id", rid.encode()), (b"x-turnstile-cached", b"1")]
    if not stream or status != 200:
        return Outcome(status, [JSON_CT, *headers], body=body)
    return Outcome(200, [*SSE_HEADERS, *headers], events=sse_from_response(path, json.loads(body)))
