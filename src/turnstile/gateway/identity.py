"""Who a request says it is: the session, request, tenant and hints read from its headers and
body, the same way for every front (``turnstile serve`` and ``turnstile epp``).

Session id, first match wins:

1. ``x-session-id`` (turnstile's own header);
2. ``x-dynamo-session-id`` (NVIDIA Dynamo's agent sessions);
3. ``x-smg-routing-key`` (SGLang's model gateway routing key);
4. the body's ``prompt_cache_key`` (OpenAI's prompt-cache routing key: one per conversation);
5. the body's ``user`` (OpenAI's end-user id).

None of them: the gateway derives the session from the conversation (:mod:`.affinity`).

A sub-agent names its parent with ``x-turnstile-parent-session`` or
``x-dynamo-parent-session-id``; ``x-turnstile-session-end: 1`` (or Dynamo's
``x-dynamo-session-final: true``) marks a session's last turn.

Hints for the policies (:class:`Identity`): Dynamo's ``nvext.agent_hints`` — ``osl`` (expected
output tokens: the turn's output estimate), ``priority`` (higher is more urgent in Dynamo) and
``latency_sensitivity`` (seconds the request counts as having arrived earlier).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["SESSION_HEADERS", "Identity", "read_body", "request_identity"]

#: headers naming the session, in precedence order
SESSION_HEADERS = (b"x-session-id", b"x-dynamo-session-id", b"x-smg-routing-key")
_PARENT_HEADERS = (b"x-turnstile-parent-session", b"x-dynamo-parent-session-id")


@dataclass(slots=True)
class Identity:
    session_id: str | None = None
    request_id: str | None = None
    tenant: str = "default"
    engine_hint: str | None = None
    parent_session: str | None = None
    session_end: bool = False
    #: ``x-turnstile-probe: 1``: a request that learns about the server (served, not recorded)
    probe: bool = False
    content_length: int = -1
    #: where the session id came from (a header name, ``prompt_cache_key``, ``user``) or None
    session_source: str | None = None
    #: ``nvext.agent_hints.osl``: the output tokens the client expects
    output_tokens_hint: int | None = None
    #: ``nvext.agent_hints.priority`` (Dynamo: higher is more urgent)
    priority_hint: float | None = None
    #: ``nvext.agent_hints.latency_sensitivity`` (seconds)
    latency_sensitivity_s: float | None = None


def _str(v: bytes) -> str | None:
    return v.decode("latin-1").strip() or None


def request_identity(headers: Iterable[tuple[bytes, bytes]], body: dict[str, Any] | None = None
                     ) -> Identity:
    """Read a request's identity from its (lower-case) headers and, when given, its JSON body."""
    ident = Identity()
    named: dict[bytes, str] = {}
    for k, v in headers:
        if k in SESSION_HEADERS:
            if (s := _str(v)) is not None:
                named.setdefault(k, s)
        elif k == b"x-request-id":
            ident.request_id = _str(v)
        elif k == b"content-length":
            with contextlib.suppress(ValueError):
                ident.content_length = int(v)
        elif k == b"x-tenant-id":
            ident.tenant = _str(v) or "default"
        elif k == b"x-turnstile-engine":
            ident.engine_hint = _str(v)
        elif k in _PARENT_HEADERS:
            if ident.parent_session is None:
                ident.parent_session = _str(v)
        elif k in (b"x-turnstile-session-end", b"x-dynamo-session-final"):
            ident.session_end = v.strip().lower() in (b"1", b"true", b"yes")
        elif k == b"x-turnstile-probe":
            ident.probe = v.strip().lower() in (b"1", b"true", b"yes")
    for h in SESSION_HEADERS:
        if h in named:
            ident.session_id = named[h]
            ident.session_source = h.decode()
            break
    if body is not None:
        read_body(ident, body)
    return ident


def read_body(ident: Identity, body: dict[str, Any]) -> None:
    """The body's part of the identity: a session key when no header named one, and hints."""
    if ident.session_id is None:
        for key in ("prompt_cache_key", "user"):
            v = body.get(key)
            if isinstance(v, str) and v.strip():
                ident.session_id = v.strip()
                ident.session_source = key
                break
    nvext = body.get("nvext")
    hints = nvext.get("agent_hints") if isinstance(nvext, dict) else None
    if not isinstance(hints, dict):
        return
    osl = hints.get("osl")
    if isinstance(osl, int | float) and not isinstance(osl, bool) and osl > 0:
        ident.output_tokens_hint = int(osl)
    prio = hints.get("priority")
    if isinstance(prio, int | float) and not isinstance(prio, bool):
        ident.priority_hint = float(prio)
    lat = hints.get("latency_sensitivity")
    if isinstance(lat, int | float) and not isinstance(lat, bool) and lat >= 0:
        ident.latency_sensitivity_s = float(lat)
