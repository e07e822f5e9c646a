"""What the gateway tells the scheduler core beyond a request's size: each engine's metadata
from its config (TP degree, bucket), and the tool returns a chat request reports.

Tool returns follow OpenAI's chat format: the ``tool`` messages after the last ``assistant``
message are the returns of that assistant turn's tool calls. Each becomes a
:class:`~turnstile.workload.model.ToolCall` with the tool's name (the message's ``name``, else
the matching ``tool_calls`` entry's function name), its result size in tokens (characters / 4)
and its status (the message's optional ``status``: ``ok``, ``error`` or ``timeout``; else a
result that starts with ``Error`` is a failure, one that starts with ``Timeout`` a timeout).
Bucket routers (``cmlfq``) read them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from turnstile.core.state import EngineLoad
from turnstile.workload.model import ToolCall, ToolStatus

__all__ = ["engine_loads", "tool_returns"]

_STATUSES: dict[str, ToolStatus] = {"ok": "ok", "success": "ok", "error": "error",
                                    "failure": "error", "timeout": "timeout"}


def engine_loads(adapters: Sequence[Any], configs: Sequence[Any]) -> list[EngineLoad]:
    """One core engine record per adapter (KV capacity from its ``kv_tokens`` option, slots from
    a llama.cpp engine's ``slots``), with
    ``tp``/``bucket`` from the engine configs when
    they line up with the adapters (same count, in order)."""
    meta = configs if len(configs) == len(adapters) else [None] * len(adapters)
    out = []
    for a, c in zip(adapters, meta, strict=True):
        tp = int(getattr(c, "tp", 1) or 1)
        # ``kv_tokens`` (engine option): the KV capacity the release policy's KV gate needs
        kv_tokens = int(a.options.get("kv_tokens", 0) or 0)
        # ``slots`` (llama.cpp option): sessions it keeps at once; the adapter finds them from
        # the server when not given (``Gateway.start``)
        kv_slots = int(a.options.get("slots", 0) or 0) if a.kind == "llama.cpp" else 0
        out.append(EngineLoad(a.id, kv_tokens, weight=a.weight, tp=tp,
                              bucket=getattr(c, "bucket", ""), kv_slots=kv_slots))
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _status_of(text: str) -> ToolStatus:
    if text.startswith("Error"):
        return "error"
    if text.startswith("Timeout"):
        return "timeout"
    return "ok"


def tool_returns(body: dict[str, Any]) -> tuple[ToolCall, ...]:
    """The tool returns reported by a chat request (see the module docstring); ``()`` when
    there are none (or the request is not a chat request)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ()
    tail: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for msg in reversed(messages):
        if not isinstance(msg, dict):
            return ()
        role = msg.get("role")
        if role == "assistant":
            for call in msg.get("tool_calls") or ():
                if isinstance(call, dict):
                    fn = call.get("function") or {}
                    names[str(call.get("id", ""))] = str(fn.get("name", "tool"))
            break
        if role == "tool":
            tail.append(msg)
        elif tail:
            break
    out = []
    for msg in reversed(tail):
        text = _text(msg.get("content"))
        name = msg.get("name") or names.get(str(msg.get("tool_call_id", "")), "tool")
        raw = str(msg.get("status", "")).lower()
        status = _STATUSES.get(raw) or _status_of(text)
        out.append(ToolCall(str(name), 0.0, status, math.ceil(len(text) / 4)))
    return tuple(out)
